/* crc32c.h: CRC-32C (Castagnoli), by the SSE4.2 instruction or slicing-by-8, for every checksum the storage layer writes. */
#ifndef DBSP_CRC32C_H
#define DBSP_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Extends `crc` (0 for a fresh checksum) over `len` bytes of `data`; dbsp_crc32c(0, "123456789", 9) == 0xE3069283. */
uint32_t dbsp_crc32c(uint32_t crc, const void *data, size_t len);
/* The same checksum by slicing-by-8 only (what dbsp_crc32c uses on CPUs without SSE4.2; tests compare the two). */
uint32_t dbsp_crc32c_portable(uint32_t crc, const void *data, size_t len);

/* The CRC-32C of A followed by B from crc_a of A, crc_b of B and len_b = |B| (zlib's crc32_combine for this
   polynomial): no byte is read. */
uint32_t dbsp_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);
/* The CRC-32C of each `page`-byte page of `len` bytes of `data` (the last may be short) into out[0..ceil(len/page)),
   one pass over the bytes; returns the CRC-32C of all of them continuing from `crc` (dbsp_crc32c(crc, data, len)),
   combined from the pages' (dbsp_crc32c_combine). */
uint32_t dbsp_crc32c_pages(uint32_t crc, const void *data, size_t len, size_t page, uint32_t *out);

#endif
