/* Sizes computed from what a frame or a message says, in arithmetic that cannot wrap: every
 * layout computation (the model's parameters, the arena's regions, a codec's payload) goes
 * through these. A result that does not fit size_t saturates at SIZE_MAX, which no arena or
 * buffer reaches, so the caller's "does it fit" check refuses it: a 32-bit target (size_t of 32
 * bits) gets the same verdict as a 64-bit host. Internal. */
#ifndef EDGEPS_SIZE_H
#define EDGEPS_SIZE_H

#include <stddef.h>
#include <stdint.h>

#ifndef SIZE_MAX
#define SIZE_MAX ((size_t)-1)
#endif

static inline size_t eps_size_add(size_t a, size_t b) { return a > SIZE_MAX - b ? SIZE_MAX : a + b; }

static inline size_t eps_size_mul(size_t a, size_t b) { return b != 0 && a > SIZE_MAX / b ? SIZE_MAX : a * b; }

/* a * b + c */
static inline size_t eps_size_mad(size_t a, size_t b, size_t c) { return eps_size_add(eps_size_mul(a, b), c); }

#endif /* EDGEPS_SIZE_H */
