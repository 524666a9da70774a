/* crc32c.c: CRC-32C (reflected polynomial 0x82F63B78): the SSE4.2 crc32 instruction where the CPU has it, else
 * table-driven slicing-by-8 (tables built once at first use); both give the same checksum. */
#include "crc32c.h"

#include <pthread.h>
#include <string.h>

static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;
static int crc_hw; /* set once by crc_init: use the instruction */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DBSP_CRC_HW 1
/* About 8 GB/s against about 1 GB/s for slicing-by-8: pushes and output records are checksummed on the step path. */
__attribute__((target("sse4.2"))) static uint32_t crc_sse42(uint32_t crc, const unsigned char *p, size_t len) {
    uint64_t c = (uint32_t)~crc;
    while (len && ((uintptr_t)p & 7)) {
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
        len--;
    }
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
