/* The device core on a Cortex-M4F, under QEMU (mps2-an386, semihosting for stdout).
 *
 * With -DSCRIPT (and the script.h a test writes: a Control, a parameter frame, a delta frame and a
 * data frame, all exported by the Python reference), it runs the exchange: control and
 * parameters in, local steps up to a commit, the delta in, steps up to the next commit. It prints
 * every batch index it draws ("IDX i"), every frame it publishes ("PUB topic hex"), the arena
 * the model needs ("ARENA n") and "DONE". Without SCRIPT it is the same program with no data:
 * what its flash and RAM cost (edgeps bench embedded). */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "edgeps.h"

#ifndef ARENA_BYTES
#define ARENA_BYTES 4
#endif

extern void initialise_monitor_handles(void);

static float arena[(ARENA_BYTES + 3) / 4];
static eps_device dev;
static uint64_t ticks;

#ifdef SCRIPT
#include "script.h"
static float xs[DATA_SAMPLES * DATA_FEATURES];
static float ys[DATA_SAMPLES];
#endif

static int publish(void *ctx, const char *topic, const uint8_t *payload, size_t len, int retain) {
    (void)ctx;
    (void)retain;
#ifdef SCRIPT
    printf("PUB %s ", topic);
    for (size_t i = 0; i < len; i++) printf("%02x", payload[i]);
    printf("\n");
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
    printf("IDX %u\n", (unsigned)index);
    memcpy(x, xs + (size_t)index * DATA_FEATURES, sizeof(float) * DATA_FEATURES);
    *y = ys[index];
    return 1;
#else
    (void)index, (void)x, (void)y;
    return 0;
#endif
}

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
    eps_status st = eps_frame_parse(DATA, sizeof DATA, 0, &f);
    if (st != EPS_OK) printf("data frame: %s\n", eps_status_name(st));
    if (st != EPS_OK || !eps_frame_next(&f, &cursor, &x) ||
        !eps_frame_next(&f, &cursor, &y) || x.elements != (uint64_t)DATA_SAMPLES * DATA_FEATURES)
        return 0;
    if (eps_codec_decode(f.codec, x.payload, x.length, (uint32_t)x.elements, xs) != EPS_OK ||
        eps_codec_decode(f.codec, y.payload, y.length, DATA_SAMPLES, ys) != EPS_OK)
        return 0;
    return 1;
}
#endif

int main(void) {
    eps_port port = {0, publish, subscription, subscription, clock_s, entropy, sample};
    initialise_monitor_handles();
#ifdef SCRIPT
    if (!load_data()) {
        printf("FAIL data frame\n");
        return 1;
    }
    if (eps_device_init(&dev, &port, "emb", "mcu-0", DATA_SAMPLES, arena, sizeof arena, 32) != EPS_OK) {
        printf("FAIL device\n");
        return 1;
    }
    dev.incarnation = SCRIPT_INCARNATION; /* the incarnation the script's Control answers */
    eps_device_connected(&dev);
    eps_device_message(&dev, "edgeps/emb/ctrl/mcu-0", CONTROL, sizeof CONTROL - 1);
    eps_device_message(&dev, "edgeps/emb/params", PARAMS, sizeof PARAMS);
    if (!steps_to_commit()) {
        printf("FAIL first commit (%s)\n", eps_status_name(dev.error));
        return 1;
    }
    eps_device_message(&dev, "edgeps/emb/delta", DELTA, sizeof DELTA);
    if (dev.server_version != 1 || !steps_to_commit()) {
        printf("FAIL second commit (%s)\n", eps_status_name(dev.error));
        return 1;
    }
    printf("ARENA %lu\nDONE\n", (unsigned long)eps_device_arena_size(&dev.mlp, 32, dev.control.codec, dev.control.pull_codec));
    return 0;
#else
    /* every entry point the device uses, so that the linker keeps what a real gateway flashes */
    static const uint8_t nothing[1];
    if (eps_device_init(&dev, &port, "emb", "mcu-0", 1, arena, sizeof arena, 32) != EPS_OK) return 1;
    eps_device_connected(&dev);
    eps_device_message(&dev, "edgeps/emb/params", nothing, 0);
    eps_device_step(&dev);
    eps_device_leave(&dev);
    return 0;
#endif
}
