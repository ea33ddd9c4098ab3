/* Training data streamed from a sensor instead of a file: the port's sample() reads a ring buffer
 * that the sensor's interrupt handler (or a polling task) fills with labelled readings, so the
 * device always trains on the newest ones. The ring is the data set: pass RING as the `samples`
 * of eps_device_init. Until the first reading, sample() says no and the device skips its steps.
 *
 * Build and run its self-check on a host: make sensor-ring && build/sensor-ring */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "edgeps.h"

#define FEATURES 6 /* e.g. a 3-axis accelerometer and a 3-axis gyroscope */
#define RING 256

typedef struct {
    float x[RING][FEATURES];
    float y[RING];
    volatile uint32_t written; /* readings pushed so far; one 32-bit store: atomic on a Cortex-M */
} sensor_ring;

/* From the sensor's interrupt: one labelled reading (the label from a button, a rule, a second sensor). */
void sensor_push(sensor_ring *r, const float x[FEATURES], float label) {
    uint32_t slot = r->written % RING;
    memcpy(r->x[slot], x, sizeof r->x[slot]);
    r->y[slot] = label;
    r->written = r->written + 1; /* published after the reading is whole */
}

/* The port's sample(): reading `index` counted back from the newest of those in the ring. */
int sensor_sample(void *ctx, uint32_t index, float *x, float *y) {
    sensor_ring *r = ctx;
    uint32_t written = r->written, held = written < RING ? written : RING;
    if (held == 0) return 0;
    uint32_t slot = (written - 1 - index % held) % RING;
    memcpy(x, r->x[slot], sizeof r->x[slot]);
    *y = r->y[slot];
    return 1;
}

#ifdef SENSOR_RING_MAIN
/* The self-check: an empty ring says no; after 300 readings the ring holds the newest 256. */
int main(void) {
    static sensor_ring ring;
    float x[FEATURES], got[FEATURES];
    float y = 0.0f;
    if (sensor_sample(&ring, 0, got, &y)) return 1;
    for (uint32_t i = 0; i < 300; i++) {
        for (int k = 0; k < FEATURES; k++) x[k] = (float)i + 0.1f * (float)k;
        sensor_push(&ring, x, (float)(i % 3));
    }
    if (!sensor_sample(&ring, 0, got, &y) || got[0] != 299.0f || y != 299 % 3) return 1; /* the newest */
    if (!sensor_sample(&ring, 255, got, &y) || got[0] != 44.0f) return 1;               /* the oldest held */
    if (!sensor_sample(&ring, 256, got, &y) || got[0] != 299.0f) return 1;              /* wraps around */
    printf("sensor ring ok\n");
    return 0;
}
#endif
