/* Compiled inner loops for the hot codecs in schemas/codecs/.
 *
 * Optional: when this module does not build (a gateway without a C compiler), codecs.py runs
 * its numpy versions, which give the same bytes and the same floats. To keep them identical the
 * float arithmetic here is the numpy versions' step for step, in float32, and the module is
 * compiled with -ffp-contract=off so that no multiply-add is fused.
 *
 * The stochastic encoders (ternary, qsgd) draw from a counter-based stream that bits.uniforms
 * draws in numpy too, so both give the same bytes; topk keeps the same values both ways (ties to
 * the lowest index), by a sampled radix select here and numpy's partition there.
 *
 * The loops are plain C that compilers vectorise. On x86-64 with glibc each loop is also built
 * for AVX2 and AVX-512 (x86-64-v4) and picked at load time (target_clones): the SSE2 baseline
 * lacks the conversions and unsigned compares these loops need, and runs them 2 to 3 times slower.
 *
 * The Python-facing functions take buffers (bytes, bytearray, memoryview, numpy arrays) and
 * check their sizes; the caller has already checked a payload's length against its shape. The
 * encoders return their payload as a new bytes object, written in place (no copy).
 *
 * poly1305 (the server journal's record tags) is OpenSSL 3's, its libcrypto.so.3 opened on first use
 * (dlopen: nothing to build against; Debian's Python links the same library); the GIL released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <dlfcn.h>
#endif

#if defined(__x86_64__) && defined(__GLIBC__) && (defined(__GNUC__) || defined(__clang__))
#define X86_DISPATCH 1
#define HOT __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#include <immintrin.h>
#else
#define X86_DISPATCH 0
#define HOT
#endif

typedef Py_ssize_t idx;

/* Round half to even for |v| < 2**22, as np.rint does, without libm. */
static inline float round_even(float v) {
    const float magic = 12582912.0f; /* 1.5 * 2**23 */
    return (v + magic) - magic;
}

/* ---- loops: no Python objects, no GIL ---- */

#if X86_DISPATCH
/* AVX-512 (F, BW, DQ, VL) versions of the fp16, ternary, qsgd (8-bit codes) and topk loops, written with
 * intrinsics: the compiler's vectorisation of the plain loops reached 0.2-0.3 of copy there (byte marks
 * packed into bits, one value's random draw at a time). Each does the plain loop's float32 operations in
 * the same order, so the bytes are the same; `avx512` says whether this CPU runs them (PyInit). */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
static int avx512, avx512_cpu;

/* draw(s0, s1, i0 + t) for t = 0..15: the counter-based stream below (mix32), sixteen at a time. */
AVX512 static inline __m512 draws16(uint32_t s0, uint32_t s1, uint32_t i0) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i h = _mm512_add_epi32(_mm512_set1_epi32((int)(i0 + s0)), lanes);
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)0x7feb352du));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 15));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)0x846ca68bu));
    h = _mm512_ternarylogic_epi32(h, _mm512_srli_epi32(h, 16), _mm512_set1_epi32((int)s1), 0x96); /* h ^ h >> 16 ^ s1 */
    h = _mm512_srli_epi32(h, 8);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(h), _mm512_set1_ps(0x1p-24f));
}

/* ternary on [c, hi) sixteen at a time (c a multiple of 16): the bit planes straight from the compare masks.
 * Returns where it stopped. */
AVX512 static idx ternary_avx512(const float *restrict x, idx c, idx hi, uint32_t s0, uint32_t s1, float inv,
                                 uint8_t *restrict pos, uint8_t *restrict neg) {
    const __m512 scale = _mm512_set1_ps(inv), zero = _mm512_setzero_ps();
    for (; c + 16 <= hi; c += 16) {
        __m512 v = _mm512_loadu_ps(x + c);
        __m512 t = _mm512_mul_ps(_mm512_abs_ps(v), scale);
        __mmask16 kept = _mm512_cmp_ps_mask(draws16(s0, s1, (uint32_t)c), t, _CMP_LT_OQ);
        __mmask16 below = _mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ);
        uint16_t p = (uint16_t)(kept & ~below), m = (uint16_t)(kept & below);
        memcpy(pos + c / 8, &p, 2);
        memcpy(neg + c / 8, &m, 2);
    }
    return c;
}

/* qsgd's squares of x[0..32) added into four chains of eight double partial sums (partial sum k gets the
 * values k mod 32: the plain loop's order; four chains hide the adds' latency). */
typedef struct {
    __m512d p[4];
} Squares;

AVX512 static inline void square32_avx512(const float *restrict x, Squares *s) {
    __m512 v = _mm512_loadu_ps(x), w = _mm512_loadu_ps(x + 16);
    __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(v)), b = _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1));
    __m512d c = _mm512_cvtps_pd(_mm512_castps512_ps256(w)), d = _mm512_cvtps_pd(_mm512_extractf32x8_ps(w, 1));
    s->p[0] = _mm512_add_pd(s->p[0], _mm512_mul_pd(a, a));
    s->p[1] = _mm512_add_pd(s->p[1], _mm512_mul_pd(b, b));
    s->p[2] = _mm512_add_pd(s->p[2], _mm512_mul_pd(c, c));
    s->p[3] = _mm512_add_pd(s->p[3], _mm512_mul_pd(d, d));
}

AVX512 static inline Squares squares_load(const double *partial) {
    Squares s;
    for (int k = 0; k < 4; k++) s.p[k] = _mm512_loadu_pd(partial + 8 * k);
    return s;
}

AVX512 static inline void squares_store(const Squares *s, double *partial) {
    for (int k = 0; k < 4; k++) _mm512_storeu_pd(partial + 8 * k, s->p[k]);
}

/* qsgd's squares of [i, hi), thirty-two at a time, added into partial; returns where it stopped. */
AVX512 static idx squares_avx512(const float *restrict x, idx i, idx hi, double *partial) {
    Squares s = squares_load(partial);
    for (; i + 32 <= hi; i += 32) square32_avx512(x + i, &s);
    squares_store(&s, partial);
    return i;
}

/* qsgd's 8-bit signed levels of sixteen values from c: min(|v| * inv + draw, levels) in float (floor(min(f, L)) ==
 * min(floor(f), L) for an integer L), v's sign put on it, truncated (-trunc(f) == trunc(-f)). */
AVX512 static inline __m512i qsgd16_avx512(const float *restrict x, idx c, uint32_t s0, uint32_t s1, __m512 scale,
                                           __m512 most) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    __m512 v = _mm512_loadu_ps(x + c);
    __m512 f = _mm512_min_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_abs_ps(v), scale), draws16(s0, s1, (uint32_t)c)), most);
    __m512i signed_ = _mm512_ternarylogic_epi32(_mm512_castps_si512(f), _mm512_castps_si512(v), sign, 0xf8); /* f | v & sign */
    return _mm512_cvttps_epi32(_mm512_castsi512_ps(signed_));
}

/* qsgd's 8-bit codes of [c, hi): sixty-four at a time (two saturating packs and one dword shuffle where four
 * narrowing stores would take twice the shuffle port), then sixteen; returns where it stopped. Meanwhile the
 * squares of [*next, next_hi) (the next bucket) are added into partial, sixty-four a step: *next moves on. */
AVX512 static idx qsgd8_avx512(const float *restrict x, idx c, idx hi, uint32_t s0, uint32_t s1, float inv,
                               int32_t levels, uint8_t *restrict codes, idx *next, idx next_hi, double *partial) {
    Squares squares = squares_load(partial);
    idx j = *next;
    const __m512 scale = _mm512_set1_ps(inv), most = _mm512_set1_ps((float)levels);
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (; c + 64 <= hi; c += 64) {
        __m512i a = qsgd16_avx512(x, c, s0, s1, scale, most), b = qsgd16_avx512(x, c + 16, s0, s1, scale, most);
        __m512i d = qsgd16_avx512(x, c + 32, s0, s1, scale, most), e = qsgd16_avx512(x, c + 48, s0, s1, scale, most);
        __m512i packed = _mm512_packs_epi16(_mm512_packs_epi32(a, b), _mm512_packs_epi32(d, e)); /* per 128-bit lane */
        _mm512_storeu_si512((void *)(codes + c), _mm512_permutexvar_epi32(order, packed));
        if (j + 64 <= next_hi) { /* the next bucket's squares: its memory read overlaps this bucket's arithmetic */
            square32_avx512(x + j, &squares);
            square32_avx512(x + j + 32, &squares);
            j += 64;
        }
    }
    squares_store(&squares, partial);
    *next = j;
    for (; c + 16 <= hi; c += 16)
        _mm_storeu_si128((__m128i *)(void *)(codes + c), _mm512_cvtepi32_epi8(qsgd16_avx512(x, c, s0, s1, scale, most)));
    return c;
}

/* fp16 of [0, n) sixteen at a time by the CPU's conversion (nearest even) after clipping to +-65504; a block
 * holding a NaN is left to the plain loop (its payload rule). Returns where it stopped. */
AVX512 static idx fp16_avx512(const uint32_t *restrict x, uint16_t *restrict h, idx n,
                              void (*plain)(const uint32_t *restrict, uint16_t *restrict, idx)) {
    const __m512i signs = _mm512_set1_epi32((int)0x80000000u), inf = _mm512_set1_epi32(0x7f800000),
                  clip = _mm512_set1_epi32(0x477fe000);
    idx c = 0;
    for (; c + 16 <= n; c += 16) {
        __m512i b = _mm512_loadu_si512(x + c), sign = _mm512_and_si512(b, signs), ax = _mm512_xor_si512(b, sign);
        if (_mm512_cmpgt_epu32_mask(ax, inf)) {
            plain(x + c, h + c, 16);
            continue;
        }
        __m512 f = _mm512_castsi512_ps(_mm512_or_si512(_mm512_min_epu32(ax, clip), sign));
        _mm256_storeu_si256((__m256i *)(void *)(h + c), _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    return c;
}

/* keys_at_least's gather sixteen at a time (compress-stores); returns where it stopped, *count and *top updated. */
AVX512 static idx gather_avx512(const uint32_t *restrict bits, idx n, uint32_t low, uint32_t *restrict out,
                                uint32_t *restrict kept, idx *count, uint32_t *top) {
    const __m512i keys = _mm512_set1_epi32(0x7fffffff), least = _mm512_set1_epi32((int)low), step = _mm512_set1_epi32(16);
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), most = _mm512_setzero_si512();
    idx c = 0, got = *count;
    for (; c + 16 <= n; c += 16, at = _mm512_add_epi32(at, step)) {
        __m512i b = _mm512_loadu_si512(bits + c), key = _mm512_and_si512(b, keys);
        most = _mm512_max_epu32(most, key);
        __mmask16 m = _mm512_cmpge_epu32_mask(key, least);
        if (m) { /* compressed in a register, stored whole (a compress-store to memory is slow on some parts):
                  * the callers' arrays have 16 entries of room past n */
            _mm512_storeu_si512(kept + got, _mm512_maskz_compress_epi32(m, b));
            _mm512_storeu_si512(out + got, _mm512_maskz_compress_epi32(m, at));
            got += __builtin_popcount(m);
        }
    }
    uint32_t largest = _mm512_reduce_max_epu32(most);
    *top = largest > *top ? largest : *top;
    *count = got;
    return c;
}

__attribute__((target("avx2"))) static void sign_bits_avx2(const float *restrict x, uint8_t *restrict p, idx n) {
    const __m256 zero = _mm256_setzero_ps();
    for (idx j = 0; j < n / 8; j++)
        p[j] = (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + 8 * j), zero, _CMP_LT_OQ));
}
#endif

/* max |x[lo:hi]| from the bits (for non-negative floats, bit order is value order); 0 if a value is not finite. */
static inline int largest_abs(const uint32_t *restrict bits, idx lo, idx hi, float *largest) {
    uint32_t top = 0;
    for (idx i = lo; i < hi; i++) {
        uint32_t m = bits[i] & 0x7fffffffu;
        top = m > top ? m : top;
    }
    memcpy(largest, &top, 4);
    return top < 0x7f800000u;
}

/* Returns 0 if a value is not finite (nothing useful is written then). */
HOT static int int8_encode_loop(const float *restrict x, float *restrict scales, int8_t *restrict q, idx n,
                                idx bucket) {
    const uint32_t *bits = (const uint32_t *)x;
    for (idx lo = 0; lo < n; lo += bucket) {
        idx hi = lo + bucket < n ? lo + bucket : n;
        float largest;
        if (!largest_abs(bits, lo, hi, &largest)) return 0;
        float scale = largest / 127.0f;
        float inv = scale > 1e-30f ? 1.0f / scale : 0.0f;
        scales[lo / bucket] = scale;
        for (idx i = lo; i < hi; i++) q[i] = (int8_t)(int32_t)round_even(x[i] * inv);
    }
    return 1;
}

HOT static void int8_decode_loop(const float *restrict scales, const int8_t *restrict q, float *restrict y, idx n,
                                 idx bucket) {
    for (idx lo = 0; lo < n; lo += bucket) {
        idx hi = lo + bucket < n ? lo + bucket : n;
        float scale = scales[lo / bucket];
        for (idx i = lo; i < hi; i++) y[i] = (float)q[i] * scale;
    }
}

/* Exact, like numpy's float16 -> float32 cast. Branch-free selects, so that it vectorises. */
HOT static void fp16_decode_loop(const uint16_t *restrict h, uint32_t *restrict y, idx n) {
    for (idx i = 0; i < n; i++) {
        uint32_t em = h[i] & 0x7fffu, bits = em << 13, sign = (uint32_t)(h[i] & 0x8000u) << 16;
        uint32_t normal = bits + (112u << 23); /* rebias the exponent from 15 to 127 */
        float f; /* subnormals (and zero): scale by 2**112 in float, which is exact */
        memcpy(&f, &bits, 4);
        f *= 0x1p112f;
        uint32_t subnormal;
        memcpy(&subnormal, &f, 4);
        uint32_t small = 0u - (uint32_t)(em < 0x400u), special = 0u - (uint32_t)(em >= 0x7c00u);
        uint32_t r = (subnormal & small) | (normal & ~small);
        r = ((bits | 0x7f800000u) & special) | (r & ~special); /* inf and nan keep their payload */
        y[i] = r | sign;
    }
}

/* float32 -> binary16 exactly as numpy's cast (nearest even; NaN payloads), after clipping to +-65504 (the fp16
 * codec's rule: a large value is not inf). Branch-free selects, so that it vectorises: a subnormal half
 * comes from adding a magic float (the FPU rounds), a normal one from rebiasing with a rounding bias. */
HOT static void fp16_encode_loop(const uint32_t *restrict x, uint16_t *restrict h, idx n) {
    const uint32_t magic = (127u - 15u + 23u - 10u + 1u) << 23; /* 2**-1 scale: subnormal halves */
    float magic_f;
    memcpy(&magic_f, &magic, 4);
    for (idx i = 0; i < n; i++) {
        uint32_t sign = x[i] & 0x80000000u, ax = x[i] ^ sign;
        uint32_t nan = 0u - (uint32_t)(ax > 0x7f800000u);
        uint32_t a = ax < 0x477fe000u ? ax : 0x477fe000u; /* clip to 65504 (inf too) */
        float f;
        memcpy(&f, &a, 4);
        f += magic_f;
        uint32_t fb;
        memcpy(&fb, &f, 4);
        uint32_t sub = fb - magic;
        uint32_t norm = (a + ((uint32_t)(15 - 127) << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
        uint32_t small = 0u - (uint32_t)(a < (113u << 23));
        uint32_t r = (sub & small) | (norm & ~small);
        uint32_t payload = (ax >> 13) & 0x3ffu; /* a NaN keeps its top payload bits, never becoming inf */
        r = ((0x7c00u | payload | (uint32_t)(payload == 0u)) & nan) | (r & ~nan);
        h[i] = (uint16_t)(r | (sign >> 16));
    }
}

/* Bits x < 0, eight values to a byte, first value in the low bit; n / 8 full bytes. */
static void sign_bits(const float *restrict x, uint8_t *restrict p, idx n) {
#if X86_DISPATCH
    if (__builtin_cpu_supports("avx2")) { /* compilers do not find movemask on their own */
        sign_bits_avx2(x, p, n);
        return;
    }
#endif
    for (idx j = 0; j < n / 8; j++) {
        const float *v = x + 8 * j;
        p[j] = (uint8_t)((v[0] < 0) | (v[1] < 0) << 1 | (v[2] < 0) << 2 | (v[3] < 0) << 3 | (v[4] < 0) << 4 |
                         (v[5] < 0) << 5 | (v[6] < 0) << 6 | (v[7] < 0) << 7);
    }
}

/* scale = mean |x| per bucket: 32 float partial sums (four independent vector chains), added in
 * double; bit = x < 0. */
HOT static void sign_encode_loop(const float *restrict x, float *restrict scales, uint8_t *restrict p, idx n,
                                 idx bucket) {
    for (idx lo = 0; lo < n; lo += bucket) {
        idx hi = lo + bucket < n ? lo + bucket : n, i = lo;
        float partial[32] = {0};
        for (; i + 32 <= hi; i += 32)
            for (int k = 0; k < 32; k++) partial[k] += __builtin_fabsf(x[i + k]);
        double total = 0;
        for (int k = 0; k < 32; k++) total += partial[k];
        for (; i < hi; i++) total += __builtin_fabsf(x[i]);
        scales[lo / bucket] = (float)(total / (double)(hi - lo));
    }
    sign_bits(x, p, n);
    if (n % 8) {
        uint8_t last = 0;
        for (idx i = n / 8 * 8; i < n; i++) last |= (uint8_t)((x[i] < 0) << (i & 7));
        p[n / 8] = last;
    }
}

/* The bucket is a multiple of 8, so each byte of bits shares one scale; the full bytes run a
 * fixed eight-value inner loop, which compilers vectorise, and the last byte the general one. */
HOT static void sign_decode_loop(const float *restrict scales, const uint8_t *restrict p, uint32_t *restrict y,
                                 idx n, idx bucket) {
    for (idx lo = 0; lo < n; lo += bucket) {
        idx last = (lo + bucket < n ? lo + bucket : n) / 8; /* full bytes of this bucket end here */
        uint32_t scale;
        memcpy(&scale, &scales[lo / bucket], 4);
        for (idx j = lo / 8; j < last; j++)
            for (int k = 0; k < 8; k++) y[8 * j + k] = scale ^ (((uint32_t)p[j] >> k & 1u) << 31); /* - : sign flip */
    }
    if (n % 8) {
        uint32_t scale, byte = p[n / 8];
        memcpy(&scale, &scales[n / 8 * 8 / bucket], 4);
        for (idx i = n / 8 * 8; i < n; i++) y[i] = scale ^ (((byte >> (i & 7)) & 1u) << 31);
    }
}

static inline float ternary_value(uint32_t pos, uint32_t neg, int k, float scale) {
    return (float)((int)((pos >> k) & 1u) - (int)((neg >> k) & 1u)) * scale;
}

/* Returns 0 if a value has both bits set. */
HOT static int ternary_decode_loop(const float *restrict scales, const uint8_t *restrict pos,
                                   const uint8_t *restrict neg, float *restrict y, idx n, idx bucket) {
    uint8_t both = 0;
    for (idx j = 0; j < n / 8; j++) both |= pos[j] & neg[j];
    if (n % 8) both |= pos[n / 8] & neg[n / 8] & (uint8_t)((1u << (n % 8)) - 1u); /* padding bits are ignored */
    if (both) return 0;
    for (idx lo = 0; lo < n; lo += bucket) {
        idx last = (lo + bucket < n ? lo + bucket : n) / 8; /* full bytes of this bucket end here */
        float scale = scales[lo / bucket];
        for (idx j = lo / 8; j < last; j++)
            for (int k = 0; k < 8; k++) y[8 * j + k] = ternary_value(pos[j], neg[j], k, scale);
    }
    for (idx i = n / 8 * 8; i < n; i++) y[i] = ternary_value(pos[i / 8], neg[i / 8], (int)(i & 7), scales[i / bucket]);
    return 1;
}

/* Codes are two's complement levels of `bits` bits (2, 4 or 8), first value in the low bits.
 * Returns 0 if a level lies beyond +-levels. */
HOT static int qsgd_decode_loop(const float *restrict steps, const uint8_t *restrict c, int bits, int levels,
                                float *restrict y, idx n, idx bucket) {
    int bad = 0;
    if (bits == 8) {
        for (idx lo = 0; lo < n; lo += bucket) {
            idx hi = lo + bucket < n ? lo + bucket : n;
            float step = steps[lo / bucket];
            for (idx i = lo; i < hi; i++) {
                int level = (int8_t)c[i];
                bad |= level < -levels || level > levels;
                y[i] = (float)level * step;
            }
        }
        return !bad;
    }
    int per = 8 / bits, shift = 32 - bits;
    uint32_t mask = (1u << bits) - 1;
    for (idx i = 0; i < n; i++) {
        uint32_t code = (c[i / per] >> ((i % per) * bits)) & mask;
        int level = (int32_t)(code << shift) >> shift; /* sign-extend */
        bad |= level < -levels || level > levels;
        y[i] = (float)level * steps[i / bucket];
    }
    return !bad;
}

/* ---- the stochastic codecs' random source ----
 * Counter-based: value i of the stream keyed (s0, s1) is the lowbias32 integer hash of i + s0, xor s1, so values
 * are drawn independently of each other and of order, and the loops vectorise.
 * schemas/codecs/bits.py: uniforms draws the same numbers with numpy. */
static inline uint32_t mix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    return h;
}

/* Eight 0/1 bytes as one byte of bits, the first in the low bit. */
static inline uint8_t pack8(const uint8_t *b) {
    uint64_t v;
    memcpy(&v, b, 8);
    return (uint8_t)((v * 0x0102040810204080ull) >> 56);
}

#define CHUNK 64 /* values coded at a time into a small buffer, then packed; buckets are multiples of 8 */

/* A chunk's CHUNK 0/1 bytes as CHUNK / 8 bytes of bits, the first in the low bit. */
static inline void pack_chunk(const uint8_t *restrict b, uint8_t *restrict out) {
    for (int j = 0; j < CHUNK / 8; j++) out[j] = pack8(b + 8 * j);
}

/* Value i of the stream: a float32 in [0, 1) with 24 random bits. */
static inline float draw(uint32_t s0, uint32_t s1, uint32_t i) { return (float)((mix32(i + s0) ^ s1) >> 8) * 0x1p-24f; }

/* TernGrad on one chunk of `size` values from index i0: kept when uniform(i) < |x| * inv, as 0/1 bytes. */
static inline void ternary_chunk(const float *restrict x, uint32_t i0, uint32_t s0, uint32_t s1, float inv,
                                 uint8_t *restrict p, uint8_t *restrict m, idx size) {
    for (idx t = 0; t < size; t++) {
        float v = x[t];
        int kept = draw(s0, s1, i0 + (uint32_t)t) < __builtin_fabsf(v) * inv, below = v < 0.0f;
        p[t] = (uint8_t)(kept & !below);
        m[t] = (uint8_t)(kept & below);
    }
}

/* TernGrad: scale = max |x| per bucket; value i is kept (+-scale) when uniform(i) < |x| / scale. Returns 0 if a
 * value is not finite. */
HOT static int ternary_encode_loop(const float *restrict x, uint32_t s0, uint32_t s1, float *restrict scales,
                                   uint8_t *restrict pos, uint8_t *restrict neg, idx n, idx bucket) {
    uint8_t p[CHUNK], m[CHUNK];
    for (idx lo = 0; lo < n; lo += bucket) {
        idx hi = lo + bucket < n ? lo + bucket : n;
        float scale;
        if (!largest_abs((const uint32_t *)x, lo, hi, &scale)) return 0;
        float inv = scale > 1e-30f ? 1.0f / scale : 0.0f;
        scales[lo / bucket] = scale;
        idx start = lo;
#if X86_DISPATCH
        if (avx512) start = ternary_avx512(x, lo, hi, s0, s1, inv, pos, neg);
#endif
        for (idx c = start; c < hi; c += CHUNK) {
            idx size = c + CHUNK < hi ? CHUNK : hi - c;
            if (size == CHUNK) {
                ternary_chunk(x + c, (uint32_t)c, s0, s1, inv, p, m, CHUNK); /* a fixed trip count vectorises */
                pack_chunk(p, pos + c / 8);
                pack_chunk(m, neg + c / 8);
            } else {
                memset(p, 0, CHUNK);
                memset(m, 0, CHUNK);
                ternary_chunk(x + c, (uint32_t)c, s0, s1, inv, p, m, size);
                for (idx b = 0; b < (size + 7) / 8; b++) {
                    pos[c / 8 + b] = pack8(p + 8 * b);
                    neg[c / 8 + b] = pack8(m + 8 * b);
                }
            }
        }
    }
    return 1;
}

/* QSGD levels of one chunk: min(floor(|x| * inv + uniform(i)), levels), negated for x < 0, masked to `mask`. */
static inline void qsgd_chunk(const float *restrict x, uint32_t i0, uint32_t s0, uint32_t s1, float inv, int32_t levels,
                              uint8_t mask, uint8_t *restrict q, idx size) {
    for (idx t = 0; t < size; t++) {
        float v = x[t];
        int32_t l = (int32_t)(__builtin_fabsf(v) * inv + draw(s0, s1, i0 + (uint32_t)t)); /* >= 0: this is floor */
        l = l < levels ? l : levels;
        q[t] = (uint8_t)(v < 0.0f ? -l : l) & mask;
    }
}

/* QSGD: norm = the bucket's L2 norm (squares summed in double, 32 partial sums); level = min(floor(|x| * levels
 * / norm + uniform(i)), levels), negated for x < 0, as `bits`-bit two's complement codes. Returns 0 if a norm is
 * not finite. */
HOT static int qsgd_encode_loop(const float *restrict x, uint32_t s0, uint32_t s1, int levels, int bits,
                                float *restrict norms, uint8_t *restrict codes, idx n, idx bucket) {
    uint8_t q[CHUNK];
    const uint8_t mask = (uint8_t)((1u << bits) - 1u);
    const idx per = 8 / bits;
    double partial[32] = {0};
    idx i = 0; /* the squares are summed up to here: the AVX-512 loop sums the next bucket's ahead */
    for (idx lo = 0; lo < n; lo += bucket) {
        idx hi = lo + bucket < n ? lo + bucket : n, start = lo;
        double total = 0;
#if X86_DISPATCH
        if (avx512) i = squares_avx512(x, i, hi, partial);
#endif
        for (; i + 32 <= hi; i += 32)
            for (int k = 0; k < 32; k++) partial[k] += (double)x[i + k] * (double)x[i + k];
        for (int k = 0; k < 32; k++) total += partial[k];
        for (; i < hi; i++) total += (double)x[i] * (double)x[i];
        memset(partial, 0, sizeof partial);
        float norm = (float)__builtin_sqrt(total);
        if (!(norm <= 3.4028235e38f)) return 0; /* inf or nan */
        float inv = norm > 1e-30f ? (float)levels / norm : 0.0f;
        norms[lo / bucket] = norm;
#if X86_DISPATCH
        if (avx512 && bits == 8) start = qsgd8_avx512(x, lo, hi, s0, s1, inv, levels, codes, &i, hi + bucket < n ? hi + bucket : n, partial);
#endif
        for (idx c = start; c < hi; c += CHUNK) {
            idx size = c + CHUNK < hi ? CHUNK : hi - c;
            if (size == CHUNK) {
                qsgd_chunk(x + c, (uint32_t)c, s0, s1, inv, levels, mask, q, CHUNK);
            } else {
                memset(q, 0, CHUNK);
                qsgd_chunk(x + c, (uint32_t)c, s0, s1, inv, levels, mask, q, size);
            }
            uint8_t *out = codes + c / per;
            if (bits == 8)
                memcpy(out, q, (size_t)size);
            else if (bits == 4)
                for (idx b = 0; b < (size + 1) / 2; b++) out[b] = (uint8_t)(q[2 * b] | q[2 * b + 1] << 4);
            else
                for (idx b = 0; b < (size + 3) / 4; b++)
                    out[b] = (uint8_t)(q[4 * b] | q[4 * b + 1] << 2 | q[4 * b + 2] << 4 | q[4 * b + 3] << 6);
        }
    }
    return 1;
}

/* The k-th largest (1 <= k <= count) of the keys (bits & 0x7fffffff) of floats' `bits`, by radix levels of 11, 11
 * and 9 bits, each level's keys (those in the bin the level before chose) gathered into `scratch` (count
 * entries); *ties: how many keys equal to it are among the k largest. */
static uint32_t kth_key(const uint32_t *restrict bits, idx count, idx k, idx *ties, uint32_t *restrict scratch) {
    static const int widths[3] = {11, 11, 9};
    uint32_t prefix = 0;
    int shift = 31;
    for (idx j = 0; j < count; j++) scratch[j] = bits[j] & 0x7fffffffu;
    for (int level = 0; level < 3; level++) {
        int width = widths[level];
        shift -= width;
        idx hist[2048] = {0};
        for (idx j = 0; j < count; j++) hist[scratch[j] >> shift & ((1u << width) - 1u)]++;
        uint32_t bin = (1u << width) - 1u;
        for (; hist[bin] < k; bin--) k -= hist[bin];
        prefix = prefix << width | bin;
        idx kept = 0; /* the keys in the chosen bin, without a branch to mispredict */
        for (idx j = 0; j < count; j++) {
            scratch[kept] = scratch[j];
            kept += scratch[j] >> shift == prefix;
        }
        count = kept;
    }
    *ties = k;
    return prefix;
}

/* Marks (0/1 bytes) of the keys at least `low` among `size` values, and their largest key. */
static inline uint32_t mark_at_least(const uint32_t *restrict bits, uint32_t low, uint8_t *restrict mark, idx size,
                                     uint32_t top) {
    for (idx t = 0; t < size; t++) {
        uint32_t key = bits[t] & 0x7fffffffu;
        top = key > top ? key : top;
        mark[t] = key >= low;
    }
    return top;
}

/* Indices of the values whose key is at least `low`, ascending, into `out`, and the values' bits into `kept`;
 * *largest: the largest key. Chunks are
 * marked by a loop that vectorises, then the marks read eight at a time, as few are set. */
HOT static idx keys_at_least(const uint32_t *restrict bits, idx n, uint32_t low, uint32_t *restrict out,
                             uint32_t *restrict kept, uint32_t *largest) {
    uint8_t mark[CHUNK];
    idx count = 0, start = 0;
    uint32_t top = 0;
#if X86_DISPATCH
    if (avx512) start = gather_avx512(bits, n, low, out, kept, &count, &top);
#endif
    for (idx c = start; c < n; c += CHUNK) {
        idx size = c + CHUNK < n ? CHUNK : n - c;
        if (size == CHUNK) {
            top = mark_at_least(bits + c, low, mark, CHUNK, top);
        } else {
            memset(mark, 0, CHUNK);
            top = mark_at_least(bits + c, low, mark, size, top);
        }
        for (idx j = 0; j < CHUNK; j += 8) {
            uint64_t word;
            memcpy(&word, mark + j, 8);
            for (; word; word &= word - 1) {
                idx i = c + j + __builtin_ctzll(word) / 8;
                kept[count] = bits[i];
                out[count++] = (uint32_t)i;
            }
        }
    }
    *largest = top;
    return count;
}

#define SAMPLE_BLOCKS 512 /* blocks of 16 values (a cache line each) spread over the tensor */

/* The k (1 <= k <= n) values largest in magnitude (key = bits & 0x7fffffff), ties to the lowest index, as
 * ascending indices. A sample of the keys gives a threshold that a few more than k values pass (with a margin of
 * three standard deviations); one pass gathers those candidates, and the exact k-th key is found among them. A
 * threshold that let fewer than k through is dropped for a pass over all values. The kept values go to `values`.
 * Returns 0 if a value is not finite, -1 if out of memory. */
static int topk_select_loop(const uint32_t *restrict bits, idx n, idx k, uint32_t *restrict out,
                            float *restrict values) {
    /* candidates' indices and values; pages are touched only as used */
    uint32_t *cand = malloc(sizeof(uint32_t) * (3 * (size_t)n + 32)), *held = cand + n + 16, *scratch = held + n + 16;
    uint32_t low = 0, largest; /* (16 entries of room after each: gather_avx512 stores 16 at a time) */
    if (!cand) return -1;
    idx ties, count;
    if (n >= 64 * SAMPLE_BLOCKS) {
        uint32_t sample[16 * SAMPLE_BLOCKS];
        for (idx b = 0; b < SAMPLE_BLOCKS; b++)
            for (idx t = 0; t < 16; t++) sample[16 * b + t] = bits[b * (n / SAMPLE_BLOCKS) + t] & 0x7fffffffu;
        double expect = (double)k * (16.0 * SAMPLE_BLOCKS) / (double)n;
        idx rank = (idx)(expect + 3.0 * __builtin_sqrt(expect) + 4.0);
        if (rank < 16 * SAMPLE_BLOCKS) low = kth_key(sample, 16 * SAMPLE_BLOCKS, rank, &ties, scratch);
    }
    count = keys_at_least(bits, n, low, cand, held, &largest);
    if (largest >= 0x7f800000u) {
        free(cand);
        return 0;
    }
    if (count < k) count = keys_at_least(bits, n, 0, cand, held, &largest);
    uint32_t threshold = kth_key(held, count, k, &ties, scratch);
    idx kept = 0;
    for (idx j = 0; j < count; j++) {
        uint32_t key = held[j] & 0x7fffffffu;
        if (key > threshold || (key == threshold && ties-- > 0)) {
            memcpy(&values[kept], &held[j], 4);
            out[kept++] = cand[j];
        }
    }
    free(cand);
    return 1;
}

/* The topk payload of the values kept[k] at ascending indices idx[k]: u32 k, f32 scale = max |kept| / 127, u8 index width,
 * the gaps between indices in `width` bytes, then each kept value / scale rounded to int8 (all zero when the scale
 * is 0). Little-endian host. */
static void topk_payload(const float *restrict kept, const uint32_t *restrict idx_, idx k, int width, uint8_t *out) {
    float largest = 0.0f;
    for (idx j = 0; j < k; j++) largest = __builtin_fabsf(kept[j]) > largest ? __builtin_fabsf(kept[j]) : largest;
    float scale = largest / 127.0f;
    uint32_t count = (uint32_t)k;
    memcpy(out, &count, 4);
    memcpy(out + 4, &scale, 4);
    out[8] = (uint8_t)width;
    uint8_t *gaps = out + 9;
    int8_t *q = (int8_t *)(gaps + k * width);
    for (idx j = 0; j < k; j++) {
        uint32_t gap = idx_[j] - (j ? idx_[j - 1] : 0);
        memcpy(gaps + j * width, &gap, (size_t)width); /* the low bytes of a little-endian number */
        q[j] = scale > 0.0f ? (int8_t)(int32_t)round_even(kept[j] / scale) : 0;
    }
}

/* ---- Python wrappers ---- */

#define BUCKETS(n, b) (((n) + (b) - 1) / (b))

static int need(Py_buffer *buf, idx size, const char *what) {
    if (buf->len < size) {
        PyErr_Format(PyExc_ValueError, "%s: buffer of %zd bytes, need %zd", what, buf->len, size);
        return 0;
    }
    return 1;
}

static int bucket_ok(idx bucket) {
    if (bucket <= 0 || bucket % 8) {
        PyErr_SetString(PyExc_ValueError, "bucket must be a positive multiple of 8");
        return 0;
    }
    return 1;
}

static PyObject *release(Py_buffer *a, Py_buffer *b, Py_buffer *c, Py_buffer *d, PyObject *result) {
    Py_buffer *all[4] = {a, b, c, d};
    for (int i = 0; i < 4; i++)
        if (all[i]) PyBuffer_Release(all[i]);
    if (PyErr_Occurred()) {
        Py_XDECREF(result);
        return NULL;
    }
    return result;
}

/* int8_decode(scales f32[nb], codes i8[n], out f32[n], bucket) */
static PyObject *int8_decode(PyObject *self, PyObject *args) {
    Py_buffer s, q, y;
    idx bucket;
    if (!PyArg_ParseTuple(args, "y*y*w*n", &s, &q, &y, &bucket)) return NULL;
    idx n = q.len;
    if (bucket_ok(bucket) && need(&s, 4 * BUCKETS(n, bucket), "int8 scales") && need(&y, 4 * n, "int8 out")) {
        Py_BEGIN_ALLOW_THREADS
        int8_decode_loop(s.buf, q.buf, y.buf, n, bucket);
        Py_END_ALLOW_THREADS
    }
    return release(&s, &q, &y, NULL, Py_NewRef(Py_None));
}

/* fp16_decode(halves u16[n], out f32[n]) */
static PyObject *fp16_decode(PyObject *self, PyObject *args) {
    Py_buffer h, y;
    if (!PyArg_ParseTuple(args, "y*w*", &h, &y)) return NULL;
    idx n = h.len / 2;
    if (need(&y, 4 * n, "fp16 out")) {
        Py_BEGIN_ALLOW_THREADS
        fp16_decode_loop(h.buf, y.buf, n);
        Py_END_ALLOW_THREADS
    }
    return release(&h, &y, NULL, NULL, Py_NewRef(Py_None));
}



/* sign_decode(scales f32[nb], bits u8[ceil(n/8)], out f32[n], bucket): bit 1 = -scale */
static PyObject *sign_decode(PyObject *self, PyObject *args) {
    Py_buffer s, p, y;
    idx bucket;
    if (!PyArg_ParseTuple(args, "y*y*w*n", &s, &p, &y, &bucket)) return NULL;
    idx n = y.len / 4;
    if (bucket_ok(bucket) && need(&s, 4 * BUCKETS(n, bucket), "sign scales") && need(&p, (n + 7) / 8, "sign bits")) {
        Py_BEGIN_ALLOW_THREADS
        sign_decode_loop(s.buf, p.buf, y.buf, n, bucket);
        Py_END_ALLOW_THREADS
    }
    return release(&s, &p, &y, NULL, Py_NewRef(Py_None));
}

/* ternary_decode(scales f32[nb], positive u8[], negative u8[], out f32[n], bucket) -> bool valid */
static PyObject *ternary_decode(PyObject *self, PyObject *args) {
    Py_buffer s, pos, neg, y;
    idx bucket;
    int ok = 0;
    if (!PyArg_ParseTuple(args, "y*y*y*w*n", &s, &pos, &neg, &y, &bucket)) return NULL;
    idx n = y.len / 4, plane = (n + 7) / 8;
    if (bucket_ok(bucket) && need(&s, 4 * BUCKETS(n, bucket), "ternary scales") &&
        need(&pos, plane, "ternary positive") && need(&neg, plane, "ternary negative")) {
        Py_BEGIN_ALLOW_THREADS
        ok = ternary_decode_loop(s.buf, pos.buf, neg.buf, y.buf, n, bucket);
        Py_END_ALLOW_THREADS
    }
    return release(&s, &pos, &neg, &y, PyBool_FromLong(ok));
}

/* qsgd_decode(steps f32[nb], codes u8[], bits, levels, out f32[n], bucket) -> bool valid */
static PyObject *qsgd_decode(PyObject *self, PyObject *args) {
    Py_buffer s, c, y;
    int bits, levels, ok = 0;
    idx bucket;
    if (!PyArg_ParseTuple(args, "y*y*iiw*n", &s, &c, &bits, &levels, &y, &bucket)) return NULL;
    idx n = y.len / 4;
    if (bits != 2 && bits != 4 && bits != 8) {
        PyErr_SetString(PyExc_ValueError, "qsgd codes are 2, 4 or 8 bits");
    } else if (bucket_ok(bucket) && need(&s, 4 * BUCKETS(n, bucket), "qsgd steps") &&
               need(&c, (n * bits + 7) / 8, "qsgd codes")) {
        Py_BEGIN_ALLOW_THREADS
        ok = qsgd_decode_loop(s.buf, c.buf, bits, levels, y.buf, n, bucket);
        Py_END_ALLOW_THREADS
    }
    return release(&s, &c, &y, NULL, PyBool_FromLong(ok));
}




/* ---- encoders: each returns the payload as a new bytes object, written in place ---- */

/* A bytes object of `size` bytes to fill, its buffer in *buf; NULL (MemoryError set) if none. */
static PyObject *payload(idx size, uint8_t **buf) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, size);
    if (out) *buf = (uint8_t *)PyBytes_AS_STRING(out);
    return out;
}

/* The float32 values a buffer holds, as n; 0 (ValueError set) if its length is not a multiple of 4. */
static int floats(Py_buffer *x, idx *n) {
    if (x->len % 4) {
        PyErr_SetString(PyExc_ValueError, "values must be float32");
        return 0;
    }
    *n = x->len / 4;
    return 1;
}

/* What an encoder returns: NULL if an exception is set, None when `ok` is 0 (a value it cannot encode), else its
 * payload. */
static PyObject *encoded(Py_buffer *x, PyObject *out, int ok) {
    PyBuffer_Release(x);
    if (PyErr_Occurred() || !ok) {
        Py_XDECREF(out);
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    }
    return out;
}

/* int8_encode(values f32[n], bucket) -> scales f32[nb] + codes i8[n], or None if a value is not finite */
static PyObject *int8_encode(PyObject *self, PyObject *args) {
    Py_buffer x;
    idx bucket, n;
    int ok = 0;
    uint8_t *buf;
    PyObject *out = NULL;
    if (!PyArg_ParseTuple(args, "y*n", &x, &bucket)) return NULL;
    if (bucket_ok(bucket) && floats(&x, &n) && (out = payload(4 * BUCKETS(n, bucket) + n, &buf))) {
        Py_BEGIN_ALLOW_THREADS
        ok = int8_encode_loop(x.buf, (float *)buf, (int8_t *)buf + 4 * BUCKETS(n, bucket), n, bucket);
        Py_END_ALLOW_THREADS
    }
    return encoded(&x, out, ok);
}

/* fp16_encode(values f32[n]) -> halves u16[n] */
static PyObject *fp16_encode(PyObject *self, PyObject *args) {
    Py_buffer x;
    idx n;
    uint8_t *buf;
    PyObject *out = NULL;
    if (!PyArg_ParseTuple(args, "y*", &x)) return NULL;
    if (floats(&x, &n) && (out = payload(2 * n, &buf))) {
        Py_BEGIN_ALLOW_THREADS
        idx done = 0;
#if X86_DISPATCH
        if (avx512) done = fp16_avx512(x.buf, (uint16_t *)buf, n, fp16_encode_loop);
#endif
        fp16_encode_loop((const uint32_t *)x.buf + done, (uint16_t *)buf + done, n - done);
        Py_END_ALLOW_THREADS
    }
    return encoded(&x, out, 1);
}

/* sign_encode(values f32[n], bucket) -> scales f32[nb] + bits u8[ceil(n/8)] */
static PyObject *sign_encode(PyObject *self, PyObject *args) {
    Py_buffer x;
    idx bucket, n;
    uint8_t *buf;
    PyObject *out = NULL;
    if (!PyArg_ParseTuple(args, "y*n", &x, &bucket)) return NULL;
    if (bucket_ok(bucket) && floats(&x, &n) && (out = payload(4 * BUCKETS(n, bucket) + (n + 7) / 8, &buf))) {
        Py_BEGIN_ALLOW_THREADS
        sign_encode_loop(x.buf, (float *)buf, buf + 4 * BUCKETS(n, bucket), n, bucket);
        Py_END_ALLOW_THREADS
    }
    return encoded(&x, out, 1);
}

/* ternary_encode(values f32[n], s0, s1, bucket) -> scales f32[nb] + positive + negative bit planes, or None if a
 * value is not finite */
static PyObject *ternary_encode(PyObject *self, PyObject *args) {
    Py_buffer x;
    unsigned int s0, s1;
    idx bucket, n;
    int ok = 0;
    uint8_t *buf;
    PyObject *out = NULL;
    if (!PyArg_ParseTuple(args, "y*IIn", &x, &s0, &s1, &bucket)) return NULL;
    if (bucket_ok(bucket) && floats(&x, &n) && (out = payload(4 * BUCKETS(n, bucket) + 2 * ((n + 7) / 8), &buf))) {
        uint8_t *pos = buf + 4 * BUCKETS(n, bucket), *neg = pos + (n + 7) / 8;
        Py_BEGIN_ALLOW_THREADS
        ok = ternary_encode_loop(x.buf, s0, s1, (float *)buf, pos, neg, n, bucket);
        Py_END_ALLOW_THREADS
    }
    return encoded(&x, out, ok);
}

/* qsgd_encode(values f32[n], s0, s1, levels, bits, bucket) -> norms f32[nb] + packed levels, or None if a norm
 * is not finite */
static PyObject *qsgd_encode(PyObject *self, PyObject *args) {
    Py_buffer x;
    unsigned int s0, s1;
    int levels, bits, ok = 0;
    idx bucket, n;
    uint8_t *buf;
    PyObject *out = NULL;
    if (!PyArg_ParseTuple(args, "y*IIiin", &x, &s0, &s1, &levels, &bits, &bucket)) return NULL;
    if ((bits != 2 && bits != 4 && bits != 8) || levels < 1 || levels > (1 << (bits - 1)) - 1) {
        PyErr_SetString(PyExc_ValueError, "qsgd codes are 2, 4 or 8 bits, wide enough for the levels");
    } else if (bucket_ok(bucket) && floats(&x, &n) &&
               (out = payload(4 * BUCKETS(n, bucket) + (n * bits + 7) / 8, &buf))) {
        Py_BEGIN_ALLOW_THREADS
        ok = qsgd_encode_loop(x.buf, s0, s1, levels, bits, (float *)buf, buf + 4 * BUCKETS(n, bucket), n, bucket);
        Py_END_ALLOW_THREADS
    }
    return encoded(&x, out, ok);
}

/* topk_encode(values f32[n], k) -> the topk payload (docs/PROTOCOL.md), or None if a value is not finite */
static PyObject *topk_encode(PyObject *self, PyObject *args) {
    Py_buffer x;
    idx k, n;
    int ok = 0;
    uint8_t *buf;
    PyObject *out = NULL;
    if (!PyArg_ParseTuple(args, "y*n", &x, &k)) return NULL;
    uint32_t *idx_ = NULL;
    float *kept = NULL;
    if (!floats(&x, &n)) {
    } else if (k < 1 || k > n) {
        PyErr_SetString(PyExc_ValueError, "topk keeps 1 to n values");
    } else if (!(idx_ = malloc(sizeof(uint32_t) * (size_t)k)) || !(kept = malloc(sizeof(float) * (size_t)k))) {
        PyErr_NoMemory();
    } else {
        uint32_t widest = 0;
        Py_BEGIN_ALLOW_THREADS
        ok = topk_select_loop(x.buf, n, k, idx_, kept);
        for (idx j = 0; ok > 0 && j < k; j++) {
            uint32_t gap = idx_[j] - (j ? idx_[j - 1] : 0);
            widest = gap > widest ? gap : widest;
        }
        Py_END_ALLOW_THREADS
        if (ok < 0) PyErr_NoMemory();
        int width = widest < 256 ? 1 : widest < 65536 ? 2 : 4;
        if (ok > 0 && (out = payload(9 + k * (width + 1), &buf))) {
            Py_BEGIN_ALLOW_THREADS
            topk_payload(kept, idx_, k, width, buf);
            Py_END_ALLOW_THREADS
        }
    }
    free(idx_);
    free(kept);
    return encoded(&x, out, ok > 0);
}

/* ---- the server's commit path (ps_service.flat): a few passes over the model's vector, GIL held ---- */

/* The sum of x's squares in double: 32 partial sums (partial k takes x[32g + k], g in turn), added in
 * order from 0, then the values past the last whole group one by one (bits.sum_squares's order). */
HOT static double squares_loop(const float *restrict x, idx n) {
    double partial[32] = {0}, total = 0;
    idx i = 0;
    for (; i + 32 <= n; i += 32)
        for (int k = 0; k < 32; k++) partial[k] += (double)x[i + k] * (double)x[i + k];
    for (int k = 0; k < 32; k++) total += partial[k];
    for (; i < n; i++) total += (double)x[i] * (double)x[i];
    return total;
}

/* out = ((x * a) * b) * c + 0, each step a float32 operation (the + 0 turns -0 into 0). */
HOT static void scaled_loop(const float *restrict x, float a, float b, float c, float *restrict out, idx n) {
    for (idx i = 0; i < n; i++) out[i] = ((x[i] * a) * b) * c + 0.0f;
}

/* out = x + y; whether every sum is finite. */
HOT static int add_finite_loop(const float *restrict x, const float *restrict y, float *restrict out, idx n) {
    uint32_t bad = 0;
    for (idx i = 0; i < n; i++) {
        float v = x[i] + y[i];
        uint32_t u;
        memcpy(&u, &v, 4);
        bad |= (u & 0x7f800000u) == 0x7f800000u; /* exponent all ones: inf or nan */
        out[i] = v;
    }
    return !bad;
}

/* squares(values f32[n]) -> float */
static PyObject *squares(PyObject *self, PyObject *args) {
    Py_buffer x;
    idx n;
    double total = 0;
    if (!PyArg_ParseTuple(args, "y*", &x)) return NULL;
    if (floats(&x, &n)) total = squares_loop(x.buf, n);
    return release(&x, NULL, NULL, NULL, PyErr_Occurred() ? NULL : PyFloat_FromDouble(total));
}

/* scaled(values f32[n], a, b, c, out f32[n]) */
static PyObject *scaled(PyObject *self, PyObject *args) {
    Py_buffer x, y;
    float a, b, c;
    idx n;
    if (!PyArg_ParseTuple(args, "y*fffw*", &x, &a, &b, &c, &y)) return NULL;
    if (floats(&x, &n) && need(&y, 4 * n, "scaled out")) scaled_loop(x.buf, a, b, c, y.buf, n);
    return release(&x, &y, NULL, NULL, Py_NewRef(Py_None));
}

/* add_finite(x f32[n], y f32[n], out f32[n]) -> bool every sum finite */
static PyObject *add_finite(PyObject *self, PyObject *args) {
    Py_buffer x, y, z;
    idx n;
    int ok = 0;
    if (!PyArg_ParseTuple(args, "y*y*w*", &x, &y, &z)) return NULL;
    if (floats(&x, &n) && need(&y, 4 * n, "add_finite y") && need(&z, 4 * n, "add_finite out"))
        ok = add_finite_loop(x.buf, y.buf, z.buf, n);
    return release(&x, &y, &z, NULL, PyBool_FromLong(ok));
}

/* ---- CRC-32 (zlib's: reflected 0x04C11DB7) by carry-less multiplication, for a frame's check ---- */

static uint32_t crc_table[256];

static void crc_table_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}

/* The register (no pre- or post-inversion) after bytes p[0..n), one byte at a time. */
static uint32_t crc_bytes(uint32_t c, const uint8_t *p, idx n) {
    for (idx i = 0; i < n; i++) c = crc_table[(c ^ p[i]) & 0xff] ^ (c >> 8);
    return c;
}

#if X86_DISPATCH
static int pclmul_cpu;

/* Four 16-byte lanes folded 64 bytes at a time, then into one lane 16 bytes at a time (x^(512+-32) and
 * x^(128+-32) mod P, bit-reflected: the constants of Intel's "Fast CRC Computation for Generic Polynomials
 * Using PCLMULQDQ"); the last lane and the bytes past it go through the table. The register c enters
 * xor-ed into the first four bytes. Needs n >= 64. */
__attribute__((target("pclmul,sse4.1"))) static uint32_t crc_pclmul(uint32_t c, const uint8_t *p, idx n) {
    const __m128i k4 = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL), k1 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);
    __m128i x0 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128((int)c));
    __m128i x1 = _mm_loadu_si128((const __m128i *)(p + 16)), x2 = _mm_loadu_si128((const __m128i *)(p + 32)),
            x3 = _mm_loadu_si128((const __m128i *)(p + 48));
    idx i = 64;
#define FOLD(x, k, next) _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next)
    for (; i + 64 <= n; i += 64) {
        x0 = FOLD(x0, k4, _mm_loadu_si128((const __m128i *)(p + i)));
        x1 = FOLD(x1, k4, _mm_loadu_si128((const __m128i *)(p + i + 16)));
        x2 = FOLD(x2, k4, _mm_loadu_si128((const __m128i *)(p + i + 32)));
        x3 = FOLD(x3, k4, _mm_loadu_si128((const __m128i *)(p + i + 48)));
    }
    x0 = FOLD(x0, k1, x1);
    x0 = FOLD(x0, k1, x2);
    x0 = FOLD(x0, k1, x3);
    for (; i + 16 <= n; i += 16) x0 = FOLD(x0, k1, _mm_loadu_si128((const __m128i *)(p + i)));
#undef FOLD
    uint8_t lane[16];
    _mm_storeu_si128((__m128i *)lane, x0);
    return crc_bytes(crc_bytes(0, lane, 16), p + i, n - i);
}
#endif

/* crc32(data, value=0) -> zlib.crc32(data, value) */
static PyObject *crc32(PyObject *self, PyObject *args) {
    Py_buffer b;
    unsigned int value = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &b, &value)) return NULL;
    uint32_t c = ~(uint32_t)value;
    const uint8_t *p = b.buf;
#if X86_DISPATCH
    if (pclmul_cpu && b.len >= 64)
        c = crc_pclmul(c, p, b.len);
    else
#endif
        c = crc_bytes(c, p, b.len);
    return release(&b, NULL, NULL, NULL, PyLong_FromUnsignedLong(~c));
}

/* Poly1305 by OpenSSL 3's EVP_MAC, looked up on first use (has_poly1305: whether it was found), not
 * at import: opening libcrypto and fetching the MAC cost every importer ~3 ms, and only the server's
 * journal signs. Its
 * vectorised code makes a 19 KB commit's tag in about 2 us; the point of calling it from here is
 * that the GIL is released meanwhile (the cryptography package holds it). */
typedef struct evp_mac EVP_MAC;
typedef struct evp_mac_ctx EVP_MAC_CTX;
static struct {
    EVP_MAC *mac;
    EVP_MAC_CTX *(*ctx_new)(EVP_MAC *);
    void (*ctx_free)(EVP_MAC_CTX *);
    int (*init)(EVP_MAC_CTX *, const unsigned char *, size_t, const void *);
    int (*update)(EVP_MAC_CTX *, const unsigned char *, size_t);
    int (*final)(EVP_MAC_CTX *, unsigned char *, size_t *, size_t);
} ossl;

/* Whether OpenSSL's Poly1305 is there, looked up the first time (with the GIL held: once). */
static int poly1305_ready(void) {
    static int looked;
    if (looked) return ossl.mac != NULL;
    looked = 1;
#if defined(__linux__)
    void *lib = dlopen("libcrypto.so.3", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return 0;
    EVP_MAC *(*fetch)(void *, const char *, const char *) = (EVP_MAC * (*)(void *, const char *, const char *))
        dlsym(lib, "EVP_MAC_fetch");
    *(void **)&ossl.ctx_new = dlsym(lib, "EVP_MAC_CTX_new");
    *(void **)&ossl.ctx_free = dlsym(lib, "EVP_MAC_CTX_free");
    *(void **)&ossl.init = dlsym(lib, "EVP_MAC_init");
    *(void **)&ossl.update = dlsym(lib, "EVP_MAC_update");
    *(void **)&ossl.final = dlsym(lib, "EVP_MAC_final");
    if (fetch && ossl.ctx_new && ossl.ctx_free && ossl.init && ossl.update && ossl.final)
        ossl.mac = fetch(NULL, "POLY1305", NULL);
#endif
    return ossl.mac != NULL;
}

/* has_poly1305() -> whether poly1305 can run (OpenSSL 3's libcrypto found). */
static PyObject *has_poly1305(PyObject *self, PyObject *unused) { return PyBool_FromLong(poly1305_ready()); }

/* poly1305(key, parts) -> the 16-byte Poly1305 tag (RFC 8439) under the one-time 32-byte key of the
 * parts' bytes in turn (buffers; none copied). */
static PyObject *poly1305(PyObject *self, PyObject *args) {
    Py_buffer key;
    PyObject *parts;
    if (!PyArg_ParseTuple(args, "y*O", &key, &parts)) return NULL;
    if (!poly1305_ready()) {
        PyErr_SetString(PyExc_RuntimeError, "poly1305: OpenSSL 3's libcrypto was not found");
        return release(&key, NULL, NULL, NULL, NULL);
    }
    PyObject *seq = PySequence_Fast(parts, "poly1305: parts must be a sequence of buffers");
    if (!seq || key.len != 32) {
        if (seq) PyErr_SetString(PyExc_ValueError, "poly1305: the key must be 32 bytes");
        Py_XDECREF(seq);
        return release(&key, NULL, NULL, NULL, NULL);
    }
    idx count = PySequence_Fast_GET_SIZE(seq), got = 0;
    Py_buffer *views = PyMem_Calloc(count ? (size_t)count : 1, sizeof(Py_buffer));
    if (!views) PyErr_NoMemory();
    for (; views && got < count; got++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &views[got], PyBUF_SIMPLE) < 0) break;
    PyObject *result = NULL;
    if (views && got == count) {
        unsigned char tag[16];
        size_t size = 0;
        int ok;
        Py_BEGIN_ALLOW_THREADS
        EVP_MAC_CTX *ctx = ossl.ctx_new(ossl.mac);
        ok = ctx && ossl.init(ctx, key.buf, 32, NULL);
        for (idx i = 0; ok && i < count; i++) ok = ossl.update(ctx, views[i].buf, (size_t)views[i].len);
        ok = ok && ossl.final(ctx, tag, &size, sizeof tag) && size == sizeof tag;
        if (ctx) ossl.ctx_free(ctx);
        Py_END_ALLOW_THREADS
        if (ok)
            result = PyBytes_FromStringAndSize((const char *)tag, 16);
        else
            PyErr_SetString(PyExc_RuntimeError, "poly1305: OpenSSL failed");
    }
    for (idx i = 0; views && i < got; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    Py_DECREF(seq);
    return release(&key, NULL, NULL, NULL, result);
}

/* use_avx512(on) -> whether the AVX-512 loops run from now on: with on, where this CPU has them (the tests run
 * the encoders both ways; EDGEPS_NO_AVX512 in the environment turns them off at import). */
static PyObject *use_avx512(PyObject *self, PyObject *on) {
    int want = PyObject_IsTrue(on);
    if (want < 0) return NULL;
#if X86_DISPATCH
    avx512 = want && avx512_cpu;
    return PyBool_FromLong(avx512);
#else
    return PyBool_FromLong(0);
#endif
}

static PyMethodDef methods[] = {
    {"use_avx512", use_avx512, METH_O, "Run the AVX-512 loops where the CPU has them (True) or not; whether they run."},
    {"int8_encode", int8_encode, METH_VARARGS, "Per-bucket int8 quantisation; None if a value is not finite."},
    {"int8_decode", int8_decode, METH_VARARGS, "Per-bucket int8 dequantisation."},
    {"fp16_decode", fp16_decode, METH_VARARGS, "IEEE binary16 to float32, exactly."},
    {"fp16_encode", fp16_encode, METH_VARARGS, "float32 to IEEE binary16 (nearest even), clipped to +-65504."},
    {"sign_encode", sign_encode, METH_VARARGS, "Per-bucket mean |x| and packed sign bits."},
    {"sign_decode", sign_decode, METH_VARARGS, "Packed sign bits times per-bucket scales."},
    {"ternary_decode", ternary_decode, METH_VARARGS, "Two bit planes times per-bucket scales; False if invalid."},
    {"qsgd_decode", qsgd_decode, METH_VARARGS, "Packed signed levels times per-bucket steps; False if invalid."},
    {"ternary_encode", ternary_encode, METH_VARARGS, "TernGrad's scales and bit planes; None if a value is not finite."},
    {"qsgd_encode", qsgd_encode, METH_VARARGS, "QSGD's norms and packed levels; None if a norm is not finite."},
    {"crc32", crc32, METH_VARARGS, "zlib.crc32(data, value=0), by carry-less multiplication where the CPU has it."},
    {"has_poly1305", has_poly1305, METH_NOARGS, "Whether poly1305 runs here (OpenSSL 3's libcrypto found)."},
    {"poly1305", poly1305, METH_VARARGS, "Poly1305 (RFC 8439) of buffers in turn, by OpenSSL, the GIL released."},
    {"squares", squares, METH_VARARGS, "The sum of float32 values' squares in double (32 partial sums)."},
    {"scaled", scaled, METH_VARARGS, "out = ((x * a) * b) * c + 0 in float32 steps."},
    {"add_finite", add_finite, METH_VARARGS, "out = x + y in float32; whether every sum is finite."},
    {"topk_encode", topk_encode, METH_VARARGS, "The k largest |x| (ties to the lowest index); None if not finite."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "Compiled codec loops.", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
#if X86_DISPATCH
    __builtin_cpu_init();
    avx512_cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    avx512 = avx512_cpu && !getenv("EDGEPS_NO_AVX512");
    pclmul_cpu = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
#endif
    crc_table_init();
    PyObject *m = PyModule_Create(&module);
#if X86_DISPATCH
    if (m && PyModule_AddIntConstant(m, "fast_crc32", pclmul_cpu) < 0) Py_CLEAR(m);
#else
    if (m && PyModule_AddIntConstant(m, "fast_crc32", 0) < 0) Py_CLEAR(m);
#endif
    return m;
}
