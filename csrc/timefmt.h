/* timefmt.h: time values formatted as strings by a format of fixed-width fields (SQL DATE_FORMAT's common forms), into caller-allocated Arrow buffers.
 *
 * Invariants (the kernel enforces them; tests/c/kernels_test.c and tests/core/test_expr_kernels.py check them against
 * a civil-calendar model and Arrow's strftime):
 *  1. A format is literal bytes and the fields %Y (the year, 4 digits), %m, %d, %H, %M (2 digits, zero-padded) and
 *     %% (one '%'); any other field, or a lone '%' at its end, is DBSP_EINVAL. So every formatted value has the same
 *     length, dbsp_timefmt_width(format).
 *  2. Value v (int64, or int32 for a date32) is floor(v / units_per_day) days after 1970-01-01 in the proleptic
 *     Gregorian calendar, plus (v mod units_per_day) units of that day (units_per_day a multiple of 86400 for a
 *     time of day, or 1 for a date, which has no %H or %M: DBSP_EINVAL): negative values count back from the epoch,
 *     as Arrow's strftime does.
 *  3. A null row is null with an empty string. A non-null row whose year is outside [0, 9999] (its %Y is not 4
 *     digits) makes the call return DBSP_ETOOBIG, the output partly written: the caller formats those values
 *     another way.
 */
#ifndef DBSP_TIMEFMT_H
#define DBSP_TIMEFMT_H

#include <stdint.h>

/* The length of every value formatted by fmt (fmtlen bytes), or -1 when fmt breaks invariant 1. */
int64_t dbsp_timefmt_width(const uint8_t *fmt, int64_t fmtlen);

/* Format rows [0, n) of values (int64 when width == 8, int32 when width == 4, first row at values) whose validity
 * bitmap is validity (bit offset vbit; NULL: no nulls): offsets receives n + 1 int32 offsets from 0, data the bytes
 * (at most n * dbsp_timefmt_width bytes). Errors: DBSP_EINVAL (a bad format, units_per_day < 1, a time field with
 * units_per_day not a multiple of 86400, width not 4 or 8, or n * width over INT32_MAX), DBSP_ETOOBIG (invariant 3). */
int dbsp_timefmt(const void *values, int width, const uint8_t *validity, int64_t vbit, int64_t n,
                 int64_t units_per_day, const uint8_t *fmt, int64_t fmtlen, int32_t *offsets, uint8_t *data);

#endif
