/* gather.h: the rows of a column at an index array, into caller-allocated Arrow buffers (Arrow's take, prefetching). */
#ifndef DBSP_GATHER_H
#define DBSP_GATHER_H

#include <stdint.h>
#include "column.h"

/* DBSP_OK if every idx[0..m) is in 0..n-1, else DBSP_EINVAL. */
int dbsp_gather_check(const int64_t *idx, int64_t m, int64_t n);

/* Gather rows idx[0..m) (checked) of column c. `validity` (ceil(m / 8) bytes) receives the validity bits when c
 * has a validity bitmap (it may be NULL otherwise) and *null_count the number of nulls gathered. `values`
 * receives the fixed-width values (m * width bytes), the bool bitmap (ceil(m / 8) bytes) or, for variable width,
 * the m + 1 output offsets (int32; int64 for the large types); then `src` (m int64) receives each row's source
 * byte offset and *data_bytes the byte count that dbsp_gather_data copies (0 for fixed width; `src` may then be
 * NULL). Errors: DBSP_ETOOBIG if a utf8/binary result passes 2^31-1 bytes, DBSP_ETYPE. */
int dbsp_gather_column(const DbspColumn *c, const int64_t *idx, int64_t m, uint8_t *validity, void *values,
                       int64_t *src, int64_t *null_count, int64_t *data_bytes);

/* The bytes of the m rows of variable-width column c (nrows rows) that dbsp_gather_column located (`offsets` and
 * `src` as it wrote them) into `data`, which has room for *data_bytes + 16 bytes (short values are copied 16
 * bytes at a time). */
int dbsp_gather_data(const DbspColumn *c, int64_t nrows, int64_t m, const void *offsets, const int64_t *src,
                     uint8_t *data);

/* dbsp_gather_column for one part of a gather from several batches into one output (the parts in turn, `at` the
 * rows the parts before wrote): the rows go from output row `at` on, validity and bool bits from bit `at` (the
 * bits before it kept; a column without validity gives set bits when `validity` is given, as the output has a
 * bitmap if any part does), fixed-width values from value `at`, variable-width offsets values[at .. at + m] =
 * `base` (the bytes the parts before wrote) + the running byte count, and src[at .. at + m); *data_bytes is this
 * part's bytes. Then dbsp_gather_data(c, nrows, m, offsets + at, src + at, data) copies them: the offsets are
 * absolute, so the parts are copied in turn into one buffer (a short value's 16-byte move may pass its row's end
 * into the next part's bytes, which that part writes afterwards). Errors as dbsp_gather_column (DBSP_ETOOBIG on
 * base + bytes). */
int dbsp_gather_column_at(const DbspColumn *c, const int64_t *idx, int64_t m, int64_t at, int64_t base,
                          uint8_t *validity, void *values, int64_t *src, int64_t *null_count, int64_t *data_bytes);

#endif
