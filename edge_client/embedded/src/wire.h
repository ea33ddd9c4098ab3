/* Little-endian reads and writes of the wire's integers and floats, on any host. Internal. */
#ifndef EDGEPS_WIRE_H
#define EDGEPS_WIRE_H

#include <stdint.h>
#include <string.h>

static inline uint16_t eps_get_u16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

static inline uint32_t eps_get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t eps_get_u64(const uint8_t *p) { return eps_get_u32(p) | (uint64_t)eps_get_u32(p + 4) << 32; }

static inline float eps_get_f32(const uint8_t *p) {
    uint32_t bits = eps_get_u32(p);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline void eps_put_u16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static inline void eps_put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static inline void eps_put_u64(uint8_t *p, uint64_t v) {
    eps_put_u32(p, (uint32_t)v);
    eps_put_u32(p + 4, (uint32_t)(v >> 32));
}

static inline void eps_put_f32(uint8_t *p, float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    eps_put_u32(p, bits);
}

#endif /* EDGEPS_WIRE_H */
