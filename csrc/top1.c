/* top1.c: see top1.h. */
#include <stdlib.h>
#include "top1.h"
#include "status.h"

/* 1 when row i sorts strictly before row r in the order of design note 2 */
static inline int before(const DbspBatch *b, int64_t i, int64_t r, const int32_t *ocols, const uint8_t *desc,
                         int32_t nord) {
    for (int32_t k = 0; k < nord; k++) {
        const DbspColumn *c = &b->cols[ocols[k]];
        int vi = dbsp_col_valid(c, i), vr = dbsp_col_valid(c, r);
        if (vi != vr) return vi;  /* nulls last */
        if (!vi) continue;
        int x = dbsp_value_cmp(c, i, c, r);
        if (desc[k]) x = -x;
        if (x) return x < 0;
    }
    return 0;
}

int dbsp_top1(const DbspBatch *b, const uint64_t *kh, const int32_t *keys, int32_t nkeys, const int32_t *ocols,
              const uint8_t *desc, int32_t nord, int64_t *best, int64_t *ngroups) {
    int64_t n = b->nrows, ng = 0;
    *ngroups = 0;
    if (n == 0) return DBSP_OK;
    uint64_t cap = 16;
    while (cap < (uint64_t)n * 2) cap <<= 1;
    uint64_t mask = cap - 1;
    int64_t *slot = malloc(cap * sizeof(int64_t));
    if (slot == NULL) return DBSP_ENOMEM;
    memset(slot, 0xff, cap * sizeof(int64_t));  /* -1: empty */
    for (int64_t i = 0; i < n; i++) {
        uint64_t h = kh[i], s = (h ^ (h >> 29)) & mask;
        for (;;) {
            int64_t g = slot[s];
            if (g < 0) {
                slot[s] = ng;
                best[ng++] = i;
                break;
            }
            int64_t r = best[g];
            if (kh[r] == h) {
                if (dbsp_row_cmp_eqfast(b, i, keys, b, r, keys, nkeys) != 0) {
                    free(slot);
                    *ngroups = -1;
                    return DBSP_OK;
                }
                if (before(b, i, r, ocols, desc, nord)) best[g] = i;
                break;
            }
            s = (s + 1) & mask;
        }
    }
    free(slot);
    *ngroups = ng;
    return DBSP_OK;
}
