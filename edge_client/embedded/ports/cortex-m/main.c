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
 * verdict ("V i status"), then mutated copies of them ("FUZZED n"), then "DONE". */
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
#elif defined(CORPUS)
#include "corpus.h"
static uint8_t mutated[CORPUS_MAX_BYTES];
static int quiet; /* the mutations' refusals are not printed */
#endif

static int publish(void *ctx, const char *topic, const uint8_t *payload, size_t len, int retain) {
    (void)ctx, (void)retain;
#ifdef SCRIPT
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
    return 0;
}

static double clock_s(void *ctx) {
    (void)ctx;
    return (double)++ticks * 0.001;
}

static uint64_t entropy(void *ctx) {
    (void)ctx;
    return 0x9E3779B97F4A7C15u * ++ticks;
}

static int sample(void *ctx, uint32_t index, float *x, float *y) {
    (void)ctx;
#ifdef SCRIPT
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
#if defined(SCRIPT) || defined(CORPUS)
    board_write("LOG ");
    board_write(eps_status_name(status));
    board_write(": ");
    board_write(reason);
    board_write("\n");
#else
    (void)status, (void)reason;
#endif
}

#if defined(SCRIPT) || defined(CORPUS)
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

static int fail(const char *what) {
    board_write("FAIL ");
    board_write(what);
    board_write(" (");
    board_write(eps_status_name(dev.error));
    board_write(")\n");
    return 1;
}
#endif

int main(void) {
    eps_port port = {0, publish, subscription, subscription, clock_s, entropy, sample, say};
#if defined(SCRIPT)
    if (!load_data()) return fail("data frame");
    if (eps_device_init(&dev, &port, "emb", "mcu-0", DATA_SAMPLES, arena, sizeof arena, 32) != EPS_OK)
        return fail("device");
    dev.incarnation = SCRIPT_INCARNATION; /* the incarnation the script's Control answers */
    eps_device_connected(&dev);
    if (eps_device_message(&dev, "edgeps/emb/ctrl/mcu-0", CONTROL, sizeof CONTROL - 1) != EPS_OK)
        return fail("control");
    board_ticks_start();
    eps_status st = eps_device_message(&dev, "edgeps/emb/params", PARAMS, sizeof PARAMS);
    uint64_t params_ticks = board_ticks();
    if (st != EPS_OK) return fail("parameters");
    board_ticks_start();
    int trained = eps_device_step(&dev); /* one local step (push_every > 1: no commit in it) */
    uint64_t step_ticks = board_ticks();
    if (!trained || !steps_to_commit()) return fail("first commit");
    eps_device_message(&dev, "edgeps/emb/delta", DELTA, sizeof DELTA);
    if (dev.server_version != 1 || !steps_to_commit()) return fail("second commit");
    for (uint32_t i = 0; i < draws; i++) line("IDX", drawn[i]);
    line("ARENA", eps_device_arena_size(&dev.mlp, 32, dev.control.codec, dev.control.pull_codec));
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
