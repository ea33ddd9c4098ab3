/* The firmware's console over semihosting (QEMU -semihosting; a debugger on a real board), the
 * same on every board: text, numbers and hex through SYS_WRITE0, the end through
 * SYS_EXIT_EXTENDED. Each board's board.c supplies board_semihost, its trap into the host. */
#include "board.h"

void board_write(const char *text) { board_semihost(0x04, text); }

void board_write_uint(uint64_t value) {
    char digits[24];
    int i = (int)sizeof digits - 1;
    digits[i] = '\0';
    do digits[--i] = (char)('0' + value % 10); while ((value /= 10) != 0);
    board_write(digits + i);
}

void board_write_hex(const uint8_t *bytes, uint32_t len) {
    static const char hex[] = "0123456789abcdef";
    char chunk[129];
    uint32_t n = 0;
    for (uint32_t i = 0; i < len; i++) {
        chunk[n++] = hex[bytes[i] >> 4];
        chunk[n++] = hex[bytes[i] & 15];
        if (n == 128 || i + 1 == len) {
            chunk[n] = '\0';
            board_write(chunk);
            n = 0;
        }
    }
}

void board_exit(int code) {
    uint32_t block[2] = {0x20026u, (uint32_t)code}; /* ADP_Stopped_ApplicationExit, the exit code */
    board_semihost(0x20, block);                      /* SYS_EXIT_EXTENDED */
    for (;;) __asm__ volatile("wfi");
}
