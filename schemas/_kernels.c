/* Compiled inner loops for the hot codecs in schemas/codecs/.
 *
 * Optional: when this module does not build (a gateway without a C compiler), codecs.py runs
 * its numpy versions, which give the same bytes and the same floats. To keep them identical the
 * float arithmetic here is the numpy versions' step for step, in float32, and the module is
 * compiled with -ffp-contract=off so that no multiply-add is fused.
 *
 * The loops are plain C that compilers vectorise. On x86-64 with glibc each loop is also built
 * for AVX2 and picked at load time (target_clones): the SSE2 baseline lacks the conversions and
 * unsigned compares these loops need, and runs them 2 to 3 times slower.
 *
 * The Python-facing functions take buffers (bytes, bytearray, memoryview, numpy arrays) and
 * check their sizes; the caller has already checked a payload's length against its shape.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GLIBC__) && (defined(__GNUC__) || defined(__clang__))
#define X86_DISPATCH 1
#define HOT __attribute__((target_clones("avx2", "default")))
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
__attribute__((target("avx2"))) static void sign_bits_avx2(const float *restrict x, uint8_t *restrict p, idx n) {
    const __m256 zero = _mm256_setzero_ps();
    for (idx j = 0; j < n / 8; j++)
        p[j] = (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + 8 * j), zero, _CMP_LT_OQ));
}
#endif

/* Returns 0 if a value is not finite (nothing useful is written then). */
HOT static int int8_encode_loop(const float *restrict x, float *restrict scales, int8_t *restrict q, idx n,
                                idx bucket) {
    const int32_t *bits = (const int32_t *)x;
    for (idx lo = 0; lo < n; lo += bucket) {
        idx hi = lo + bucket < n ? lo + bucket : n;
        int32_t top = 0; /* max |x| as bits: for non-negative floats, bit order is value order */
        for (idx i = lo; i < hi; i++) {
            int32_t m = bits[i] & 0x7fffffff;
            top = m > top ? m : top;
        }
        if (top >= 0x7f800000) return 0;
        float largest;
        memcpy(&largest, &top, 4);
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

/* int8_encode(values f32[n], scales_out f32[nb], codes_out i8[n], bucket) -> bool finite */
static PyObject *int8_encode(PyObject *self, PyObject *args) {
    Py_buffer x, s, q;
    idx bucket;
    int ok = 0;
    if (!PyArg_ParseTuple(args, "y*w*w*n", &x, &s, &q, &bucket)) return NULL;
    idx n = x.len / 4;
    if (bucket_ok(bucket) && need(&s, 4 * BUCKETS(n, bucket), "int8 scales") && need(&q, n, "int8 codes")) {
        Py_BEGIN_ALLOW_THREADS
        ok = int8_encode_loop(x.buf, s.buf, q.buf, n, bucket);
        Py_END_ALLOW_THREADS
    }
    return release(&x, &s, &q, NULL, PyBool_FromLong(ok));
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

/* fp16_encode(values f32[n], out u16[n]) */
static PyObject *fp16_encode(PyObject *self, PyObject *args) {
    Py_buffer x, h;
    if (!PyArg_ParseTuple(args, "y*w*", &x, &h)) return NULL;
    idx n = x.len / 4;
    if (need(&h, 2 * n, "fp16 out")) {
        Py_BEGIN_ALLOW_THREADS
        fp16_encode_loop(x.buf, h.buf, n);
        Py_END_ALLOW_THREADS
    }
    return release(&x, &h, NULL, NULL, Py_NewRef(Py_None));
}

/* sign_encode(values f32[n], scales_out f32[nb], bits_out u8[ceil(n/8)], bucket) */
static PyObject *sign_encode(PyObject *self, PyObject *args) {
    Py_buffer x, s, p;
    idx bucket;
    if (!PyArg_ParseTuple(args, "y*w*w*n", &x, &s, &p, &bucket)) return NULL;
    idx n = x.len / 4;
    if (bucket_ok(bucket) && need(&s, 4 * BUCKETS(n, bucket), "sign scales") && need(&p, (n + 7) / 8, "sign bits")) {
        Py_BEGIN_ALLOW_THREADS
        sign_encode_loop(x.buf, s.buf, p.buf, n, bucket);
        Py_END_ALLOW_THREADS
    }
    return release(&x, &s, &p, NULL, Py_NewRef(Py_None));
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

static PyMethodDef methods[] = {
    {"int8_encode", int8_encode, METH_VARARGS, "Per-bucket int8 quantisation; False if a value is not finite."},
    {"int8_decode", int8_decode, METH_VARARGS, "Per-bucket int8 dequantisation."},
    {"fp16_decode", fp16_decode, METH_VARARGS, "IEEE binary16 to float32, exactly."},
    {"fp16_encode", fp16_encode, METH_VARARGS, "float32 to IEEE binary16 (nearest even), clipped to +-65504."},
    {"sign_encode", sign_encode, METH_VARARGS, "Per-bucket mean |x| and packed sign bits."},
    {"sign_decode", sign_decode, METH_VARARGS, "Packed sign bits times per-bucket scales."},
    {"ternary_decode", ternary_decode, METH_VARARGS, "Two bit planes times per-bucket scales; False if invalid."},
    {"qsgd_decode", qsgd_decode, METH_VARARGS, "Packed signed levels times per-bucket steps; False if invalid."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "Compiled codec loops.", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
