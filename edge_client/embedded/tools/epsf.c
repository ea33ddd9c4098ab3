/* epsf: the frame and codec code of the SDK on files, for tests and fuzzing (a host tool: it
 * allocates; the SDK itself does not).
 *
 *   epsf recode SPEC IN OUT [SEED]
 *                             verify the frame IN, decode every tensor, write it to OUT encoded
 *                             under SPEC (same header; "fp32" writes the decoded values); SEED
 *                             starts the stochastic codecs' generator
 *   epsf compact SPEC IN OUT  the values of every tensor of the frame IN, one after another, as a
 *                             compact commit (SPEC: topk:P) with IN's header and tensor count
 *   epsf check IN...          verify and decode each frame; print one line per frame: "ok" or
 *                             the first problem; exit 1 if any was refused
 *   epsf arena SIZES BATCH [CODEC [PULL_CODEC]]
 *                             the arena a device needs for the MLP of layer sizes SIZES (such as
 *                             64,64,10), batches of BATCH samples and commits in CODEC (default
 *                             fp32), in bytes; then the receive buffer its port needs besides when
 *                             snapshots stream into the arena, pulls in PULL_CODEC (default fp32)
 *   epsf fuzz SEED COUNT FILE...
 *                             COUNT inputs made from the FILEs (frames and JSON messages) by bit
 *                             flips, truncations, random bytes and mended CRCs: each parsed and
 *                             decoded as a frame, then given to a device core on the topic of
 *                             its kind (after the unmutated FILEs set it up); built with
 *                             sanitizers, no input may crash it or read out of bounds
 *   epsf train PARAMS BATCH LR OUT [LOSS]
 *                             one SGD step of the MLP whose parameters the frame PARAMS holds, on
 *                             the batch frame BATCH (tensors x (n, features) and y (n,), labels as
 *                             floats), learning rate LR; OUT: the parameters after it (fp32), and a
 *                             tensor "loss" of shape (1,)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "edgeps.h"

static int usage(void);

static unsigned char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) return NULL;
    size_t cap = 1 << 16, n = 0;
    unsigned char *buf = malloc(cap);
    for (size_t got; buf != NULL && (got = fread(buf + n, 1, cap - n, f)) > 0;) {
        n += got;
        if (n == cap) {
            unsigned char *bigger = realloc(buf, cap *= 2);
            if (bigger == NULL) free(buf);
            buf = bigger;
        }
    }
    fclose(f);
    *len = n;
    return buf;
}

/* Verify and decode every tensor of data; with out, encode them under codec into *out. */
static eps_status run(const unsigned char *data, size_t len, const eps_codec *codec, uint64_t rng,
                      unsigned char **out, size_t *out_len) {
    eps_frame frame;
    eps_tensor t;
    eps_writer w;
    size_t cursor = 0, cap = 64;
    eps_status st = eps_frame_parse(data, len, 0, &frame);
    if (st != EPS_OK) return st;
    for (size_t c = 0; eps_frame_next(&frame, &c, &t);)
        cap += 2u * EPS_MAX_NAME + 4u * EPS_MAX_NDIM + 16 + (codec ? eps_codec_max_size(*codec, (uint32_t)t.elements) : 0);
    if (codec != NULL) {
        *out = malloc(cap);
        if (*out == NULL) return EPS_ERR_SPACE;
        eps_writer_begin(&w, *out, cap, frame.kind, *codec, frame.base_version, frame.seq, frame.samples, frame.steps,
                         frame.device);
    }
    while (eps_frame_next(&frame, &cursor, &t)) {
        float *values = malloc(t.elements ? (size_t)t.elements * sizeof(float) : 1);
        if (values == NULL) return EPS_ERR_SPACE;
        st = eps_codec_decode(frame.codec, t.payload, t.length, (uint32_t)t.elements, values);
        if (st == EPS_OK && codec != NULL) eps_writer_tensor(&w, t.name, t.ndim, t.dims, values, &rng);
        free(values);
        if (st != EPS_OK) return st;
    }
    return codec != NULL ? eps_writer_end(&w, out_len) : EPS_OK;
}

/* The values of every tensor of a frame, one after another, into a new array. */
static float *values_of(const eps_frame *frame, size_t *count) {
    eps_tensor t;
    size_t cursor = 0, total = 0;
    while (eps_frame_next(frame, &cursor, &t)) total += (size_t)t.elements;
    float *all = malloc(total ? total * sizeof(float) : 1), *at = all;
    for (cursor = 0; all != NULL && eps_frame_next(frame, &cursor, &t); at += t.elements)
        if (eps_codec_decode(frame->codec, t.payload, t.length, (uint32_t)t.elements, at) != EPS_OK) {
            free(all);
            return NULL;
        }
    *count = total;
    return all;
}

static int train(const char *params_path, const char *batch_path, float lr, eps_loss loss_kind, const char *out_path) {
    size_t plen = 0, blen = 0, np = 0, nb = 0, out_len = 0;
    unsigned char *pdata = slurp(params_path, &plen), *bdata = slurp(batch_path, &blen), *out = NULL;
    eps_frame pf, bf;
    eps_mlp mlp;
    float *params = NULL, *batch = NULL, *scratch = NULL;
    float *labels = NULL;
    int ok = pdata && bdata && eps_frame_parse(pdata, plen, 0, &pf) == EPS_OK &&
             eps_frame_parse(bdata, blen, 0, &bf) == EPS_OK && eps_mlp_from_frame(&pf, &mlp) == EPS_OK;
    if (ok) {
        params = values_of(&pf, &np);
        batch = values_of(&bf, &nb);
        ok = params && batch && np == eps_mlp_params(&mlp) && nb % (mlp.sizes[0] + 1) == 0;
    }
    uint32_t n = ok ? (uint32_t)(nb / (mlp.sizes[0] + 1)) : 0;
    if (ok) {
        labels = malloc(n * sizeof(float) + 1);
        scratch = malloc(eps_mlp_scratch(&mlp, n) * sizeof(float) + 1);
        ok = labels && scratch;
        for (uint32_t i = 0; ok && i < n; i++) labels[i] = batch[(size_t)n * mlp.sizes[0] + i];
    }
    float loss = ok ? eps_mlp_step(&mlp, params, batch, labels, n, lr, loss_kind, scratch) : -1.0f;
    ok = ok && loss >= 0.0f;
    if (ok) {
        size_t cap = plen + 4 * np + 256;
        eps_writer w;
        eps_codec fp32 = {EPS_FP32, 0.0f};
        eps_tensor t;
        size_t cursor = 0;
        out = malloc(cap);
        eps_writer_begin(&w, out, cap, EPS_PARAMS, fp32, pf.base_version, pf.seq, 0, 0, "");
        while (out && eps_frame_next(&pf, &cursor, &t)) {
            uint32_t layer = (uint32_t)(t.name[5] - '0'); /* dense{i}: at most EPS_MAX_LAYERS (8) */
            size_t at = t.name[strlen(t.name) - 1] == 'w' ? eps_mlp_weight_at(&mlp, layer) : eps_mlp_bias_at(&mlp, layer);
            eps_writer_tensor(&w, t.name, t.ndim, t.dims, params + at, NULL);
        }
        uint32_t one = 1;
        eps_writer_tensor(&w, "loss", 1, &one, &loss, NULL);
        ok = out && eps_writer_end(&w, &out_len) == EPS_OK;
    }
    if (ok) {
        FILE *f = fopen(out_path, "wb");
        ok = f != NULL && fwrite(out, 1, out_len, f) == out_len && fclose(f) == 0;
    }
    free(pdata), free(bdata), free(out), free(params), free(batch), free(scratch), free(labels);
    if (!ok) fprintf(stderr, "epsf: train: bad parameters or batch\n");
    return ok ? 0 : 1;
}

/* ---- fuzz ---- */

static uint64_t fuzz_state;

static uint64_t fuzz_next(void) {
    fuzz_state ^= fuzz_state << 13, fuzz_state ^= fuzz_state >> 7, fuzz_state ^= fuzz_state << 17;
    return fuzz_state;
}

static int fz_publish(void *ctx, const char *topic, const uint8_t *payload, size_t len, int retain) {
    (void)ctx, (void)topic, (void)payload, (void)len, (void)retain;
    return 0;
}
static int fz_subscription(void *ctx, const char *topic) {
    (void)ctx, (void)topic;
    return 0;
}
static double fz_clock(void *ctx) {
    static double now;
    (void)ctx;
    return now += 0.001;
}
static uint64_t fz_entropy(void *ctx) {
    (void)ctx;
    return fuzz_next();
}
static int fz_sample(void *ctx, uint32_t index, float *x, float *y) {
    (void)ctx;
    for (uint32_t i = 0; i < 64; i++) x[i] = (float)((index + i) % 7) / 7.0f;
    *y = (float)(index % 10);
    return 1;
}

/* A frame read as its bytes arrive, in pieces of random sizes, each payload into dest (1 MiB):
 * it must agree with eps_frame_parse, which reads it whole (the stream leaves names' uniqueness
 * to its caller), and its payloads must be the frame's bytes. Exits on a disagreement. */
static void stream_agrees(const uint8_t *m, size_t len) {
    static uint8_t dest[1 << 20];
    eps_frame_stream s;
    eps_frame f;
    size_t placed = 0, got = 0;
    eps_status whole = eps_frame_parse(m, len, 0, &f);
    eps_frame_stream_begin(&s, len, 0);
    while (got < len) {
        size_t cap, n = 1 + (size_t)(fuzz_next() % 97);
        uint8_t *at = eps_frame_stream_room(&s, &cap);
        n = n < cap ? n : cap;
        n = n < len - got ? n : len - got;
        memcpy(at, m + got, n);
        got += n;
        if (eps_frame_stream_wrote(&s, n) == EPS_STREAM_TENSOR && s.tensor.length <= sizeof dest - placed) {
            s.dest = dest + placed;
            placed += s.tensor.length;
        }
    }
    int agree = whole == EPS_OK ? s.done : (!s.done || whole == EPS_ERR_NAME);
    if (agree && whole == EPS_OK) { /* the payloads placed are the frame's */
        eps_tensor t;
        size_t cursor = 0, at = 0;
        while (agree && eps_frame_next(&f, &cursor, &t)) {
            agree = t.length == 0 || memcmp(dest + at, t.payload, t.length) == 0;
            at += t.length;
        }
    }
    if (!agree) {
        fprintf(stderr, "epsf fuzz: a frame of %zu bytes read whole: %s, as it arrives: %s\n", len,
                eps_status_name(whole), s.done ? "ok" : eps_status_name(s.error));
        exit(1);
    }
}

/* A message to the device: whole, or (a parameter frame, half the time) piece by piece as a
 * streaming port hands it over, now and then cut before its end as a broken link would. */
static void deliver(eps_device *d, const char *topic, const uint8_t *m, size_t len) {
    if (fuzz_next() % 2 || !eps_device_stream_begin(d, topic, len)) {
        eps_device_message(d, topic, m, len);
        return;
    }
    size_t got = 0, stop = fuzz_next() % 8 == 0 ? (size_t)(fuzz_next() % (len + 1)) : len;
    while (got < stop) {
        size_t cap, n = 1 + (size_t)(fuzz_next() % 300);
        uint8_t *at = eps_device_stream_room(d, &cap);
        n = n < cap ? n : cap;
        n = n < stop - got ? n : stop - got;
        memcpy(at, m + got, n);
        eps_device_stream_wrote(d, n);
        got += n;
    }
    eps_device_stream_end(d, stop == len);
}

static int fuzz(uint64_t seed, unsigned long count, int files, char **paths) {
    static eps_device dev;
    static float arena[1 << 16];
    unsigned char *inputs[16];
    size_t sizes[16];
    const char *topics[] = {"edgeps/fz/ctrl/d", "edgeps/fz/barrier", "edgeps/fz/notice/d", "edgeps/fz/params",
                            "edgeps/fz/delta"};
    eps_port port = {NULL, fz_publish, fz_subscription, fz_subscription, fz_clock, fz_entropy, fz_sample, NULL, NULL};
    unsigned long accepted = 0;
    if (files < 1 || files > 16) return usage();
    fuzz_state = seed | 1;
    for (int i = 0; i < files; i++)
        if ((inputs[i] = slurp(paths[i], &sizes[i])) == NULL || sizes[i] == 0) return usage();
    eps_device_init(&dev, &port, "fz", "d", 100, arena, sizeof arena, 32);
    dev.incarnation = 4242; /* the incarnation the corpus's Control answers */
    for (int i = 0; i < files; i++) { /* the unmutated corpus sets the device up: control, model, ... */
        const char *topic = inputs[i][0] == '{' ? topics[0] : topics[3];
        deliver(&dev, topic, inputs[i], sizes[i]);
    }
    unsigned char *m = malloc(1 << 20);
    if (m == NULL) return 1;
    for (unsigned long n = 0; n < count; n++) {
        int which = (int)(fuzz_next() % (uint64_t)files);
        size_t len = sizes[which] < (1 << 20) ? sizes[which] : (1 << 20);
        memcpy(m, inputs[which], len);
        int frame = m[0] == 'E';
        switch (fuzz_next() % 4) {
        case 0: len = (size_t)(fuzz_next() % (len + 1)); break; /* truncated */
        case 1: /* random bytes past the first 8 */
            for (size_t i = 8; i < len; i++)
                if (fuzz_next() % 16 == 0) m[i] = (unsigned char)fuzz_next();
            break;
        default: /* a few bit flips */
            for (int k = 1 + (int)(fuzz_next() % 3); k > 0 && len; k--) m[fuzz_next() % len] ^= (unsigned char)(1u << (fuzz_next() % 8));
        }
        if (frame && len >= 4 && fuzz_next() % 2) { /* a mended CRC makes the parser look past it */
            uint32_t crc = eps_crc32(0, m, len - 4);
            for (int i = 0; i < 4; i++) m[len - 4 + (size_t)i] = (unsigned char)(crc >> (8 * i));
        }
        accepted += run(m, len, NULL, 1, NULL, NULL) == EPS_OK;
        if (frame) stream_agrees(m, len);
        const char *topic = frame ? topics[3 + fuzz_next() % 2] : topics[fuzz_next() % 3];
        deliver(&dev, topic, m, len);
        if (fuzz_next() % 8 == 0) eps_device_step(&dev);
    }
    printf("fuzzed %lu inputs: %lu were valid frames\n", count, accepted);
    for (int i = 0; i < files; i++) free(inputs[i]);
    free(m);
    return 0;
}

/* The values of the frame data as a compact commit under spec (top-k) into a new *out. */
static eps_status compact(const char *spec, const unsigned char *data, size_t len, unsigned char **out,
                          size_t *out_len) {
    eps_codec codec;
    eps_frame frame;
    eps_writer w;
    size_t count = 0, payload_len = 0;
    const uint8_t *payload = NULL;
    eps_status st = eps_codec_parse(spec, &codec);
    if (st == EPS_OK) st = eps_frame_parse(data, len, 0, &frame);
    float *values = st == EPS_OK ? values_of(&frame, &count) : NULL;
    if (values == NULL) return st != EPS_OK ? st : EPS_ERR_PAYLOAD;
    size_t cap = EPS_HEADER_BYTES + 1 + EPS_MAX_NAME + 2 + 4 + 4 + eps_topk_compact_max_size(codec.arg, (uint32_t)count);
    *out = malloc(cap);
    if (*out == NULL) st = EPS_ERR_SPACE;
    else {
        eps_writer_begin(&w, *out, cap, frame.kind, codec, frame.base_version, frame.seq, frame.samples, frame.steps,
                         frame.device);
        eps_writer_compact_topk(&w, frame.count, values, (uint32_t)count, &payload, &payload_len);
        st = eps_writer_end(&w, out_len);
    }
    free(values);
    return st;
}

/* A command's end: out (out_len bytes) written to path when st is OK, both buffers freed, a failure said
 * naming the input; the exit status. */
static int written(eps_status st, unsigned char *data, unsigned char *out, size_t out_len, const char *input,
                   const char *path) {
    if (st == EPS_OK) {
        FILE *f = fopen(path, "wb");
        st = f != NULL && fwrite(out, 1, out_len, f) == out_len && fclose(f) == 0 ? EPS_OK : EPS_ERR_SPACE;
    }
    free(data);
    free(out);
    if (st != EPS_OK) fprintf(stderr, "epsf: %s: %s\n", input, eps_status_name(st));
    return st == EPS_OK ? 0 : 1;
}

static int usage(void) {
    fprintf(stderr, "usage: epsf recode SPEC IN OUT [SEED] | epsf compact SPEC IN OUT | epsf check FILE... | "
                    "epsf arena SIZES BATCH [CODEC [PULL]] | "
                    "epsf fuzz SEED COUNT FILE... | "
                    "epsf train PARAMS BATCH LR OUT [LOSS]\n");
    return 2;
}

int main(int argc, char **argv) {
    size_t len = 0, out_len = 0;
    if (argc >= 4 && argc <= 6 && strcmp(argv[1], "arena") == 0) {
        eps_mlp mlp = {0};
        eps_codec codec = {EPS_FP32, 0.0f}, pull = {EPS_FP32, 0.0f};
        if ((argc > 4 && eps_codec_parse(argv[4], &codec) != EPS_OK) || (argc > 5 && eps_codec_parse(argv[5], &pull)))
            return usage();
        char *at = argv[2];
        while (mlp.layers <= EPS_MAX_LAYERS && *at) {
            mlp.sizes[mlp.layers++] = (uint32_t)strtoul(at, &at, 10);
            at += *at == ',';
        }
        if (mlp.layers < 2 || mlp.layers > EPS_MAX_LAYERS + 1) return usage();
        mlp.layers--;
        printf("%lu %lu\n", (unsigned long)eps_device_arena_size(&mlp, (uint32_t)strtoul(argv[3], NULL, 10), codec),
               (unsigned long)eps_device_receive_size(&mlp, pull));
        return 0;
    }
    if (argc >= 5 && strcmp(argv[1], "fuzz") == 0)
        return fuzz(strtoull(argv[2], NULL, 10), strtoul(argv[3], NULL, 10), argc - 4, argv + 4);
    eps_loss loss_kind = EPS_LOSS_CROSS_ENTROPY;
    if ((argc == 6 || argc == 7) && strcmp(argv[1], "train") == 0 &&
        (argc == 6 || eps_loss_from_name(argv[6], strlen(argv[6]), &loss_kind)))
        return train(argv[2], argv[3], strtof(argv[4], NULL), loss_kind, argv[5]);
    if ((argc == 5 || argc == 6) && strcmp(argv[1], "recode") == 0) {
        uint64_t seed = argc == 6 ? strtoull(argv[5], NULL, 10) : 1;
        eps_codec codec;
        unsigned char *data = slurp(argv[3], &len), *out = NULL;
        eps_status st = data ? eps_codec_parse(argv[2], &codec) : EPS_ERR_SHORT;
        if (st == EPS_OK) st = run(data, len, &codec, seed ? seed : 1, &out, &out_len);
        return written(st, data, out, out_len, argv[3], argv[4]);
    }
    if (argc == 5 && strcmp(argv[1], "compact") == 0) {
        unsigned char *data = slurp(argv[3], &len), *out = NULL;
        eps_status st = data ? compact(argv[2], data, len, &out, &out_len) : EPS_ERR_SHORT;
        return written(st, data, out, out_len, argv[3], argv[4]);
    }
    if (argc >= 3 && strcmp(argv[1], "check") == 0) {
        int refused = 0;
        for (int i = 2; i < argc; i++) {
            unsigned char *data = slurp(argv[i], &len);
            eps_status st = data ? run(data, len, NULL, 1, NULL, NULL) : EPS_ERR_SHORT;
            printf("%s\n", eps_status_name(st));
            refused |= st != EPS_OK;
            free(data);
        }
        return refused;
    }
    return usage();
}
