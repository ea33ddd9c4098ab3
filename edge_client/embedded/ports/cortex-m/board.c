/* The board of the Cortex-M4F image under QEMU: the semihosting trap (the console over it is
 * ports/common/console.c), SysTick, the CMSDK UART. Newlib's stdio and its heap are not linked. */
#include "board.h"

uint32_t board_semihost(uint32_t op, const void *arg) {
    register uint32_t r0 __asm__("r0") = op;
    register const void *r1 __asm__("r1") = arg;
    __asm__ volatile("bkpt 0xAB" : "+r"(r0) : "r"(r1) : "memory");
    return r0;
}

#define SYST_CSR (*(volatile uint32_t *)0xE000E010u)
#define SYST_RVR (*(volatile uint32_t *)0xE000E014u)
#define SYST_CVR (*(volatile uint32_t *)0xE000E018u)
#define RELOAD 0xFFFFFFu

static uint64_t per_mille; /* instructions per 1000 ticks, measured once on a loop of known length */

static void restart(void) {
    SYST_CSR = 0;
    SYST_RVR = RELOAD;
    SYST_CVR = 0;
    SYST_CSR = 5; /* the core's clock, enabled, no interrupt */
}

void board_ticks_start(void) {
    if (per_mille == 0) {
        uint32_t n = 1000000;
        restart();
        __asm__ volatile("1: subs %0, #1\n\tbne 1b" : "+r"(n) : : "cc"); /* 2 instructions a turn */
        uint64_t spent = board_ticks();
        per_mille = spent ? 2000000000u / spent : 1;
    }
    restart();
}

uint64_t board_ticks(void) { return RELOAD - SYST_CVR; } /* 2^24 ticks at most: ~670 M instructions */

uint64_t board_instructions(uint64_t ticks) { return ticks * per_mille / 1000u; }

/* ---- UART0 (CMSDK APB UART) ---- */

#define UART_DATA (*(volatile uint32_t *)0x40004000u)
#define UART_STATE (*(volatile uint32_t *)0x40004004u) /* bit 0: TX full, bit 1: RX full */
#define UART_CTRL (*(volatile uint32_t *)0x40004008u)  /* bit 0: TX enable, bit 1: RX enable */
#define UART_BAUDDIV (*(volatile uint32_t *)0x40004010u)

void board_uart_init(void) {
    UART_BAUDDIV = 16; /* the least the UART takes; QEMU does not time the line */
    UART_CTRL = 3;
}

long board_uart_send(const uint8_t *data, size_t len) {
    size_t n = 0;
    while (n < len && !(UART_STATE & 1u)) UART_DATA = data[n++];
    return (long)n;
}

long board_uart_recv(uint8_t *data, size_t cap) {
    size_t n = 0;
    while (n < cap && (UART_STATE & 2u)) data[n++] = (uint8_t)UART_DATA;
    return (long)n;
}

/* ---- a millisecond clock ---- */

static volatile uint32_t millis;

void systick_handler(void) { millis++; }

void board_clock_start(void) {
    SYST_CSR = 0;
    SYST_RVR = 25000u - 1u; /* mps2-an386's 25 MHz core clock: a millisecond */
    SYST_CVR = 0;
    SYST_CSR = 7; /* the core's clock, the interrupt, enabled */
}

double board_clock(void) { return (double)millis * 0.001; }

void board_idle(void) { __asm__ volatile("wfi"); } /* SysTick's millisecond interrupt wakes it */
