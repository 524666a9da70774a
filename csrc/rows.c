/* rows.c: the growable DbspRows of rows.h (free, reserve), below every kernel that fills one. */
#include <stdlib.h>
#include <string.h>
#include "rows.h"
#include "scratch.h"

void dbsp_rows_free(DbspRows *r) {
    free(r->idx);
    free(r->weights);
    free(r->khash);
    memset(r, 0, sizeof *r);
}

int dbsp_rows_reserve(DbspRows *r, int64_t extra) {
    if (r->n + extra <= r->cap) return DBSP_OK;
    int64_t cap = r->cap ? r->cap : 64;
    while (cap < r->n + extra) cap *= 2;
    if ((size_t)cap * 8 >= ((size_t)2 << 20)) {  /* large: fresh huge-page buffers (scratch.h), copied over */
        void *a[3] = { r->idx, r->weights, r->khash }, *fresh[3];
        for (int k = 0; k < 3; k++) {
            if (!(fresh[k] = dbsp_alloc_result((size_t)cap * 8))) {
                for (int j = 0; j < k; j++) free(fresh[j]);
                return DBSP_ENOMEM;
            }
            if (r->n) memcpy(fresh[k], a[k], (size_t)r->n * 8);
        }
        for (int k = 0; k < 3; k++) free(a[k]);
        r->idx = fresh[0]; r->weights = fresh[1]; r->khash = fresh[2];
        r->cap = cap;
        return DBSP_OK;
    }
    int64_t *i2 = realloc(r->idx, (size_t)cap * 8);
    if (!i2) return DBSP_ENOMEM;
    r->idx = i2;
    int64_t *w2 = realloc(r->weights, (size_t)cap * 8);
    if (!w2) return DBSP_ENOMEM;
    r->weights = w2;
    uint64_t *k2 = realloc(r->khash, (size_t)cap * 8);
    if (!k2) return DBSP_ENOMEM;
    r->khash = k2;
    r->cap = cap;
    return DBSP_OK;
}
