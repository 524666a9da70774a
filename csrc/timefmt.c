/* timefmt.c: time values formatted by fixed-width fields (timefmt.h), one pass, no per-row allocation. */
#include "timefmt.h"
#include "status.h"

#include <string.h>
#include <stdint.h>

int64_t dbsp_timefmt_width(const uint8_t *fmt, int64_t fmtlen) {
    int64_t w = 0;
    for (int64_t i = 0; i < fmtlen; i++) {
        if (fmt[i] != '%') {
            w++;
            continue;
        }
        if (++i == fmtlen)
            return -1;
        switch (fmt[i]) {
        case 'Y': w += 4; break;
        case 'm': case 'd': case 'H': case 'M': w += 2; break;
        case '%': w += 1; break;
        default: return -1;
        }
    }
    return w;
}

/* the civil date of days since 1970-01-01 (H. Hinnant's days_from_civil inverse, exact for every int64 day count
 * reached by an int64 value over units_per_day >= 1 divided down to |days| < 2^63 / 1; callers' values fit) */
static void civil(int64_t days, int64_t *y, int *m, int *d) {
    int64_t z = days + 719468;
    int64_t era = (z >= 0 ? z : z - 146096) / 146097;
    int64_t doe = z - era * 146097;
    int64_t yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    int64_t doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    int64_t mp = (5 * doy + 2) / 153;
    *d = (int)(doy - (153 * mp + 2) / 5 + 1);
    *m = (int)(mp < 10 ? mp + 3 : mp - 9);
    *y = yoe + era * 400 + (*m <= 2);
}

static inline void two(uint8_t *o, int v) {
    o[0] = (uint8_t)('0' + v / 10);
    o[1] = (uint8_t)('0' + v % 10);
}

/* a format compiled once per call: every value's string is tmpl (the literal bytes, fields as '0') with its fields
 * written at their positions */
typedef struct {
    int64_t w;
    uint8_t tmpl[256];
    int nf;
    struct { int pos; char kind; } f[128];
} Compiled;

/* the rows' loop, inlined for each constant units_per_day so its divisions are multiplications; consecutive values
 * of one day (event-time order) convert their day once */
static inline __attribute__((always_inline)) int rows(const Compiled *c, const void *values, int width,
                                                       const uint8_t *validity, int64_t vbit, int64_t n,
                                                       const int64_t upd, int32_t *offsets, uint8_t *data) {
    const int64_t *v64 = (const int64_t *)values;
    const int32_t *v32 = (const int32_t *)values;
    int64_t per_min = upd % 86400 ? 1 : upd / 1440, last = INT64_MIN, y = 0;
    int m = 0, d = 0;
    uint8_t *o = data;
    offsets[0] = 0;
    for (int64_t r = 0; r < n; r++) {
        int64_t b = vbit + r;
        if (validity && !((validity[b >> 3] >> (b & 7)) & 1)) {
            offsets[r + 1] = (int32_t)(o - data);
            continue;
        }
        int64_t v = width == 8 ? v64[r] : (int64_t)v32[r];
        int64_t days = v / upd, rem = v % upd;
        if (rem < 0) {
            days--;
            rem += upd;
        }
        if (days != last) {
            civil(days, &y, &m, &d);
            if (y < 0 || y > 9999)
                return DBSP_ETOOBIG;
            last = days;
        }
        int64_t minute = rem / per_min;  /* minutes of the day (read only by %H and %M) */
        memcpy(o, c->tmpl, (size_t)c->w);
        for (int k = 0; k < c->nf; k++) {
            uint8_t *at = o + c->f[k].pos;
            switch (c->f[k].kind) {
            case 'Y': two(at, (int)(y / 100)); two(at + 2, (int)(y % 100)); break;
            case 'm': two(at, m); break;
            case 'd': two(at, d); break;
            case 'H': two(at, (int)(minute / 60)); break;
            default: two(at, (int)(minute % 60)); break;
            }
        }
        o += c->w;
        offsets[r + 1] = (int32_t)(o - data);
    }
    return DBSP_OK;
}

int dbsp_timefmt(const void *values, int width, const uint8_t *validity, int64_t vbit, int64_t n,
                 int64_t units_per_day, const uint8_t *fmt, int64_t fmtlen, int32_t *offsets, uint8_t *data) {
    int64_t w = dbsp_timefmt_width(fmt, fmtlen);
    if (w < 0 || units_per_day < 1 || (width != 4 && width != 8) || n < 0 || (w && n > INT32_MAX / w))
        return DBSP_EINVAL;
    Compiled c;
    if (w > (int64_t)sizeof c.tmpl || fmtlen > 256)
        return DBSP_EINVAL;
    c.w = w;
    c.nf = 0;
    int clock = 0;  /* does the format read the time of day */
    int64_t at = 0;
    for (int64_t i = 0; i < fmtlen; i++) {
        if (fmt[i] != '%') {
            c.tmpl[at++] = fmt[i];
            continue;
        }
        char k = (char)fmt[++i];
        if (k == '%') {
            c.tmpl[at++] = '%';
            continue;
        }
        clock |= k == 'H' || k == 'M';
        c.f[c.nf].pos = (int)at;
        c.f[c.nf++].kind = k;
        int fw = k == 'Y' ? 4 : 2;
        memset(c.tmpl + at, '0', (size_t)fw);
        at += fw;
    }
    if (clock && units_per_day % 86400)
        return DBSP_EINVAL;
    switch (units_per_day) {
    case 1: return rows(&c, values, width, validity, vbit, n, 1, offsets, data);
    case 86400LL: return rows(&c, values, width, validity, vbit, n, 86400LL, offsets, data);
    case 86400000LL: return rows(&c, values, width, validity, vbit, n, 86400000LL, offsets, data);
    case 86400000000LL: return rows(&c, values, width, validity, vbit, n, 86400000000LL, offsets, data);
    case 86400000000000LL: return rows(&c, values, width, validity, vbit, n, 86400000000000LL, offsets, data);
    default: return rows(&c, values, width, validity, vbit, n, units_per_day, offsets, data);
    }
}
