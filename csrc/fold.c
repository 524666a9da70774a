/* fold.c: the linear aggregate's step kernel (see fold.h): one pass over the changed groups instead of a dozen array operations. */
#include <string.h>
#include "fold.h"
#include "hash.h"
#include "status.h"

/* the row hash of (key columns, slots) from the key hash: one more non-null int64 column per slot (hash.h) */
static inline __attribute__((always_inline)) uint64_t extend(uint64_t h, const int64_t *v, int32_t ns, int64_t stride) {
    for (int32_t j = 0; j < ns; j++)
        h = dbsp_mix(h * DBSP_HASH_K_GOLD + dbsp_mix((uint64_t)v[j * stride] ^ DBSP_HASH_S_INT));
    return h;
}

/* The fold for ns slots; always inlined, so that each constant ns below gets its own copy with its slot loops unrolled
 * (a 1k-row count step spent ~225 instructions a group in the loops' control with ns read at run time). */
static inline __attribute__((always_inline)) int fold(int64_t ng, const int32_t ns, const int64_t *old,
                                                      const int64_t *delta, const uint64_t *khash, int64_t *grp,
                                                      int64_t *w, uint64_t *kh, int64_t *vals, int64_t *n,
                                                      int *ordered, uint64_t *rh, const int canon) {
    const int64_t cap = 2 * ng;
    int64_t k = 0;
    int in_order = 1, have_prev = 0;
    uint64_t prev = 0;
    *n = 0;
    /* new totals first, into the rows' final place: overflow is checked before anything is emitted */
    for (int64_t g = 0; g < ng; g++)
        for (int32_t j = 0; j < ns; j++) {
            int64_t s;
            if (__builtin_add_overflow(old[g * ns + j], delta[g * ns + j], &s)) return DBSP_EOVERFLOW;
        }
    for (int64_t g = 0; g < ng; g++) {
        const int64_t *o = old + g * ns, *d = delta + g * ns;
        int changed = 0;
        for (int32_t j = 0; j < ns; j++) changed |= d[j] != 0;
        if (!changed) continue;
        int add = o[0] + d[0] != 0, sub = o[0] != 0;
        if (!add && !sub) continue;
        if (have_prev && khash[g] == prev) in_order = 0;
        have_prev = 1;
        prev = khash[g];
        int64_t ka = -1, ks = -1;
        if (add) {
            ka = k++;
            for (int32_t j = 0; j < ns; j++) vals[j * cap + ka] = o[j] + d[j];
            grp[ka] = g; w[ka] = 1; kh[ka] = khash[g];
        }
        if (sub) {
            ks = k++;
            for (int32_t j = 0; j < ns; j++) vals[j * cap + ks] = o[j];
            grp[ks] = g; w[ks] = -1; kh[ks] = khash[g];
        }
        if (!canon) continue;  /* key-hash order only (fold.h): the new row first, no row hash */
        if (add && sub) {  /* the group's two rows by row hash */
            uint64_t ra = extend(khash[g], vals + ka, ns, cap), rs = extend(khash[g], vals + ks, ns, cap);
            if (ra == rs) in_order = 0;
            else if (rs < ra) {  /* swap: the old row first */
                for (int32_t j = 0; j < ns; j++) {
                    int64_t t = vals[j * cap + ka];
                    vals[j * cap + ka] = vals[j * cap + ks];
                    vals[j * cap + ks] = t;
                }
                w[ka] = -1; w[ks] = 1;
                uint64_t t = ra; ra = rs; rs = t;
            }
            if (rh) rh[ka] = ra, rh[ks] = rs;
        } else if (rh) {
            int64_t kk = add ? ka : ks;
            rh[kk] = extend(khash[g], vals + kk, ns, cap);
        }
    }
    *n = k;
    *ordered = in_order;
    return DBSP_OK;
}

int dbsp_linear_fold2(int64_t ng, int32_t ns, const int64_t *old, const int64_t *delta, const uint64_t *khash,
                      int64_t *grp, int64_t *w, uint64_t *kh, int64_t *vals, int64_t *n, int *ordered, uint64_t *rh,
                      int canon) {
    canon = canon || rh;
    switch (ns) {  /* a copy per common slot count (count; count+sum; a sum or avg with its non-null count ...) */
    case 1: return fold(ng, 1, old, delta, khash, grp, w, kh, vals, n, ordered, rh, canon);
    case 2: return fold(ng, 2, old, delta, khash, grp, w, kh, vals, n, ordered, rh, canon);
    case 3: return fold(ng, 3, old, delta, khash, grp, w, kh, vals, n, ordered, rh, canon);
    case 4: return fold(ng, 4, old, delta, khash, grp, w, kh, vals, n, ordered, rh, canon);
    default: return fold(ng, ns, old, delta, khash, grp, w, kh, vals, n, ordered, rh, canon);
    }
}

int dbsp_linear_fold(int64_t ng, int32_t ns, const int64_t *old, const int64_t *delta, const uint64_t *khash,
                     int64_t *grp, int64_t *w, uint64_t *kh, int64_t *vals, int64_t *n, int *ordered, uint64_t *rh) {
    return dbsp_linear_fold2(ng, ns, old, delta, khash, grp, w, kh, vals, n, ordered, rh, 1);
}
