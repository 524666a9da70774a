/* crc32c.h: CRC-32C (Castagnoli), by the SSE4.2 instruction or slicing-by-8, for every checksum the storage layer writes. */
#ifndef DBSP_CRC32C_H
#define DBSP_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Extends `crc` (0 for a fresh checksum) over `len` bytes of `data`; dbsp_crc32c(0, "123456789", 9) == 0xE3069283. */
uint32_t dbsp_crc32c(uint32_t crc, const void *data, size_t len);
/* The same checksum by slicing-by-8 only (what dbsp_crc32c uses on CPUs without SSE4.2; tests compare the two). */
uint32_t dbsp_crc32c_portable(uint32_t crc, const void *data, size_t len);

#endif
