/* The least a Cortex-M4F needs to run C: a vector table, and a reset handler that copies .data,
 * zeroes .bss, paints the stack (so that its peak can be measured), turns the FPU on and calls
 * main. For QEMU (mps2-an386) and real parts alike. */
#include <stdint.h>

#include "board.h"

extern uint32_t _data_load, _data_start, _data_end, _bss_start, _bss_end, _stack_bottom, _stack_top;
extern int main(void);

void reset_handler(void);
void fault_handler(void);
void systick_handler(void);

/* The initial stack pointer, then the handlers: reset, NMI, hard fault, memory, bus and usage
 * faults, four reserved, SVCall, debug monitor, reserved, PendSV, SysTick (board_clock). */
__attribute__((section(".vectors"), used)) static const uintptr_t vectors[16] = {
    (uintptr_t)&_stack_top,     (uintptr_t)reset_handler, (uintptr_t)fault_handler, (uintptr_t)fault_handler,
    (uintptr_t)fault_handler,   (uintptr_t)fault_handler, (uintptr_t)fault_handler, 0, 0, 0, 0,
    (uintptr_t)fault_handler,   (uintptr_t)fault_handler, 0, (uintptr_t)fault_handler,
    (uintptr_t)systick_handler,
};

void fault_handler(void) { board_exit(3); }

#define PAINT 0xC5C5C5C5u

void reset_handler(void) {
    uint32_t *from = &_data_load, *to = &_data_start, *sp;
    while (to < &_data_end) *to++ = *from++;
    for (to = &_bss_start; to < &_bss_end; to++) *to = 0;
    __asm__ volatile("mov %0, sp" : "=r"(sp));
    for (to = &_stack_bottom; to < sp - 16; to++) *to = PAINT; /* below what this function uses */
    *(volatile uint32_t *)0xE000ED88 |= 0xFu << 20; /* CPACR: full access to CP10 and CP11, the FPU */
    __asm__ volatile("dsb\n\tisb");
    board_exit(main());
}

uint32_t board_stack_peak(void) {
    const uint32_t *at = &_stack_bottom;
    while (at < &_stack_top && *at == PAINT) at++;
    return (uint32_t)((uintptr_t)&_stack_top - (uintptr_t)at);
}
