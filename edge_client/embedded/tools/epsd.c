/* epsd: one device core driven over stdin/stdout, for tests (a host tool: it allocates; the SDK
 * does not). Usage: epsd JOB DEVICE DATA SEED [ARENA_BYTES]
 *
 * DATA is a frame holding tensors x (n, features) and y (n,) (labels as floats). Records, both
 * ways: u8 kind, u16 topic length, topic, u32 payload length, payload (little-endian).
 *   in:  'C' connected; 'M' a message; 'T' train: payload u32 n, up to n steps while ready, ending
 *        after a commit; 'L' leave; 'Q' state; 'K' tick: payload u32 ms the clock moves on first;
 *        'F' fail: payload u32 n, the port refuses the next n publishes
 *   out: 'P' publish (topic "R:" + topic when retained), 'S' subscribe, 'U' unsubscribe, 'G' the
 *        log hook (topic: the status's name; payload: the reason), 'R' what eps_device_message
 *        returned (topic: the status's name), 'Q' the state as JSON, 'E' the end of the answer to
 *        one input record
 * The clock advances 0.5 ms a reading; entropy is splitmix64 from SEED. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "edgeps.h"

typedef struct {
    float *x;
    float *y;
    uint32_t n, features;
    uint64_t seed;
    double now;
    uint32_t fail; /* publishes still to refuse */
} harness;

static void out(char kind, const char *topic, const uint8_t *payload, size_t len) {
    size_t t = strlen(topic);
    uint8_t head[3] = {(uint8_t)kind, (uint8_t)t, (uint8_t)(t >> 8)};
    uint8_t size[4] = {(uint8_t)len, (uint8_t)(len >> 8), (uint8_t)(len >> 16), (uint8_t)(len >> 24)};
    fwrite(head, 1, 3, stdout);
    fwrite(topic, 1, t, stdout);
    fwrite(size, 1, 4, stdout);
    if (len) fwrite(payload, 1, len, stdout);
}

static int publish(void *ctx, const char *topic, const uint8_t *payload, size_t len, int retain) {
    char named[EPS_TOPIC_MAX + 2];
    harness *h = ctx;
    if (h->fail > 0) {
        h->fail--;
        return -1;
    }
    snprintf(named, sizeof named, "%s%s", retain ? "R:" : "", topic);
    out('P', named, payload, len);
    return 0;
}

static int subscribe(void *ctx, const char *topic) {
    (void)ctx;
    out('S', topic, NULL, 0);
    return 0;
}

static int unsubscribe(void *ctx, const char *topic) {
    (void)ctx;
    out('U', topic, NULL, 0);
    return 0;
}

static void say(void *ctx, eps_status status, const char *reason) {
    (void)ctx;
    out('G', eps_status_name(status), (const uint8_t *)reason, strlen(reason));
}

static double clock_s(void *ctx) {
    harness *h = ctx;
    return h->now += 0.0005;
}

static uint64_t entropy(void *ctx) {
    harness *h = ctx;
    uint64_t z = (h->seed += 0x9E3779B97F4A7C15u);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9u;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBu;
    return z ^ (z >> 31);
}

static int sample(void *ctx, uint32_t index, float *x, float *y) {
    harness *h = ctx;
    if (index >= h->n) return 0;
    memcpy(x, h->x + (size_t)index * h->features, h->features * sizeof(float));
    *y = h->y[index];
    return 1;
}

static unsigned char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) return NULL;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = size > 0 ? malloc((size_t)size) : NULL;
    *len = buf && fread(buf, 1, (size_t)size, f) == (size_t)size ? (size_t)size : 0;
    fclose(f);
    return buf;
}

/* The data frame: x (n, features) then y (n,). */
static int load(harness *h, const char *path) {
    size_t len = 0, cursor = 0;
    unsigned char *data = slurp(path, &len);
    eps_frame f;
    eps_tensor x, y;
    int ok = data && eps_frame_parse(data, len, 0, &f) == EPS_OK && eps_frame_next(&f, &cursor, &x) &&
             eps_frame_next(&f, &cursor, &y) && x.ndim == 2 && y.ndim == 1 && x.dims[0] == y.dims[0] && y.dims[0];
    if (ok) {
        h->n = y.dims[0];
        h->features = x.dims[1];
        h->x = malloc((size_t)x.elements * sizeof(float));
        h->y = malloc(h->n * sizeof(float));
        ok = h->x && h->y && eps_codec_decode(f.codec, x.payload, x.length, (uint32_t)x.elements, h->x) == EPS_OK &&
             eps_codec_decode(f.codec, y.payload, y.length, h->n, h->y) == EPS_OK;
    }
    free(data);
    return ok;
}

static int read_record(char *kind, char *topic, size_t topic_cap, uint8_t **payload, uint32_t *len) {
    uint8_t head[3], size[4];
    if (fread(head, 1, 3, stdin) != 3) return 0;
    size_t t = (size_t)head[1] | (size_t)head[2] << 8;
    if (t >= topic_cap || fread(topic, 1, t, stdin) != t || fread(size, 1, 4, stdin) != 4) return 0;
    topic[t] = '\0';
    *kind = (char)head[0];
    *len = (uint32_t)size[0] | (uint32_t)size[1] << 8 | (uint32_t)size[2] << 16 | (uint32_t)size[3] << 24;
    *payload = realloc(*payload, *len + 1);
    return *payload != NULL && fread(*payload, 1, *len, stdin) == *len;
}

int main(int argc, char **argv) {
    static eps_device d;
    harness h = {0};
    if (argc < 5 || !load(&h, argv[3])) {
        fprintf(stderr, "usage: epsd JOB DEVICE DATA SEED [ARENA_BYTES] (DATA: a frame of x and y)\n");
        return 2;
    }
    h.seed = strtoull(argv[4], NULL, 10);
    size_t arena_size = argc > 5 ? (size_t)strtoull(argv[5], NULL, 10) : (size_t)1 << 20;
    void *arena = malloc(arena_size);
    eps_port port = {&h, publish, subscribe, unsubscribe, clock_s, entropy, sample, say, NULL};
    if (arena == NULL || eps_device_init(&d, &port, argv[1], argv[2], h.n, arena, arena_size, 256) != EPS_OK) {
        fprintf(stderr, "epsd: bad job or device id\n");
        return 2;
    }
    char kind, topic[EPS_TOPIC_MAX + 1];
    uint8_t *payload = NULL;
    uint32_t len;
    while (read_record(&kind, topic, sizeof topic, &payload, &len)) {
        if (kind == 'C') eps_device_connected(&d);
        else if (kind == 'M') out('R', eps_status_name(eps_device_message(&d, topic, payload, len)), NULL, 0);
        else if (kind == 'L') eps_device_leave(&d);
        else if ((kind == 'K' || kind == 'F') && len == 4) {
            uint32_t n = (uint32_t)payload[0] | (uint32_t)payload[1] << 8 | (uint32_t)payload[2] << 16 |
                         (uint32_t)payload[3] << 24;
            if (kind == 'F') h.fail = n;
            else eps_device_tick(&d, h.now += n / 1000.0);
        }
        else if (kind == 'T' && len == 4) {
            uint32_t n = (uint32_t)payload[0] | (uint32_t)payload[1] << 8 | (uint32_t)payload[2] << 16 |
                         (uint32_t)payload[3] << 24;
            for (uint32_t i = 0; i < n && eps_device_ready(&d); i++) {
                uint64_t seq = d.seq;
                eps_device_step(&d);
                if (d.seq != seq) break; /* a commit went out */
            }
        } else if (kind == 'Q') {
            char state[768];
            int k = snprintf(state, sizeof state,
                             "{\"seq\":%" PRIu64 ",\"server_version\":%" PRId64 ",\"waiting\":%d,\"ready\":%d,"
                             "\"finished\":%d,\"incarnation\":%" PRIu64 ",\"steps\":%" PRIu32 ",\"loss\":%.6f,"
                             "\"error\":\"%s\",\"run\":%" PRIu64 ",\"unable\":\"%s\",\"resends\":%" PRIu32
                             ",\"unpublished\":%d,\"has_sent\":%d}",
                             d.seq, d.server_version, d.waiting, eps_device_ready(&d), d.finished, d.incarnation,
                             d.steps, (double)d.last_loss, eps_status_name(d.error), d.run, eps_status_name(d.unable),
                             d.resends, d.unpublished, d.has_sent);
            out('Q', "", (const uint8_t *)state, (size_t)k);
        }
        out('E', "", NULL, 0);
        fflush(stdout);
    }
    free(payload);
    free(arena);
    free(h.x);
    free(h.y);
    return 0;
}
