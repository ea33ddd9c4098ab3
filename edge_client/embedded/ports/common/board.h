/* What the firmware image (main.c) uses of its board: semihosting's console and exit (QEMU
 * -semihosting; a debugger on a real board), the painted stack's peak, a tick counter for
 * instruction counts under QEMU -icount, the UART and a clock. Implemented for the Cortex-M4F by
 * ports/cortex-m/board.c and startup.c, for RV32IMAC by ports/riscv32/board.c, the console for
 * both by ports/common/console.c; a real part's port supplies the same functions. No libc stdio: nothing here allocates. */
#ifndef EDGEPS_BOARD_H
#define EDGEPS_BOARD_H

#include <stddef.h>
#include <stdint.h>

/* The board's semihosting trap (bkpt 0xAB; RISC-V's ebreak sequence): op with its argument. */
uint32_t board_semihost(uint32_t op, const void *arg);

/* The console (ports/common/console.c, over board_semihost). */
void board_write(const char *text);
void board_write_uint(uint64_t value);
void board_write_hex(const uint8_t *bytes, uint32_t len);
void board_exit(int code) __attribute__((noreturn));

/* Bytes of stack used so far (deepest point below the top; the stack is painted at reset). */
uint32_t board_stack_peak(void);

/* SysTick at the core's clock: ticks since board_ticks_start() (which calibrates itself once,
 * on a loop of known length), up to 2^24 of them; under -icount every instruction takes the same
 * virtual time, so a tick is a fixed number of instructions (board_instructions). */
void board_ticks_start(void);
uint64_t board_ticks(void);
/* Instructions in `ticks`. */
uint64_t board_instructions(uint64_t ticks);

/* The UART (mps2-an386: the CMSDK UART0; virt: the 16550), non-blocking: the bytes written or
 * read (0: none now). Under QEMU, `-serial tcp:HOST:PORT` joins it to a TCP socket: a modem in
 * transparent mode. */
void board_uart_init(void);
long board_uart_send(const uint8_t *data, size_t len);
long board_uart_recv(uint8_t *data, size_t cap);

/* Sleep until the next interrupt, a millisecond at most (the core halts: WFI, woken by the clock's
 * tick): a device with nothing to do waits so instead of spinning. A byte the UART receives
 * meanwhile waits in its FIFO, and the link behind holds the rest. */
void board_idle(void);

/* Seconds since board_clock_start() (mps2-an386: SysTick at 1 kHz; virt: the CLINT's mtime). */
void board_clock_start(void);
double board_clock(void);

#endif /* EDGEPS_BOARD_H */
