/* lookup.c: galloping lookups of a change's key hashes in a sorted batch (row numbers, or matching weights). */
#include <stdlib.h>
#include "lookup.h"
#include "join.h"
#include "rows.h"
#include "status.h"

int dbsp_lookup(const uint64_t *kh, int64_t n, const uint64_t *want, int64_t nwant, int64_t **idx, int64_t *nidx) {
    *idx = NULL;
    *nidx = 0;
    for (int64_t q = 1; q < nwant; q++)
        if (want[q] < want[q - 1]) return DBSP_EINVAL;
    int64_t cap = 0, m = 0, j = 0;
    int64_t *out = NULL;
    for (int64_t q = 0; q < nwant && j < n; q++) {
        uint64_t h = want[q];
        if (q > 0 && h == want[q - 1]) continue;
        j = dbsp_gallop(kh, j, n, h);
        while (j < n && kh[j] == h) {
            if (m == cap) {
                int64_t c = cap ? cap * 2 : (nwant < 64 ? 64 : nwant);
                int64_t *o2 = realloc(out, (size_t)c * 8);
                if (!o2) { free(out); return DBSP_ENOMEM; }
                out = o2; cap = c;
            }
            out[m++] = j++;
        }
    }
    *idx = out;
    *nidx = m;
    return DBSP_OK;
}

int dbsp_match_weights(const DbspBatch *a, const uint64_t *akh, const DbspBatch *b, const uint64_t *bkh,
                       int64_t *acc) {
    if (a->ncols != b->ncols) return DBSP_ETYPE;
    for (int32_t c = 0; c < a->ncols; c++)
        if (dbsp_type_class(a->cols[c].type) != dbsp_type_class(b->cols[c].type)) return DBSP_ETYPE;
    int64_t na = a->nrows, nb = b->nrows, i = 0, j = 0;
    while (i < na && j < nb) {
        uint64_t h = akh[i];
        int64_t ie = i + 1;
        while (ie < na && akh[ie] == h) ie++;
        j = dbsp_gallop(bkh, j, nb, h);
        int64_t je = j;
        while (je < nb && bkh[je] == h) je++;
        for (int64_t x = i; x < ie && je > j; x++)
            for (int64_t y = j; y < je; y++)
                if (dbsp_row_cmp(a, x, NULL, b, y, NULL, a->ncols) == 0) {
                    if (dbsp_add_weight(&acc[x], b->weights ? b->weights[y] : 1)) return DBSP_EOVERFLOW;
                    break;  /* b is consolidated: at most one equal row */
                }
        i = ie;
        j = je;
    }
    return DBSP_OK;
}
