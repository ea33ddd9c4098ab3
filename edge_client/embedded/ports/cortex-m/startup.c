/* The least a Cortex-M4F needs to run C: a vector table, and a reset handler that copies .data,
 * zeroes .bss, turns the FPU on and calls main. For QEMU (mps2-an386) and real parts alike. */
#include <stdint.h>

extern uint32_t _data_load, _data_start, _data_end, _bss_start, _bss_end, _stack_top;
extern int main(void);
extern void exit(int);

void reset_handler(void);
void fault_handler(void);

/* The initial stack pointer, then the handlers: reset, NMI, hard fault, memory, bus and usage faults. */
__attribute__((section(".vectors"), used)) static const uintptr_t vectors[16] = {
    (uintptr_t)&_stack_top, (uintptr_t)reset_handler, (uintptr_t)fault_handler,
    (uintptr_t)fault_handler,             (uintptr_t)fault_handler, (uintptr_t)fault_handler,
    (uintptr_t)fault_handler,
};

void fault_handler(void) {
    exit(3);
}

void reset_handler(void) {
    uint32_t *from = &_data_load, *to = &_data_start;
    while (to < &_data_end) *to++ = *from++;
    for (to = &_bss_start; to < &_bss_end; to++) *to = 0;
    *(volatile uint32_t *)0xE000ED88 |= 0xFu << 20; /* CPACR: full access to CP10 and CP11, the FPU */
    __asm__ volatile("dsb\n\tisb");
    exit(main());
}

void _init(void) {}
void _fini(void) {}
