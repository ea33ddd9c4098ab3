/* The board of the RV32IMAC image under QEMU's virt machine: reset (stack, .data, .bss, the stack
 * painted, a trap handler), the semihosting trap (QEMU -semihosting: the RISC-V sequence around
 * ebreak; the console over it is ports/common/console.c), the 16550 UART at 0x10000000 and the
 * CLINT's mtime (10 MHz) as the clock. It implements ports/common/board.h, so the same main.c
 * runs on both instruction sets. No libc stdio. */
#include <stddef.h>
#include <stdint.h>

#include "board.h"

extern uint32_t _data_load, _data_start, _data_end, _bss_start, _bss_end, _stack_bottom, _stack_top;
extern int main(void);
void reset(void);

__attribute__((naked, section(".init"))) void _start(void) {
    __asm__ volatile(".option push\n.option norelax\nla sp, _stack_top\n.option pop\nj reset");
}

__attribute__((aligned(4), interrupt("machine"))) static void trap(void) { board_exit(3); } /* a fault */

#define PAINT 0xC5C5C5C5u

void reset(void) {
    uint32_t *from = &_data_load, *to = &_data_start, *sp;
    while (to < &_data_end) *to++ = *from++;
    for (to = &_bss_start; to < &_bss_end; to++) *to = 0;
    __asm__ volatile("mv %0, sp" : "=r"(sp));
    for (to = &_stack_bottom; to < sp - 16; to++) *to = PAINT;
    __asm__ volatile(".option push\n.option arch, +zicsr\ncsrw mtvec, %0\n.option pop" : : "r"(trap));
    board_exit(main());
}

uint32_t board_stack_peak(void) {
    const uint32_t *at = &_stack_bottom;
    while (at < &_stack_top && *at == PAINT) at++;
    return (uint32_t)((uintptr_t)&_stack_top - (uintptr_t)at);
}

uint32_t board_semihost(uint32_t op, const void *arg) {
    register uint32_t a0 __asm__("a0") = op;
    register const void *a1 __asm__("a1") = arg;
    __asm__ volatile(".option push\n.option norvc\n.balign 16\nslli x0, x0, 0x1f\nebreak\nsrai x0, x0, 7\n.option pop"
                     : "+r"(a0)
                     : "r"(a1)
                     : "memory");
    return a0;
}

/* ---- the clock: the CLINT's mtime, 10 MHz on virt ---- */

static uint64_t mtime(void) {
    volatile uint32_t *t = (volatile uint32_t *)0x0200BFF8u;
    uint32_t hi, lo;
    do {
        hi = t[1];
        lo = t[0];
    } while (hi != t[1]);
    return (uint64_t)hi << 32 | lo;
}

static uint64_t clock_zero, ticks_zero, per_mille;

void board_clock_start(void) { clock_zero = mtime(); }
double board_clock(void) { return (double)(mtime() - clock_zero) * 1e-7; }

void board_ticks_start(void) {
    if (per_mille == 0) { /* instructions per 1000 ticks of mtime, on a loop of known length */
        uint32_t n = 1000000;
        uint64_t t0 = mtime();
        __asm__ volatile("1: addi %0, %0, -1\n\tbnez %0, 1b" : "+r"(n)); /* 2 instructions a turn */
        uint64_t spent = mtime() - t0;
        per_mille = spent ? 2000000000u / spent : 1;
    }
    ticks_zero = mtime();
}

uint64_t board_ticks(void) { return mtime() - ticks_zero; }

/* The timer a millisecond from now wakes WFI: its interrupt enabled in mie, but not in mstatus, so
 * no trap is taken (WFI resumes on a pending enabled interrupt whatever mstatus.MIE says). */
void board_idle(void) {
    volatile uint32_t *compare = (volatile uint32_t *)0x02004000u; /* the CLINT's mtimecmp, hart 0 */
    uint64_t at = mtime() + 10000u;
    compare[1] = 0xFFFFFFFFu; /* no spurious interrupt while its halves are written */
    compare[0] = (uint32_t)at;
    compare[1] = (uint32_t)(at >> 32);
    __asm__ volatile(".option push\n.option arch, +zicsr\ncsrs mie, %0\nwfi\n.option pop" : : "r"(1u << 7));
}
uint64_t board_instructions(uint64_t ticks) { return ticks * per_mille / 1000u; }

/* ---- the 16550 UART ---- */

#define UART ((volatile uint8_t *)0x10000000u)
#define LSR 5 /* bit 0: a byte received, bit 5: room to send */

void board_uart_init(void) {}

long board_uart_send(const uint8_t *data, size_t len) {
    size_t n = 0;
    while (n < len && (UART[LSR] & 0x20u)) UART[0] = data[n++];
    return (long)n;
}

long board_uart_recv(uint8_t *data, size_t cap) {
    size_t n = 0;
    while (n < cap && (UART[LSR] & 0x01u)) data[n++] = UART[0];
    return (long)n;
}
