/* The device core on a Cortex-M4F, under QEMU (mps2-an386; semihosting for its console). Its
 * arena is a static array (ARENA_BYTES), so the linker counts it; nothing allocates (the Makefile
 * links with malloc forbidden).
 *
 * Without a mode it is the device with no data: every entry point a gateway uses, for its flash
 * and RAM figures (edgeps bench embedded). With -DSCRIPT (and the script.h a test writes: a
 * Control, a parameter frame, a delta frame and a data frame, all exported by the Python
 * reference) it runs the exchange: control and parameters in, local steps up to a commit, the
 * delta in, steps up to the next commit; it prints every frame it publishes ("PUB topic hex"), the
 * batch indices it drew ("IDX i ..."), the arena the model needs, the instructions that receiving
 * the parameter frame and one local step took (SysTick under -icount), the stack's peak, "DONE".
 * With -DCORPUS (corpus.h: a setup and hostile messages) it feeds each message and prints its
 * verdict ("V i status"), then mutated copies of them ("FUZZED n"), then "DONE".
 * With -DNETWORK (device.h: the device's job, id, credentials, seed and data, written in at build
 * time) it is a device that joins a job: the SDK's MQTT client over UART0, which QEMU joins to a
 * TCP socket (`-serial tcp:HOST:PORT`: the broker, as through a modem in transparent mode); its
 * data frame stays in flash and is read a sample at a time. */
#include <stdint.h>
#include <string.h>

#include "board.h"
#include "edgeps.h"

#ifndef ARENA_BYTES
#define ARENA_BYTES 4
#endif

static float arena[(ARENA_BYTES + 3) / 4];
static eps_device dev;
static uint64_t ticks;

#if defined(SCRIPT)
#include "script.h"
static float xs[DATA_SAMPLES * DATA_FEATURES];
static float ys[DATA_SAMPLES];
static uint16_t drawn[1024];
static uint32_t draws;
#elif defined(NETWORK)
#include "device.h"
#include "edgeps_mqtt.h"
#ifndef DEVICE_KEEP_ALIVE_S
#define DEVICE_KEEP_ALIVE_S 20 /* a cut link is noticed within 1.75 x this (the UART carries no carrier) */
#endif
static eps_mqtt mqtt;
static uint8_t rx[RX_BYTES];           /* a message taken whole: a delta, a JSON message (snapshots stream into the arena) */
static uint8_t small[512];              /* a status, copied: the core's is on its stack */
static const uint8_t *data_x, *data_y;  /* the data frame's tensors, in flash */
#elif defined(CORPUS)
#include "corpus.h"
static uint8_t mutated[CORPUS_MAX_BYTES];
static int quiet; /* the mutations' refusals are not printed */
#endif

static int publish(void *ctx, const char *topic, const uint8_t *payload, size_t len, int retain) {
    (void)ctx, (void)retain;
#ifdef NETWORK
    if (len <= sizeof small && !eps_mqtt_sending(&mqtt)) { /* a status: copied, the core's goes away */
        memcpy(small, payload, len);
        payload = small;
    } else if (len <= sizeof small) {
        return -1; /* busy: the core tries again */
    } /* a commit: written from the arena, where it stays until its PUBACK (port.sending) */
    return eps_mqtt_publish(&mqtt, topic, payload, len, 1, retain) == EPS_MQTT_OK ? 0 : -1;
#elif defined(SCRIPT)
    board_write("PUB ");
    board_write(topic);
    board_write(" ");
    board_write_hex(payload, (uint32_t)len);
    board_write("\n");
#else
    (void)topic, (void)payload, (void)len;
#endif
    return 0;
}

static int subscription(void *ctx, const char *topic) {
    (void)ctx, (void)topic;
#ifdef NETWORK
    return eps_mqtt_subscribe(&mqtt, topic) == EPS_MQTT_OK ? 0 : -1;
#else
    return 0;
#endif
}

#ifdef NETWORK
static int unsubscription(void *ctx, const char *topic) {
    (void)ctx;
    return eps_mqtt_unsubscribe(&mqtt, topic) == EPS_MQTT_OK ? 0 : -1;
}

static int sending(void *ctx) {
    (void)ctx;
    return eps_mqtt_sending(&mqtt);
}

static int moved; /* bytes went over the UART since the loop last looked */

static long uart_send(void *ctx, const uint8_t *data, size_t len) {
    (void)ctx;
    long n = board_uart_send(data, len);
    moved |= n > 0;
    return n;
}

static long uart_recv(void *ctx, uint8_t *data, size_t cap) {
    (void)ctx;
    long n = board_uart_recv(data, cap);
    moved |= n > 0;
    return n;
}

static void inbound(void *ctx, const char *topic, const uint8_t *payload, size_t len) {
    eps_device_message(ctx, topic, payload, len); /* a refusal is said through the log hook */
}

/* A parameter frame, straight into the arena as its bytes come off the UART. */
static int stream_begin(void *ctx, const char *topic, size_t len) { return eps_device_stream_begin(ctx, topic, len); }
static uint8_t *stream_room(void *ctx, size_t *cap) { return eps_device_stream_room(ctx, cap); }
static void stream_wrote(void *ctx, size_t n) { eps_device_stream_wrote(ctx, n); }
static void stream_end(void *ctx, int complete) { eps_device_stream_end(ctx, complete); }
#endif

static double clock_s(void *ctx) {
    (void)ctx;
#ifdef NETWORK
    return board_clock();
#else
    return (double)++ticks * 0.001;
#endif
}

static uint64_t entropy(void *ctx) { /* a real part: its hardware RNG; here the seed written in, and time */
    (void)ctx;
#ifdef NETWORK
    ticks += 0x9E3779B97F4A7C15u ^ (uint64_t)(board_clock() * 1e3);
    uint64_t z = ticks + DEVICE_SEED * 0xBF58476D1CE4E5B9u;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9u;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBu;
    return z ^ (z >> 31);
#else
    return 0x9E3779B97F4A7C15u * ++ticks;
#endif
}

static int sample(void *ctx, uint32_t index, float *x, float *y) {
    (void)ctx;
#ifdef NETWORK
    if (index >= DATA_SAMPLES) return 0; /* float32 little-endian, as this core stores them */
    memcpy(x, data_x + (size_t)index * DATA_FEATURES * 4u, DATA_FEATURES * 4u);
    memcpy(y, data_y + (size_t)index * 4u, 4u);
    return 1;
#elif defined(SCRIPT)
    if (index >= DATA_SAMPLES) return 0;
    if (draws < sizeof drawn / sizeof drawn[0]) drawn[draws++] = (uint16_t)index;
    memcpy(x, xs + (size_t)index * DATA_FEATURES, sizeof(float) * DATA_FEATURES);
    *y = ys[index];
    return 1;
#else
    (void)index, (void)x, (void)y;
    return 0;
#endif
}

static void say(void *ctx, eps_status status, const char *reason) {
    (void)ctx;
#ifdef CORPUS
    if (quiet) return;
#endif
#if defined(SCRIPT) || defined(CORPUS) || defined(NETWORK)
    board_write("LOG ");
    board_write(eps_status_name(status));
    board_write(": ");
    board_write(reason);
    board_write("\n");
#else
    (void)status, (void)reason;
#endif
}

#if defined(SCRIPT) || defined(CORPUS) || defined(NETWORK)
static void line(const char *key, uint64_t value) {
    board_write(key);
    board_write(" ");
    board_write_uint(value);
    board_write("\n");
}
#endif

#ifdef SCRIPT
static int steps_to_commit(void) {
    uint64_t seq = dev.seq;
    for (int i = 0; i < 100000 && dev.seq == seq; i++)
        if (!eps_device_step(&dev) && dev.seq == seq) return 0;
    return dev.seq != seq;
}

static int load_data(void) {
    eps_frame f;
    eps_tensor x, y;
    size_t cursor = 0;
    if (eps_frame_parse(DATA, sizeof DATA, 0, &f) != EPS_OK || !eps_frame_next(&f, &cursor, &x) ||
        !eps_frame_next(&f, &cursor, &y) || x.elements != (uint64_t)DATA_SAMPLES * DATA_FEATURES)
        return 0;
    return eps_codec_decode(f.codec, x.payload, x.length, (uint32_t)x.elements, xs) == EPS_OK &&
           eps_codec_decode(f.codec, y.payload, y.length, DATA_SAMPLES, ys) == EPS_OK;
}

/* A message handed over as a UART would, 64 bytes at a time (eps_device_stream_*). */
static eps_status stream_in(const char *topic, const uint8_t *payload, size_t len) {
    if (!eps_device_stream_begin(&dev, topic, len)) return eps_device_message(&dev, topic, payload, len);
    for (size_t got = 0; got < len;) {
        size_t cap, n = len - got < 64 ? len - got : 64;
        uint8_t *at = eps_device_stream_room(&dev, &cap);
        n = n < cap ? n : cap;
        memcpy(at, payload + got, n);
        eps_device_stream_wrote(&dev, n);
        got += n;
    }
    return eps_device_stream_end(&dev, 1);
}

static int fail(const char *what) {
    board_write("FAIL ");
    board_write(what);
    board_write(" (");
    board_write(eps_status_name(dev.error));
    board_write(")\n");
    return 1;
}
#endif

#ifdef NETWORK
/* The data frame's x (n, features) and y (n,), found where they lie in flash. */
static int find_data(void) {
    eps_frame f;
    eps_tensor x, y;
    size_t cursor = 0;
    if (eps_frame_parse(DATA, sizeof DATA, 0, &f) != EPS_OK || f.codec.id != EPS_FP32 ||
        !eps_frame_next(&f, &cursor, &x) || !eps_frame_next(&f, &cursor, &y) ||
        x.elements != (uint64_t)DATA_SAMPLES * DATA_FEATURES || y.elements != DATA_SAMPLES)
        return 0;
    data_x = x.payload;
    data_y = y.payload;
    return 1;
}

static void connect(void) {
    static char will[320 + EPS_REASON_MAX];
    size_t n = eps_device_status(&dev, "offline", will, sizeof will);
    eps_mqtt_options o = {DEVICE_CLIENT_ID, DEVICE_USERNAME, DEVICE_PASSWORD, dev.t_status, (const uint8_t *)will, n,
                          1, DEVICE_KEEP_ALIVE_S, 0};
    eps_mqtt_connect(&mqtt, &o, board_clock());
}

static int network(void) {
    eps_port port = {0, publish, subscription, unsubscription, clock_s, entropy, sample, say, sending};
    eps_mqtt_transport io = {0, uart_send, uart_recv};
    if (!find_data()) {
        board_write("FAIL the data frame\n");
        return 1;
    }
    board_uart_init();
    board_clock_start();
    if (eps_device_init(&dev, &port, DEVICE_JOB, DEVICE_ID, DATA_SAMPLES, arena, sizeof arena, 32) != EPS_OK) return 1;
#ifdef __riscv
    strcpy(dev.backend, "firmware-rv32"); /* what the job's report says this trainer is */
#else
    strcpy(dev.backend, "firmware-m4");
#endif
    eps_mqtt_init(&mqtt, &io, rx, sizeof rx, inbound, &dev);
    mqtt.stream = (eps_mqtt_stream){stream_begin, stream_room, stream_wrote, stream_end};
    line("INCARNATION", dev.incarnation);
    connect();
    double asked = board_clock(), left = 0, quiet_since = 0;
    int was = 0;
    for (;;) {
        double now = board_clock();
        eps_mqtt_status st = eps_mqtt_poll(&mqtt, now);
        if (st != EPS_MQTT_OK || (!mqtt.connected && now - asked > 5)) { /* the link again, after a second */
            if (was) board_write("LOG the link broke: connecting again\n");
            was = 0;
            if (now - asked > 1) connect(), asked = now;
            continue;
        }
        if (mqtt.connected && !was) { /* subscribe, say hello (what the client refuses, the tick retries) */
            was = 1;
            board_write("CONNECTED\n");
            eps_device_connected(&dev);
        }
        if (!mqtt.connected) continue;
        eps_device_tick(&dev, now);
        if (dev.finished || dev.unable != EPS_OK) {
            if (left == 0) eps_device_leave(&dev), left = now;
            if ((!eps_mqtt_sending(&mqtt) && mqtt.tx_len == 0) || now - left > 5) break;
            continue;
        }
        if (moved) quiet_since = now, moved = 0;
        if (eps_device_ready(&dev)) eps_device_step(&dev);
        else if (now - quiet_since > 0.005) board_idle(); /* waiting on the job, the link quiet: sleep, not spin */
    }
    eps_mqtt_disconnect(&mqtt);
    for (double until = board_clock() + 1; board_clock() < until && mqtt.tx_len;) eps_mqtt_poll(&mqtt, board_clock());
    line("STEPS", dev.seq);
    line("STACK", board_stack_peak());
    board_write(dev.unable != EPS_OK ? "UNABLE\n" : "DONE\n");
    return dev.unable != EPS_OK ? 3 : 0;
}
#endif

int main(void) {
#if defined(NETWORK)
    return network();
#else
    eps_port port = {0, publish, subscription, subscription, clock_s, entropy, sample, say, NULL};
#endif
#if defined(NETWORK)
#elif defined(SCRIPT)
    if (!load_data()) return fail("data frame");
    if (eps_device_init(&dev, &port, "emb", "mcu-0", DATA_SAMPLES, arena, sizeof arena, 32) != EPS_OK)
        return fail("device");
    dev.incarnation = SCRIPT_INCARNATION; /* the incarnation the script's Control answers */
    eps_device_connected(&dev);
    if (eps_device_message(&dev, "edgeps/emb/ctrl/mcu-0", CONTROL, sizeof CONTROL - 1) != EPS_OK)
        return fail("control");
    /* the first snapshot is read for the model's shape (the arena is laid out for it), then again
     * into place, as the broker sends the retained one again: that second reading is timed */
    if (stream_in("edgeps/emb/params", PARAMS, sizeof PARAMS) != EPS_OK || !dev.has_model) return fail("model");
    board_ticks_start();
    eps_status st = stream_in("edgeps/emb/params", PARAMS, sizeof PARAMS);
    uint64_t params_ticks = board_ticks();
    if (st != EPS_OK || dev.server_version != 0) return fail("parameters");
    board_ticks_start();
    int trained = eps_device_step(&dev); /* one local step (push_every > 1: no commit in it) */
    uint64_t step_ticks = board_ticks();
    if (!trained || !steps_to_commit()) return fail("first commit");
    eps_device_message(&dev, "edgeps/emb/delta", DELTA, sizeof DELTA);
    if (dev.server_version != 1 || !steps_to_commit()) return fail("second commit");
    for (uint32_t i = 0; i < draws; i++) line("IDX", drawn[i]);
    line("ARENA", eps_device_arena_size(&dev.mlp, 32, dev.control.codec));
    line("PARAMS_INSTRUCTIONS", board_instructions(params_ticks));
    line("STEP_INSTRUCTIONS", board_instructions(step_ticks));
    line("STACK", board_stack_peak());
    board_write("DONE\n");
    return 0;
#elif defined(CORPUS)
    if (eps_device_init(&dev, &port, "fz", "d", 100, arena, sizeof arena, 32) != EPS_OK) return 1;
    dev.incarnation = CORPUS_INCARNATION;
    eps_device_connected(&dev);
    for (uint32_t i = 0; i < sizeof MESSAGES / sizeof MESSAGES[0]; i++) {
        eps_status st = eps_device_message(&dev, MESSAGES[i].topic, MESSAGES[i].data, MESSAGES[i].len);
        board_write("V ");
        board_write_uint(i);
        board_write(" ");
        board_write(eps_status_name(st));
        board_write("\n");
    }
    uint64_t rng = 0x9E3779B97F4A7C15u;
    quiet = 1;
    uint32_t fuzzed = 0;
    for (; fuzzed < CORPUS_MUTATIONS; fuzzed++) { /* the same mutations as epsf fuzz: truncations, bytes, bits */
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        uint32_t which = (uint32_t)(rng % (sizeof MESSAGES / sizeof MESSAGES[0])), len = MESSAGES[which].len;
        memcpy(mutated, MESSAGES[which].data, len);
        switch ((rng >> 20) % 3) {
        case 0: len = len ? (uint32_t)((rng >> 24) % len) : 0; break;
        case 1: mutated[(rng >> 24) % (len ? len : 1)] = (uint8_t)(rng >> 40); break;
        default: mutated[(rng >> 24) % (len ? len : 1)] ^= (uint8_t)(1u << ((rng >> 40) % 8));
        }
        if (len >= 4 && mutated[0] == 'E' && (rng >> 50) % 2) { /* a mended CRC: the parser looks past it */
            uint32_t crc = eps_crc32(0, mutated, len - 4);
            for (int k = 0; k < 4; k++) mutated[len - 4 + (uint32_t)k] = (uint8_t)(crc >> (8 * k));
        }
        eps_device_message(&dev, MESSAGES[which].topic, mutated, len);
        if ((rng >> 60) == 0) eps_device_step(&dev);
    }
    line("FUZZED", fuzzed);
    line("STACK", board_stack_peak());
    board_write("DONE\n");
    return 0;
#else
    /* every entry point the device uses, so that the linker keeps what a real gateway flashes */
    static const uint8_t nothing[1];
    if (eps_device_init(&dev, &port, "emb", "mcu-0", 1, arena, sizeof arena, 32) != EPS_OK) return 1;
    eps_device_connected(&dev);
    eps_device_message(&dev, "edgeps/emb/params", nothing, 0);
    eps_device_step(&dev);
    eps_device_tick(&dev, clock_s(0));
    eps_device_leave(&dev);
    return 0;
#endif
}
