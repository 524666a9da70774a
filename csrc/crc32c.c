/* crc32c.c: CRC-32C (reflected polynomial 0x82F63B78): the SSE4.2 crc32 instruction where the CPU has it, else
 * table-driven slicing-by-8 (tables built once at first use); both give the same checksum.
 *
 * Design notes:
 *  1. The instruction's latency is three cycles and its throughput one a cycle, so one dependent chain runs at a
 *     third of the unit's speed. Long inputs are checksummed as three interleaved chains over three adjacent
 *     blocks (CRC_LONG bytes each, then CRC_SHORT for what is left), the second and third started from 0 and
 *     combined by the linearity of the CRC register: the register after A then B is shift_|B|(reg after A) xor
 *     (reg of B from 0), where shift_n multiplies by x^(8n) modulo the polynomial (tables of 4 x 256 words per
 *     block length, built once from shift_bytes). The checksum is the same as one chain's (tests compare it with
 *     slicing-by-8 and a bitwise model over lengths and alignments that cross the block sizes).
 */
#include "crc32c.h"

#include <pthread.h>
#include <string.h>

static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;
static int crc_hw; /* set once by crc_init: use the instruction */

static uint32_t multmodp(uint32_t a, uint32_t b);
static uint32_t shift_bytes(uint64_t n);

#define CRC_LONG 8192  /* design note 1: bytes per chain in a long block (three chains: 24 KiB) */
#define CRC_SHORT 256  /* and in a short one (768 bytes) */
static uint32_t crc_long[4][256], crc_short[4][256]; /* shift_CRC_LONG, shift_CRC_SHORT of each byte of a register */

/* t[k][i]: the register 'i << 8k' shifted past n zero bytes (a linear map: a register's shift is the xor of its
 * four bytes' entries) */
static void shift_table(uint32_t t[4][256], uint64_t n) {
    uint32_t op = shift_bytes(n);
    for (int k = 0; k < 4; k++)
        for (uint32_t i = 0; i < 256; i++) t[k][i] = multmodp(op, i << (8 * k));
}

static inline uint32_t shift_by(const uint32_t t[4][256], uint32_t c) {
    return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DBSP_CRC_HW 1
/* About 8 GB/s against about 1 GB/s for slicing-by-8: pushes and output records are checksummed on the step path. */
__attribute__((target("sse4.2"))) static uint32_t crc_sse42(uint32_t crc, const unsigned char *p, size_t len) {
    uint64_t c = (uint32_t)~crc;
    while (len && ((uintptr_t)p & 7)) {
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
        len--;
    }
    /* design note 1: three chains over three adjacent blocks, combined */
#define CRC_BLOCKS(B, table)                                                                            \
    while (len >= 3 * (size_t)(B)) {                                                                    \
        uint64_t c1 = 0, c2 = 0;                                                                        \
        const unsigned char *end = p + (B);                                                             \
        do {                                                                                            \
            uint64_t v0, v1, v2;                                                                        \
            memcpy(&v0, p, 8);                                                                          \
            memcpy(&v1, p + (B), 8);                                                                    \
            memcpy(&v2, p + 2 * (B), 8);                                                                \
            c = __builtin_ia32_crc32di(c, v0);                                                          \
            c1 = __builtin_ia32_crc32di(c1, v1);                                                        \
            c2 = __builtin_ia32_crc32di(c2, v2);                                                        \
            p += 8;                                                                                     \
        } while (p < end);                                                                              \
        c = shift_by(table, (uint32_t)c) ^ (uint32_t)c1;                                                \
        c = shift_by(table, (uint32_t)c) ^ (uint32_t)c2;                                                \
        p += 2 * (B);                                                                                   \
        len -= 3 * (size_t)(B);                                                                         \
    }
    CRC_BLOCKS(CRC_LONG, crc_long)
    CRC_BLOCKS(CRC_SHORT, crc_short)
#undef CRC_BLOCKS
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
        p += 8;
        len -= 8;
    }
    while (len--) c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
    return ~(uint32_t)c;
}
#endif

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = crc_table[0][i];
        for (int t = 1; t < 8; t++) {
            c = crc_table[0][c & 0xff] ^ (c >> 8);
            crc_table[t][i] = c;
        }
    }
#ifdef DBSP_CRC_HW
    __builtin_cpu_init();
    crc_hw = __builtin_cpu_supports("sse4.2");
    if (crc_hw) {
        shift_table(crc_long, CRC_LONG);
        shift_table(crc_short, CRC_SHORT);
    }
#endif
}

uint32_t dbsp_crc32c(uint32_t crc, const void *data, size_t len) {
    pthread_once(&crc_once, crc_init);
#ifdef DBSP_CRC_HW
    if (crc_hw) return crc_sse42(crc, data, len);
#endif
    return dbsp_crc32c_portable(crc, data, len);
}

uint32_t dbsp_crc32c_portable(uint32_t crc, const void *data, size_t len) {
    pthread_once(&crc_once, crc_init);
    const unsigned char *p = data;
    uint32_t c = ~crc;
    while (len && ((uintptr_t)p & 7)) {
        c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
        len--;
    }
    while (len >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        lo = __builtin_bswap32(lo);
        hi = __builtin_bswap32(hi);
#endif
        lo ^= c;
        c = crc_table[7][lo & 0xff] ^ crc_table[6][(lo >> 8) & 0xff] ^ crc_table[5][(lo >> 16) & 0xff] ^
            crc_table[4][lo >> 24] ^ crc_table[3][hi & 0xff] ^ crc_table[2][(hi >> 8) & 0xff] ^
            crc_table[1][(hi >> 16) & 0xff] ^ crc_table[0][hi >> 24];
        p += 8;
        len -= 8;
    }
    while (len--) c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return ~c;
}

/* a * b modulo the polynomial, both reflected (zlib's multmodp) */
static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = (uint32_t)1 << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ 0x82F63B78u : b >> 1;
    }
    return p;
}

/* x^(8 n) modulo the polynomial: the shift of a CRC past n bytes */
static uint32_t shift_bytes(uint64_t n) {
    uint32_t x2k = (uint32_t)1 << 30, p = (uint32_t)1 << 31; /* x^1, x^0 */
    n <<= 3;
    while (n) {
        if (n & 1) p = multmodp(x2k, p);
        x2k = multmodp(x2k, x2k);
        n >>= 1;
    }
    return p;
}

uint32_t dbsp_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
    return multmodp(shift_bytes(len_b), crc_a) ^ crc_b;
}

uint32_t dbsp_crc32c_pages(uint32_t crc, const void *data, size_t len, size_t page, uint32_t *out) {
    const unsigned char *p = data;
    uint32_t op = page ? shift_bytes(page) : 0;
    size_t i = 0;
    if (page == 0) return dbsp_crc32c(crc, data, len);
    for (size_t at = 0; at < len; at += page, i++) {
        size_t n = len - at < page ? len - at : page;
        uint32_t c = dbsp_crc32c(0, p + at, n);
        out[i] = c;
        crc = (n == page ? multmodp(op, crc) : multmodp(shift_bytes(n), crc)) ^ c;
    }
    return crc;
}
