/* edgeps-device: the C device SDK on libmosquitto, for Linux-class gateways (OpenWrt, a Raspberry
 * Pi). The same options as `edgeps client` where they apply. One thread: libmosquitto's network
 * loop and the device core take turns, so the core needs no lock.
 *
 *   edgeps-device --job J --device D --data FILE [--broker HOST:PORT] [--username U]
 *                 [--password-file F] [--tls-ca CA] [--tls-cert C --tls-key K] [--seed N]
 *                 [--step-time S] [--arena BYTES] [--max-batch N] [--resend-s S]
 *
 * Every problem the core meets is one line on stderr (the log hook). It exits 0 when the job
 * finished (or on SIGTERM), 2 when local training diverged, 3 when it cannot take part in the job
 * (a model, loss or codec the C trainer lacks, a model larger than --arena: the reason is on
 * stderr and in its status, which the server logs and shows), 1 when it cannot connect.
 *
 * FILE is a data frame: an EPSF frame (docs/PROTOCOL.md §4, fp32) holding x (n, features) and
 * y (n,), the labels as floats; `edgeps data --format frame` writes one per device. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <mosquitto.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "edgeps.h"

typedef struct {
    struct mosquitto *mosq;
    float *x;
    float *y; /* class numbers or target values */
    uint32_t n, features;
    uint64_t seed;
    eps_device *device;
    int connected;
} gateway;

static volatile sig_atomic_t stopping = 0;

static void on_signal(int sig) {
    (void)sig;
    stopping = 1;
}

static double monotonic(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void pause_for(double seconds) {
    if (seconds <= 0) return;
    struct timespec t = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    while (nanosleep(&t, &t) == -1 && errno == EINTR && !stopping) {
    }
}

/* ---- the port ---- */

static int port_publish(void *ctx, const char *topic, const uint8_t *payload, size_t len, int retain) {
    gateway *g = ctx;
    return mosquitto_publish(g->mosq, NULL, topic, (int)len, payload, 1, retain != 0);
}

static void port_log(void *ctx, eps_status status, const char *reason) {
    gateway *g = ctx;
    fprintf(stderr, "edgeps-device: %s: %s%s%s\n", g->device->device, status == EPS_OK ? "" : eps_status_name(status),
            status == EPS_OK ? "" : ": ", reason);
}

static int port_subscribe(void *ctx, const char *topic) {
    gateway *g = ctx;
    return mosquitto_subscribe(g->mosq, NULL, topic, 1);
}

static int port_unsubscribe(void *ctx, const char *topic) {
    gateway *g = ctx;
    return mosquitto_unsubscribe(g->mosq, NULL, topic);
}

static double port_clock(void *ctx) {
    (void)ctx;
    return monotonic();
}

static uint64_t port_entropy(void *ctx) {
    gateway *g = ctx;
    uint64_t z = 0;
    FILE *f = fopen("/dev/urandom", "rb");
    if (f == NULL || fread(&z, sizeof z, 1, f) != 1) z = (uint64_t)(monotonic() * 1e9); /* no urandom */
    if (f != NULL) fclose(f);
    return z ^ (g->seed += 0x9E3779B97F4A7C15u);
}

static int port_sample(void *ctx, uint32_t index, float *x, float *y) {
    gateway *g = ctx;
    if (index >= g->n) return 0;
    memcpy(x, g->x + (size_t)index * g->features, g->features * sizeof(float));
    *y = g->y[index];
    return 1;
}

/* ---- libmosquitto's callbacks ---- */

static void on_connect(struct mosquitto *mosq, void *ctx, int rc) {
    gateway *g = ctx;
    (void)mosq;
    if (rc != 0) {
        fprintf(stderr, "edgeps-device: the broker refused the connection: %s\n", mosquitto_connack_string(rc));
        return;
    }
    g->connected = 1;
    eps_device_connected(g->device);
}

static void on_disconnect(struct mosquitto *mosq, void *ctx, int rc) {
    gateway *g = ctx;
    (void)mosq;
    g->connected = 0;
    if (rc != 0) fprintf(stderr, "edgeps-device: disconnected (%s); reconnecting\n", mosquitto_strerror(rc));
}

static void on_message(struct mosquitto *mosq, void *ctx, const struct mosquitto_message *m) {
    gateway *g = ctx;
    (void)mosq;
    eps_device_message(g->device, m->topic, m->payload, (size_t)(m->payloadlen > 0 ? m->payloadlen : 0));
}

/* ---- data ---- */

static int load_data(gateway *g, const char *path) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) return 0;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *bytes = size > 0 ? malloc((size_t)size) : NULL;
    int ok = bytes != NULL && fread(bytes, 1, (size_t)size, f) == (size_t)size;
    fclose(f);
    eps_frame frame;
    eps_tensor x, y;
    size_t cursor = 0;
    ok = ok && eps_frame_parse(bytes, (size_t)size, 0, &frame) == EPS_OK && eps_frame_next(&frame, &cursor, &x) &&
         eps_frame_next(&frame, &cursor, &y) && strcmp(x.name, "x") == 0 && strcmp(y.name, "y") == 0 &&
         x.ndim == 2 && y.ndim == 1 && x.dims[0] == y.dims[0] && y.dims[0] > 0;
    if (ok) { /* labels or targets are checked against the job's loss at each step (eps_mlp_step) */
        g->n = y.dims[0];
        g->features = x.dims[1];
        g->x = malloc((size_t)x.elements * sizeof(float));
        g->y = malloc(g->n * sizeof(float));
        ok = g->x && g->y &&
             eps_codec_decode(frame.codec, x.payload, x.length, (uint32_t)x.elements, g->x) == EPS_OK &&
             eps_codec_decode(frame.codec, y.payload, y.length, g->n, g->y) == EPS_OK;
        for (uint32_t i = 0; ok && i < g->n; i++) ok = isfinite(g->y[i]);
    }
    free(bytes);
    return ok;
}

static char *read_secret(const char *path) {
    static char secret[256];
    FILE *f = fopen(path, "r");
    if (f == NULL || fgets(secret, sizeof secret, f) == NULL) {
        if (f) fclose(f);
        return NULL;
    }
    fclose(f);
    secret[strcspn(secret, "\r\n")] = '\0';
    return secret;
}

static int usage(const char *why) {
    fprintf(stderr, "edgeps-device: %s\nusage: edgeps-device --job J --device D --data FILE [--broker HOST:PORT] "
                    "[--username U] [--password-file F] [--tls-ca CA] [--tls-cert C --tls-key K] [--seed N] "
                    "[--step-time S] [--arena BYTES] [--max-batch N] [--resend-s S]\n",
            why);
    return 2;
}

int main(int argc, char **argv) {
    const char *broker = "127.0.0.1:1883", *job = "demo", *device = NULL, *data = NULL, *username = NULL;
    const char *password_file = NULL, *tls_ca = NULL, *tls_cert = NULL, *tls_key = NULL;
    double step_time = 0, resend_s = EPS_RESEND_S;
    size_t arena_size = 1u << 20;
    unsigned long max_batch = 256;
    gateway g = {0};
    for (int i = 1; i < argc; i++) {
        const char *flag = argv[i], *value = i + 1 < argc ? argv[i + 1] : NULL;
        if (value == NULL) return usage("every option takes a value");
        i++;
        if (strcmp(flag, "--broker") == 0) broker = value;
        else if (strcmp(flag, "--job") == 0) job = value;
        else if (strcmp(flag, "--device") == 0) device = value;
        else if (strcmp(flag, "--data") == 0) data = value;
        else if (strcmp(flag, "--username") == 0) username = value;
        else if (strcmp(flag, "--password-file") == 0) password_file = value;
        else if (strcmp(flag, "--tls-ca") == 0) tls_ca = value;
        else if (strcmp(flag, "--tls-cert") == 0) tls_cert = value;
        else if (strcmp(flag, "--tls-key") == 0) tls_key = value;
        else if (strcmp(flag, "--seed") == 0) g.seed = strtoull(value, NULL, 10);
        else if (strcmp(flag, "--step-time") == 0) step_time = strtod(value, NULL);
        else if (strcmp(flag, "--arena") == 0) arena_size = (size_t)strtoull(value, NULL, 10);
        else if (strcmp(flag, "--max-batch") == 0) max_batch = strtoul(value, NULL, 10);
        else if (strcmp(flag, "--resend-s") == 0) resend_s = strtod(value, NULL);
        else {
            fprintf(stderr, "edgeps-device: unknown option %s\n", flag);
            return 2;
        }
    }
    if (device == NULL || data == NULL) return usage("--device and --data are required");
    if (!load_data(&g, data)) {
        fprintf(stderr, "edgeps-device: --data %s: not a data frame of x (n, features) and y (n,)\n", data);
        return 2;
    }
    char host[256];
    const char *colon = strrchr(broker, ':');
    int port = colon ? atoi(colon + 1) : 1883;
    size_t host_len = colon ? (size_t)(colon - broker) : strlen(broker);
    if (host_len == 0 || host_len >= sizeof host || port <= 0 || port > 65535) return usage("--broker is HOST:PORT");
    memcpy(host, broker, host_len);
    host[host_len] = '\0';

    static eps_device dev;
    void *arena = malloc(arena_size); /* the only allocation the core uses, made once at start */
    eps_port p = {&g, port_publish, port_subscribe, port_unsubscribe, port_clock, port_entropy, port_sample, port_log, NULL};
    if (arena == NULL || max_batch == 0 || max_batch > 65536) return usage("bad --arena or --max-batch");
    if (!(resend_s >= 0.1 && resend_s <= 3600)) return usage("--resend-s is 0.1 .. 3600 seconds");
    if (eps_device_init(&dev, &p, job, device, g.n, arena, arena_size, (uint32_t)max_batch) != EPS_OK)
        return usage("--job and --device are 1-64 of [A-Za-z0-9_.-], starting alphanumeric");
    g.device = &dev;
    dev.resend_s = resend_s;

    mosquitto_lib_init();
    char client_id[160], will[320];
    snprintf(client_id, sizeof client_id, "edgeps-dev-%s-%s", job, device);
    g.mosq = mosquitto_new(client_id, false, &g); /* a persistent session */
    if (g.mosq == NULL) return usage("libmosquitto could not start");
    mosquitto_int_option(g.mosq, MOSQ_OPT_TCP_NODELAY, 1); /* no Nagle: a QoS 1 round trip in ~1 ms */
    size_t will_len = eps_device_status(&dev, "offline", will, sizeof will);
    mosquitto_will_set(g.mosq, dev.t_status, (int)will_len, will, 1, true);
    if (username != NULL) {
        const char *password = password_file ? read_secret(password_file) : getenv("EDGEPS_PASSWORD");
        if (password_file != NULL && password == NULL) return usage("--password-file cannot be read");
        mosquitto_username_pw_set(g.mosq, username, password);
    }
    if (tls_ca != NULL && mosquitto_tls_set(g.mosq, tls_ca, NULL, tls_cert, tls_key, NULL) != MOSQ_ERR_SUCCESS)
        return usage("--tls-ca, --tls-cert or --tls-key cannot be used");
    mosquitto_connect_callback_set(g.mosq, on_connect);
    mosquitto_disconnect_callback_set(g.mosq, on_disconnect);
    mosquitto_message_callback_set(g.mosq, on_message);
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    int rc = mosquitto_connect(g.mosq, host, port, 10);
    if (rc != MOSQ_ERR_SUCCESS) {
        fprintf(stderr, "edgeps-device: cannot connect to %s:%d: %s\n", host, port, mosquitto_strerror(rc));
        return 1;
    }
    fprintf(stderr, "edgeps-device: %s joins job %s on %s:%d (incarnation %llu, %u samples)\n", device, job, host,
            port, (unsigned long long)dev.incarnation, (unsigned)g.n);
    double backoff = 1, mark = monotonic();
    while (!dev.finished && dev.unable == EPS_OK && !stopping) {
        int ready = g.connected && eps_device_ready(&dev);
        rc = mosquitto_loop(g.mosq, ready ? 0 : 50, 1);
        if (rc != MOSQ_ERR_SUCCESS && !stopping) { /* reconnect with backoff, 1 s to 30 s */
            pause_for(backoff);
            backoff = backoff * 2 < 30 ? backoff * 2 : 30;
            if (mosquitto_reconnect(g.mosq) == MOSQ_ERR_SUCCESS) backoff = 1;
            continue;
        }
        if (ready && eps_device_ready(&dev)) {
            double started = monotonic();
            if (eps_device_step(&dev)) pause_for(step_time - (monotonic() - started));
        }
        double now = monotonic();
        if (g.connected) eps_device_tick(&dev, port_clock(&g)); /* retries, and the resend of a commit */
        if (ready) dev.busy_s += now - mark;
        else dev.idle_s += now - mark;
        mark = now;
    }
    eps_device_leave(&dev); /* the offline status with the totals; then let it out */
    for (int i = 0; i < 20 && mosquitto_want_write(g.mosq); i++) mosquitto_loop(g.mosq, 50, 1);
    mosquitto_disconnect(g.mosq);
    mosquitto_loop(g.mosq, 50, 1);
    mosquitto_destroy(g.mosq);
    mosquitto_lib_cleanup();
    fprintf(stderr, "edgeps-device: %s leaves (%s%s)\n", device,
            dev.diverged ? "local training diverged: the job's learning rate is too high for this model and data"
            : dev.unable != EPS_OK ? "it cannot take part in this job: "
            : dev.finished ? "the job finished" : "stopped", dev.unable != EPS_OK ? dev.unable_reason : "");
    int code = dev.unable != EPS_OK ? 3 : dev.diverged ? 2 : 0;
    free(arena);
    free(g.x);
    free(g.y);
    return code;
}
