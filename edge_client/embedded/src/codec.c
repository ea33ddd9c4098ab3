/* The codecs of docs/PROTOCOL.md §5. Decoders compute exactly what schemas/codecs/ computes
 * (float32, in the same order), so a replica built from compressed pulls is bit-identical to the
 * server's broadcast view. Encoders of the deterministic codecs (fp32, fp16, int8, topk) give the
 * reference's bytes; sign's bucket means are summed as schemas/_kernels.c sums them; ternary and
 * qsgd draw their randomness from the caller's generator. Build with -ffp-contract=off. */
#include <math.h>
#include <string.h>

#include "edgeps.h"
#include "json.h"
#include "size.h"
#include "wire.h"

/* ceil(n / 512), ceil(n / 8): with no n + 511 or n + 7 that could wrap */
#define BUCKETS(n) ((n) / EPS_BUCKET + ((n) % EPS_BUCKET != 0))
#define BITBYTES(n) ((size_t)(n) / 8 + ((n) % 8 != 0))

static const struct {
    const char *name;
    eps_codec_id id;
} NAMES[] = {{"fp32", EPS_FP32}, {"fp16", EPS_FP16}, {"int8", EPS_INT8}, {"sign", EPS_SIGN},
             {"ternary", EPS_TERNARY}, {"qsgd", EPS_QSGD}, {"topk", EPS_TOPK}};

eps_status eps_codec_check(eps_codec c) {
    float a = c.arg;
    switch (c.id) {
    case EPS_QSGD: return isfinite(a) && a >= 1.0f && a <= 127.0f && a == floorf(a) ? EPS_OK : EPS_ERR_ARG;
    case EPS_TOPK: return isfinite(a) && a > 0.0f && a <= 1.0f ? EPS_OK : EPS_ERR_ARG;
    case EPS_FP32: case EPS_FP16: case EPS_INT8: case EPS_SIGN: case EPS_TERNARY: return a == 0.0f ? EPS_OK : EPS_ERR_ARG;
    }
    return EPS_ERR_CODEC;
}

eps_status eps_codec_parse(const char *spec, eps_codec *codec) {
    const char *colon = strchr(spec, ':');
    size_t name_len = colon ? (size_t)(colon - spec) : strlen(spec);
    for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0]; i++) {
        if (strlen(NAMES[i].name) != name_len || strncmp(NAMES[i].name, spec, name_len) != 0) continue;
        codec->id = NAMES[i].id;
        codec->arg = codec->id == EPS_QSGD ? 16.0f : codec->id == EPS_TOPK ? 0.01f : 0.0f;
        if (colon != NULL) { /* qsgd's levels 1..127 or topk's fraction in (0, 1], in JSON's number grammar */
            double arg;
            if ((codec->id != EPS_QSGD && codec->id != EPS_TOPK) || !eps_parse_number(colon + 1, strlen(colon + 1), &arg))
                return EPS_ERR_ARG;
            codec->arg = arg >= 0 && arg <= 127 ? (float)arg : -1.0f; /* never a cast out of range */
        }
        return eps_codec_check(*codec);
    }
    return EPS_ERR_CODEC;
}

int eps_codec_biased(eps_codec c) {
    return c.id == EPS_FP16 || c.id == EPS_INT8 || c.id == EPS_SIGN || c.id == EPS_TOPK;
}

uint32_t eps_topk_keep(float fraction, uint32_t n) {
    /* ceil(P n) exactly, in integers: P = m 2^-s (m its 24-bit significand), so P n = m n 2^-s with m n
     * below 2^56; the double product the protocol names is exact for every n below 2^29. */
    uint32_t b;
    memcpy(&b, &fraction, 4);
    if (n == 0) return 0;
    if (!(fraction > 0.0f)) return 1u; /* (refused by eps_codec_check) */
    if (fraction >= 1.0f) return n;
    uint64_t m = (b & 0x7fffffu) | ((b >> 23 & 0xffu) ? 0x800000u : 0u), mn = m * n;
    int s = 150 - (int)((b >> 23 & 0xffu) ? (b >> 23 & 0xffu) : 1u); /* P in (0, 1]: s >= 23 */
    uint64_t k = s >= 63 ? mn != 0 : (mn + ((uint64_t)1 << s) - 1) >> s;
    return k < 1 ? 1u : k > n ? n : (uint32_t)k;
}

static unsigned qsgd_bits(float levels) { return levels <= 1.0f ? 2u : levels <= 7.0f ? 4u : 8u; }

static size_t packed(uint32_t n, unsigned bits) { return eps_size_mad(n, bits, 7) / 8; }

size_t eps_codec_max_size(eps_codec c, uint32_t n) {
    size_t scales = eps_size_mul(4, BUCKETS(n)), bits = BITBYTES(n); /* saturating: n is a frame's */
    switch (c.id) {
    case EPS_FP32: return eps_size_mul(4, n);
    case EPS_FP16: return eps_size_mul(2, n);
    case EPS_INT8: return eps_size_add(scales, n);
    case EPS_SIGN: return eps_size_add(scales, bits);
    case EPS_TERNARY: return eps_size_mad(2, bits, scales);
    case EPS_QSGD: return eps_size_add(scales, packed(n, qsgd_bits(c.arg)));
    case EPS_TOPK: return eps_size_mad(5, eps_topk_keep(c.arg, n), 9);
    }
    return 0;
}

/* ---- helpers ---- */

static uint32_t bits_of(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

static float float_of(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* A uniform float32 in [0, 1) with 24 random bits (xorshift64*). */
static float uniform(uint64_t *state) {
    uint64_t s = *state ? *state : 0x9E3779B97F4A7C15u;
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    *state = s;
    return (float)((s * 0x2545F4914F6CDD1Du) >> 40) * 0x1p-24f;
}

/* The largest |x| of x[lo..hi) as its bits (a -0 maximum is 0); a value >= 0x7f800000 is not finite. */
static uint32_t largest(const float *x, uint32_t lo, uint32_t hi) {
    uint32_t top = 0;
    for (uint32_t i = lo; i < hi; i++) {
        uint32_t m = bits_of(x[i]) & 0x7fffffffu;
        top = m > top ? m : top;
    }
    return top;
}

/* float32 -> binary16, rounding to nearest even, as numpy's cast. */
static uint16_t half_of(float f) {
    uint32_t x = bits_of(f), ax = x & 0x7fffffffu;
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    if (ax < 0x38800000u) { /* a subnormal half, or zero */
        if (ax < 0x33000000u) return sign;
        uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u, shift = 126 - e;
        uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    uint32_t q = (ax - 0x38000000u) >> 13, rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

/* binary16 -> float32, exact. */
static float float_of_half(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7fffu;
    if (em >= 0x7c00u) return float_of(sign | 0x7f800000u | (em & 0x3ffu) << 13);
    if (em >= 0x400u) return float_of(sign | ((em << 13) + (112u << 23)));
    return float_of(sign | bits_of((float)em * 0x1p-24f));
}

/* ---- encoders ---- */

static eps_status encode_int8(const float *x, uint32_t n, uint8_t *out) {
    uint32_t nb = BUCKETS(n);
    for (uint32_t b = 0; b < nb; b++) {
        uint32_t lo = b * EPS_BUCKET, hi = lo + EPS_BUCKET < n ? lo + EPS_BUCKET : n, top = largest(x, lo, hi);
        if (top >= 0x7f800000u) return EPS_ERR_VALUE;
        float scale = float_of(top) / 127.0f, inv = scale > 1e-30f ? 1.0f / scale : 0.0f;
        eps_put_f32(out + 4 * b, scale);
        for (uint32_t i = lo; i < hi; i++) out[4 * nb + i] = (uint8_t)(int8_t)(int32_t)rintf(x[i] * inv);
    }
    return EPS_OK;
}

static void encode_sign(const float *x, uint32_t n, uint8_t *out) {
    uint32_t nb = BUCKETS(n);
    for (uint32_t b = 0; b < nb; b++) { /* 32 float partial sums, added in double (schemas/_kernels.c) */
        uint32_t lo = b * EPS_BUCKET, hi = lo + EPS_BUCKET < n ? lo + EPS_BUCKET : n, i = lo;
        float partial[32] = {0};
        for (; i + 32 <= hi; i += 32)
            for (int k = 0; k < 32; k++) partial[k] += fabsf(x[i + k]);
        double total = 0;
        for (int k = 0; k < 32; k++) total += partial[k];
        for (; i < hi; i++) total += fabsf(x[i]);
        eps_put_f32(out + 4 * b, (float)(total / (double)(hi - lo)));
    }
    uint8_t *p = out + 4 * nb;
    memset(p, 0, BITBYTES(n));
    for (uint32_t i = 0; i < n; i++) p[i / 8] |= (uint8_t)((x[i] < 0) << (i % 8));
}

static eps_status encode_ternary(const float *x, uint32_t n, uint8_t *out, uint64_t *rng) {
    uint32_t nb = BUCKETS(n);
    uint8_t *pos = out + 4 * nb, *neg = pos + BITBYTES(n);
    memset(pos, 0, 2 * BITBYTES(n));
    for (uint32_t b = 0; b < nb; b++) {
        uint32_t lo = b * EPS_BUCKET, hi = lo + EPS_BUCKET < n ? lo + EPS_BUCKET : n, top = largest(x, lo, hi);
        if (top >= 0x7f800000u) return EPS_ERR_VALUE;
        float scale = float_of(top), inv = scale > 1e-30f ? 1.0f / scale : 0.0f;
        eps_put_f32(out + 4 * b, scale);
        for (uint32_t i = lo; i < hi; i++) {
            if (!(uniform(rng) < fabsf(x[i]) * inv)) continue; /* kept with probability |x| / s */
            (x[i] < 0 ? neg : pos)[i / 8] |= (uint8_t)(1u << (i % 8));
        }
    }
    return EPS_OK;
}

static eps_status encode_qsgd(const float *x, uint32_t n, float levels, uint8_t *out, uint64_t *rng) {
    uint32_t nb = BUCKETS(n), s = (uint32_t)levels;
    unsigned bits = qsgd_bits(levels), per = 8 / bits;
    uint8_t *codes = out + 4 * nb, mask = (uint8_t)((1u << bits) - 1);
    memset(codes, 0, packed(n, bits));
    for (uint32_t b = 0; b < nb; b++) {
        uint32_t lo = b * EPS_BUCKET, hi = lo + EPS_BUCKET < n ? lo + EPS_BUCKET : n;
        double sum = 0;
        for (uint32_t i = lo; i < hi; i++) sum += (double)x[i] * (double)x[i];
        float norm = (float)sqrt(sum), inv = norm > 1e-30f ? levels / norm : 0.0f;
        if (!isfinite(norm)) return EPS_ERR_VALUE;
        eps_put_f32(out + 4 * b, norm);
        for (uint32_t i = lo; i < hi; i++) {
            float scaled = fabsf(x[i]) * inv + uniform(rng);
            uint32_t l = (uint32_t)floorf(scaled);
            int level = (int)(l < s ? l : s);
            uint8_t code = (uint8_t)(x[i] < 0 ? -level : level) & mask;
            codes[i / per] |= (uint8_t)(code << ((i % per) * bits));
        }
    }
    return EPS_OK;
}

/* The k values largest in magnitude, in index order: the k-th largest magnitude found by a binary
 * search over the bits of |x| (their order is the values' order), no scratch memory. */
/* The kept values of x: those above the threshold lo and the first `ties` equal to it, k in all. */
static uint32_t topk_threshold(const float *x, uint32_t n, uint32_t k, uint32_t top, uint32_t *ties) {
    uint32_t lo = 0, hi = top; /* the threshold t: the largest with count(|x| >= t) >= k */
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo + 1) / 2, count = 0;
        for (uint32_t i = 0; i < n; i++) count += (bits_of(x[i]) & 0x7fffffffu) >= mid;
        if (count >= k) lo = mid;
        else hi = mid - 1;
    }
    uint32_t above = 0; /* values strictly above the threshold are all kept; ties fill up to k */
    for (uint32_t i = 0; i < n; i++) above += (bits_of(x[i]) & 0x7fffffffu) > lo;
    *ties = k - above;
    return lo;
}

/* Bytes of v as an LEB128 varint. */
static size_t leb128_size(uint32_t v) { return v < 1u << 7 ? 1 : v < 1u << 14 ? 2 : v < 1u << 21 ? 3 : v < 1u << 28 ? 4 : 5; }

size_t eps_topk_compact_max_size(float fraction, uint32_t n) { return eps_size_mad(6, eps_topk_keep(fraction, n), 4); }

/* Top-k of the n values x. In records: u32 k, f32 scale, u8 width, k gaps of that width, k int8. Compact
 * (protocol 1.9): f32 scale, k LEB128 gaps, k int8. One pass finds the gaps' bytes, the next writes. */
static eps_status encode_topk(const float *x, uint32_t n, float fraction, int compact, uint8_t *out, size_t cap,
                              size_t *written) {
    uint32_t k = eps_topk_keep(fraction, n), top = largest(x, 0, n), ties;
    if (top >= 0x7f800000u) return EPS_ERR_VALUE;
    uint32_t lo = topk_threshold(x, n, k, top, &ties), width = 0;
    size_t gaps = 0, head = compact ? 4 : 9;
    for (int pass = 0; pass < 2; pass++) {
        uint32_t left = ties, previous = 0, taken = 0, widest = 0;
        float scale = k ? float_of(top) / 127.0f : 0.0f;
        uint8_t *g = out + head, *q = out + head + gaps;
        for (uint32_t i = 0; i < n && taken < k; i++) {
            uint32_t m = bits_of(x[i]) & 0x7fffffffu, gap = i - previous;
            if (m < lo || (m == lo && left == 0)) continue;
            if (m == lo) left--;
            previous = i;
            taken++;
            if (pass == 0) {
                widest = gap > widest ? gap : widest;
                gaps += leb128_size(gap);
                continue;
            }
            if (compact) {
                for (; gap >= 0x80; gap >>= 7) *g++ = (uint8_t)(gap | 0x80);
                *g++ = (uint8_t)gap;
            } else if (width == 1) *g++ = (uint8_t)gap;
            else if (width == 2) eps_put_u16(g, (uint16_t)gap), g += 2;
            else eps_put_u32(g, gap), g += 4;
            *q++ = (uint8_t)(int8_t)(int32_t)(scale > 0 ? rintf(x[i] / scale) : 0.0f);
        }
        if (pass == 0) {
            width = widest < 256 ? 1 : widest < 65536 ? 2 : 4;
            gaps = compact ? gaps : (size_t)k * width;
            if (head + gaps + k > cap) return EPS_ERR_SPACE;
            eps_put_f32(out + head - 4 - (compact ? 0 : 1), scale);
            if (!compact) {
                eps_put_u32(out, k);
                out[8] = (uint8_t)width;
            }
        }
    }
    *written = head + gaps + k;
    return EPS_OK;
}

eps_status eps_topk_encode_compact(float fraction, const float *x, uint32_t n, uint8_t *out, size_t cap,
                                   size_t *written) {
    return encode_topk(x, n, fraction, 1, out, cap, written);
}

eps_status eps_topk_compact_add(float fraction, const uint8_t *p, size_t len, uint32_t n, float scale, float *y) {
    uint32_t k = eps_topk_keep(fraction, n);
    if (len < 4 + 2 * (size_t)k) return EPS_ERR_PAYLOAD;
    size_t end = len - k, at = 4;
    float s = eps_get_f32(p) * scale;
    uint64_t index = 0;
    for (uint32_t j = 0; j < k; j++) { /* bounded reads and writes; the payload is this SDK's own */
        uint64_t gap = 0;
        for (unsigned shift = 0; at < end; shift += 7) {
            gap |= (uint64_t)(p[at] & 0x7f) << (shift & 63);
            if (p[at++] < 0x80) break;
        }
        index += gap;
        if (index >= n) return EPS_ERR_PAYLOAD;
        y[index] += (float)(int8_t)p[end + j] * s;
    }
    return at == end ? EPS_OK : EPS_ERR_PAYLOAD;
}

eps_status eps_codec_encode(eps_codec c, const float *x, uint32_t n, uint8_t *out, size_t cap, size_t *written,
                            uint64_t *rng) {
    uint64_t local = 0x853C49E6748FEA9Bu;
    eps_status st = eps_codec_check(c);
    if (st != EPS_OK) return st;
    if (rng == NULL) rng = &local;
    if (c.id == EPS_TOPK) return encode_topk(x, n, c.arg, 0, out, cap, written);
    size_t size = eps_codec_max_size(c, n);
    if (size > cap) return EPS_ERR_SPACE;
    switch (c.id) {
    case EPS_FP32:
        for (uint32_t i = 0; i < n; i++) eps_put_f32(out + 4 * (size_t)i, x[i]);
        break;
    case EPS_FP16:
        for (uint32_t i = 0; i < n; i++) {
            float v = x[i] > 65504.0f ? 65504.0f : x[i] < -65504.0f ? -65504.0f : x[i]; /* clamp, never inf */
            eps_put_u16(out + 2 * (size_t)i, half_of(v));
        }
        break;
    case EPS_INT8: st = encode_int8(x, n, out); break;
    case EPS_SIGN: encode_sign(x, n, out); break;
    case EPS_TERNARY: st = encode_ternary(x, n, out, rng); break;
    case EPS_QSGD: st = encode_qsgd(x, n, c.arg, out, rng); break;
    case EPS_TOPK: break;
    }
    if (st == EPS_OK) *written = size;
    return st;
}

/* ---- decoders ---- */

static eps_status decode_topk(float fraction, const uint8_t *p, size_t len, uint32_t n, float *y) {
    if (len < 9) return EPS_ERR_PAYLOAD;
    uint32_t k = eps_get_u32(p), width = p[8];
    float scale = eps_get_f32(p + 4);
    if ((width != 1 && width != 2 && width != 4) || k != eps_topk_keep(fraction, n)) return EPS_ERR_PAYLOAD;
    if (len != 9 + (size_t)k * width + k) return EPS_ERR_PAYLOAD;
    for (uint32_t i = 0; i < n; i++) y[i] = 0.0f;
    uint64_t index = 0;
    for (uint32_t j = 0; j < k; j++) {
        const uint8_t *g = p + 9 + (size_t)j * width;
        uint32_t gap = width == 1 ? g[0] : width == 2 ? eps_get_u16(g) : eps_get_u32(g);
        if (j > 0 && gap == 0) return EPS_ERR_PAYLOAD;
        index += gap;
        if (index >= n) return EPS_ERR_PAYLOAD;
        y[index] = (float)(int8_t)p[9 + (size_t)k * width + j] * scale;
    }
    return EPS_OK;
}

eps_status eps_codec_decode(eps_codec c, const uint8_t *p, size_t len, uint32_t n, float *y) {
    eps_status st = eps_codec_check(c);
    if (st != EPS_OK) return st;
    if (c.id == EPS_TOPK) return decode_topk(c.arg, p, len, n, y);
    if (len != eps_codec_max_size(c, n)) return EPS_ERR_PAYLOAD;
    uint32_t nb = BUCKETS(n);
    const uint8_t *body = p + 4 * nb;
    switch (c.id) {
    case EPS_FP32:
        for (uint32_t i = 0; i < n; i++) y[i] = eps_get_f32(p + 4 * (size_t)i);
        break;
    case EPS_FP16:
        for (uint32_t i = 0; i < n; i++) y[i] = float_of_half(eps_get_u16(p + 2 * (size_t)i));
        break;
    case EPS_INT8:
        for (uint32_t i = 0; i < n; i++) y[i] = (float)(int8_t)body[i] * eps_get_f32(p + 4 * (i / EPS_BUCKET));
        break;
    case EPS_SIGN:
        for (uint32_t i = 0; i < n; i++) /* +-s: the sign bit flipped, as the reference does */
            y[i] = float_of(eps_get_u32(p + 4 * (i / EPS_BUCKET)) ^ ((uint32_t)(body[i / 8] >> (i % 8) & 1u) << 31));
        break;
    case EPS_TERNARY: {
        const uint8_t *neg = body + BITBYTES(n);
        for (uint32_t i = 0; i < n; i++) {
            int plus = body[i / 8] >> (i % 8) & 1, minus = neg[i / 8] >> (i % 8) & 1;
            if (plus && minus) return EPS_ERR_PAYLOAD;
            y[i] = (float)(plus - minus) * eps_get_f32(p + 4 * (i / EPS_BUCKET));
        }
        break;
    }
    case EPS_QSGD: {
        unsigned bits = qsgd_bits(c.arg), per = 8 / bits;
        int levels = (int)c.arg;
        for (uint32_t i = 0; i < n; i++) {
            uint32_t code = (uint32_t)(body[i / per] >> ((i % per) * bits)) & ((1u << bits) - 1);
            int level = (int)code - (code >> (bits - 1) ? 1 << bits : 0); /* two's complement */
            if (level < -levels || level > levels) return EPS_ERR_PAYLOAD;
            y[i] = (float)level * (eps_get_f32(p + 4 * (i / EPS_BUCKET)) / c.arg);
        }
        break;
    }
    case EPS_TOPK: break;
    }
    return EPS_OK;
}
