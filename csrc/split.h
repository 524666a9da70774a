/* split.h: the parts of strings split at a literal separator (SQL SPLIT_INDEX), into caller-allocated Arrow buffers.
 *
 * Invariants (the kernel enforces them; tests/c/kernels_test.c and tests/core/test_expr_kernels.py check them against
 * naive models):
 *  1. A string is split at every occurrence of `sep` found scanning left to right, each match starting after the
 *     previous one ends (non-overlapping, as Arrow's split_pattern): s = p0 sep p1 sep ... pm, m >= 0 matches.
 *     Part i is p_i when i <= m, else null; a null string gives null parts; "" has the one part "".
 *  2. The result of part idx[j] is a utf8/binary array of the input's type (int32 offsets), no part of it longer
 *     than its string, so it fits wherever the input did.
 */
#ifndef DBSP_SPLIT_H
#define DBSP_SPLIT_H

#include <stdint.h>
#include "column.h"

/* Locate parts idx[0..k) (each >= 0) of the n rows of utf8/binary column c split at sep (seplen >= 1 bytes):
 * start[j * n + i] receives the byte position in c->data of part idx[j] of row i, offsets[j] (n + 1 int32) the
 * output offsets of part j, validity[j] (ceil(n / 8) bytes) its validity bits, null_count[j] its nulls and
 * bytes[j] its total byte count. Errors: DBSP_ETYPE unless c is utf8 or binary, DBSP_EINVAL if seplen < 1, k < 1
 * or an index is negative. */
int dbsp_split_locate(const DbspColumn *c, int64_t n, const uint8_t *sep, int64_t seplen, const int64_t *idx,
                      int32_t k, int64_t *start, int32_t *const *offsets, uint8_t *const *validity,
                      int64_t *null_count, int64_t *bytes);

/* Copy part j's located bytes (start + j * n and offsets[j] as dbsp_split_locate wrote them) into data (bytes[j]
 * bytes). */
int dbsp_split_copy(const DbspColumn *c, int64_t n, const int64_t *start, const int32_t *offsets, uint8_t *data);

#endif
