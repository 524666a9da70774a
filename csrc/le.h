/* le.h: reads and writes of 16/32/64-bit little-endian integers at any byte address, for the on-disk formats of
 * pagestore.c and steplog.c (memcpy, so unaligned addresses are fine; the build is little-endian only). */
#ifndef DBSP_LE_H
#define DBSP_LE_H

#include <stdint.h>
#include <string.h>

/* host order is the format's order: a big-endian build would read and write every integer byte-swapped */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "le.h needs a little-endian host");

static inline uint16_t rd16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t rd64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline void wr16(unsigned char *p, uint16_t v) { memcpy(p, &v, 2); }
static inline void wr32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void wr64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }

#endif
