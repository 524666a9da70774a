/* extremes.c: the min/max aggregate's step kernel (extremes.h). */
#include <stdlib.h>
#include <string.h>
#include "extremes.h"
#include "lookup.h"
#include "reduce.h"
#include "status.h"

static inline int64_t ival(const DbspColumn *c, int64_t r) {
    return c->type == DBSP_INT64 ? ((const int64_t *)c->values)[c->offset + r] : (int64_t)dbsp_col_u64(c, r);
}

static int holdable(int32_t t) {
    int cls = dbsp_type_class(t);
    return (cls == DBSP_CLASS_SIGNED || cls == DBSP_CLASS_UNSIGNED) && t != DBSP_UINT64;
}

/* The slots' check: each a count, sum, min or max over a column the totals can hold; *ne: how many are min/max */
static int check_slots(const DbspBatch *b, const DbspAggSpec *slots, int32_t ns, int32_t *ne) {
    *ne = 0;
    for (int32_t j = 0; j < ns; j++) {
        int32_t k = slots[j].kind;
        if (k < DBSP_AGG_COUNT || k > DBSP_AGG_MAX) return DBSP_EINVAL;
        if (k == DBSP_AGG_COUNT) continue;
        if (slots[j].col < 0 || slots[j].col >= b->ncols) return DBSP_EINVAL;
        if (!holdable(b->cols[slots[j].col].type)) return DBSP_ETYPE;
        *ne += k == DBSP_AGG_MIN || k == DBSP_AGG_MAX;
    }
    return DBSP_OK;
}

int dbsp_extremes_probe(const DbspKeyIndex *ix, const DbspBatch *b, const uint64_t *kh, const int32_t *keys,
                        int32_t nkeys, const DbspAggSpec *slots, int32_t ns, int64_t *group_row, uint64_t *gkh,
                        int64_t *old, int64_t *nw, uint8_t *need, int64_t *ng) {
    int32_t ne;
    int cs = check_slots(b, slots, ns, &ne);
    if (cs != DBSP_OK) return cs;
    const int32_t V = ns + ne;
    int64_t n = b->nrows, g = 0;
    *ng = 0;
    for (int64_t i = 0; i < n;) { /* the groups: runs of equal keys (design note 3) */
        int64_t j = i + 1;
        while (j < n && kh[j] == kh[i] && dbsp_row_cmp_eqfast(b, i, keys, b, j, keys, nkeys) == 0) j++;
        group_row[g] = i;
        gkh[g] = kh[i];
        g++;
        i = j;
    }
    memset(old, 0, (size_t)(g * V) * 8);
    int st = dbsp_keyindex_get(ix, b, keys, group_row, gkh, g, old);
    if (st != DBSP_OK) return st;
    for (int64_t x = 0; x < g; x++) {
        int64_t lo = group_row[x], hi = x + 1 < g ? group_row[x + 1] : n;
        const int64_t *o = old + x * V;
        int64_t *nv = nw + x * V;
        need[x] = 0;
        for (int32_t j = 0, e = 0; j < ns; j++) {
            int32_t k = slots[j].kind;
            const DbspColumn *c = k == DBSP_AGG_COUNT ? NULL : &b->cols[slots[j].col];
            if (k == DBSP_AGG_MIN || k == DBSP_AGG_MAX) {
                int is_min = k == DBSP_AGG_MIN, has_ins = 0, has_del = 0;
                int64_t ins = 0, del = 0;
                for (int64_t r = lo; r < hi; r++) {
                    int64_t w = b->weights ? b->weights[r] : 1;
                    if (w == 0 || !dbsp_col_valid(c, r)) continue;
                    int64_t v = ival(c, r);
                    if (w > 0) {
                        if (!has_ins || (is_min ? v < ins : v > ins)) ins = v;
                        has_ins = 1;
                    } else {
                        if (!has_del || (is_min ? v < del : v > del)) del = v;
                        has_del = 1;
                    }
                }
                int64_t valid = o[ns + e]; /* 1 while the old extreme is not null (design note 1) */
                nv[j] = o[j], nv[ns + e] = valid;
                if (has_del && (!valid || (is_min ? del <= o[j] : del >= o[j]))) {
                    need[x] = 1; /* a deleted value reached the extreme: the caller recomputes it */
                } else if (has_ins && (!valid || (is_min ? ins < o[j] : ins > o[j]))) {
                    nv[j] = ins, nv[ns + e] = 1;
                }
                e++;
                continue;
            }
            int64_t d = 0;
            for (int64_t r = lo; r < hi; r++) {
                int64_t w = b->weights ? b->weights[r] : 1, p;
                if (k == DBSP_AGG_COUNT) p = w;
                else if (!dbsp_col_valid(c, r)) continue;
                else if (k == DBSP_AGG_COUNT_COL) p = w;
                else if (__builtin_mul_overflow(ival(c, r), w, &p)) return DBSP_EOVERFLOW;
                if (__builtin_add_overflow(d, p, &d)) return DBSP_EOVERFLOW;
            }
            if (__builtin_add_overflow(o[j], d, &nv[j])) return DBSP_EOVERFLOW;
        }
    }
    *ng = g;
    return DBSP_OK;
}

int dbsp_extremes_probe_inserts(const DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, int32_t nkeys,
                                const DbspAggSpec *slots, int32_t ns, int64_t **group_row, uint64_t **gkh,
                                int64_t **old, int64_t **nw, int64_t *ng) {
    *group_row = NULL, *gkh = NULL, *old = NULL, *nw = NULL, *ng = 0;
    int32_t ne;
    int cs = check_slots(b, slots, ns, &ne);
    if (cs != DBSP_OK) return cs;
    if (b->weights)
        for (int64_t i = 0; i < b->nrows; i++)
            if (b->weights[i] < 0) return DBSP_EINVAL; /* a deletion: dbsp_extremes_probe's recompute rule */
    const int32_t V = ns + ne;
    DbspReduceOut r;
    memset(&r, 0, sizeof r);
    int st = dbsp_group_reduce_all(b, keys, nkeys, slots, ns, &r);
    if (st != DBSP_OK) {
        dbsp_reduce_free(&r);
        return st;
    }
    int64_t g = r.ngroups;
    int64_t *o = calloc((size_t)(g ? g : 1) * (size_t)V, 8), *x = malloc((size_t)(g ? g : 1) * (size_t)V * 8);
    if (!o || !x) st = DBSP_ENOMEM;
    if (st == DBSP_OK && g) st = dbsp_keyindex_get(ix, b, keys, r.group_row, (const uint64_t *)r.khash, g, o);
    for (int64_t q = 0; st == DBSP_OK && q < g; q++) {
        const int64_t *ov = o + q * V, *iv = r.ivals + q * ns;
        const uint8_t *va = r.valid + q * ns;
        int64_t *nv = x + q * V;
        for (int32_t j = 0, e = 0; j < ns; j++) {
            int32_t k = slots[j].kind;
            if (k == DBSP_AGG_MIN || k == DBSP_AGG_MAX) { /* the extreme of the old one and the inserted values */
                int64_t valid = ov[ns + e];
                nv[j] = ov[j], nv[ns + e] = valid;
                if (va[j]) {
                    int64_t v = ival(&b->cols[slots[j].col], iv[j]); /* iv[j]: the row holding it (reduce.h) */
                    if (!valid || (k == DBSP_AGG_MIN ? v < ov[j] : v > ov[j])) nv[j] = v, nv[ns + e] = 1;
                }
                e++;
            } else if (__builtin_add_overflow(ov[j], va[j] || k != DBSP_AGG_SUM ? iv[j] : 0, &nv[j])) {
                st = DBSP_EOVERFLOW;
                break;
            }
        }
    }
    if (st == DBSP_OK) {
        *group_row = r.group_row, *gkh = (uint64_t *)r.khash, *old = o, *nw = x, *ng = g;
        r.group_row = NULL, r.khash = NULL;
    } else {
        free(o);
        free(x);
    }
    dbsp_reduce_free(&r);
    return st;
}

int dbsp_extremes_store(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, int64_t ng, int32_t nv,
                        const int64_t *group_row, const uint64_t *gkh, const int64_t *old, const int64_t *nw,
                        int64_t *grp, int64_t *w, int64_t *n) {
    int64_t k = 0;
    *n = 0;
    for (int64_t g = 0; g < ng; g++) {
        const int64_t *o = old + g * nv, *x = nw + g * nv;
        if (memcmp(o, x, (size_t)nv * 8) == 0) continue;
        if (o[0] != 0) grp[k] = g, w[k] = -1, k++;
        if (x[0] != 0) grp[k] = g, w[k] = 1, k++;
        int st = dbsp_keyindex_put(ix, b, keys, group_row[g], gkh[g], x[0] != 0 ? x : NULL, 1, ng);
        if (st != DBSP_OK) return st;
    }
    *n = k;
    return DBSP_OK;
}

typedef struct { int64_t v, w; } ValW;

static int valw_cmp(const void *a, const void *b) {
    int64_t x = ((const ValW *)a)->v, y = ((const ValW *)b)->v;
    return (x > y) - (x < y);
}

int dbsp_extremes_scan(const DbspBatch *b, const int32_t *keys, int32_t nkeys, const int64_t *rows, const uint64_t *kh,
                       int64_t n, const DbspBatch *const *vb, const uint64_t *const *vkh, int32_t nb,
                       const int32_t *vkeys, int32_t vcol, uint8_t *has, int64_t *mn, int64_t *mx) {
    for (int32_t k = 0; k < nb; k++) {
        if (vcol < 0 || vcol >= vb[k]->ncols || !holdable(vb[k]->cols[vcol].type)) return DBSP_ETYPE;
        for (int32_t j = 0; j < nkeys; j++)
            if (vkeys[j] < 0 || vkeys[j] >= vb[k]->ncols) return DBSP_EINVAL;
    }
    int64_t cap = 64, m;
    ValW *buf = malloc((size_t)cap * sizeof *buf);
    int64_t *at = calloc((size_t)(nb ? nb : 1), sizeof *at);  /* per batch: where the last seek ended (kh ascend) */
    if (!buf || !at) { free(buf); free(at); return DBSP_ENOMEM; }
    int st = DBSP_OK;
    for (int64_t i = 0; i < n && st == DBSP_OK; i++) {
        if (rows[i] < 0 || rows[i] >= b->nrows) { st = DBSP_EINVAL; break; }
        m = 0;
        for (int32_t k = 0; k < nb; k++) {  /* the key's rows of every batch, with their weights */
            const DbspBatch *v = vb[k];
            int64_t lo = dbsp_gallop(vkh[k], i && kh[i] >= kh[i - 1] ? at[k] : 0, v->nrows, kh[i]);
            at[k] = lo;
            for (int64_t r = lo; r < v->nrows && vkh[k][r] == kh[i]; r++) {
                if (dbsp_row_cmp_eqfast(b, rows[i], keys, v, r, vkeys, nkeys) != 0) continue;  /* another key */
                const DbspColumn *c = &v->cols[vcol];
                if (!dbsp_col_valid(c, r)) continue;
                if (m == cap) {
                    ValW *g = realloc(buf, (size_t)(cap *= 2) * sizeof *buf);
                    if (!g) { st = DBSP_ENOMEM; break; }
                    buf = g;
                }
                buf[m].v = (int64_t)dbsp_col_u64(c, r);
                buf[m].w = v->weights ? v->weights[r] : 1;
                m++;
            }
        }
        if (m > 24) {  /* by value, equal values side by side: a group may hold many values */
            qsort(buf, (size_t)m, sizeof *buf, valw_cmp);
        } else {
            for (int64_t x = 1; x < m; x++) {
                ValW t = buf[x];
                int64_t y = x - 1;
                while (y >= 0 && buf[y].v > t.v) { buf[y + 1] = buf[y]; y--; }
                buf[y + 1] = t;
            }
        }
        has[i] = 0;
        for (int64_t x = 0; x < m;) {
            int64_t y = x, w = 0;
            while (y < m && buf[y].v == buf[x].v) {
                if (__builtin_add_overflow(w, buf[y].w, &w)) st = DBSP_EOVERFLOW;
                y++;
            }
            if (st != DBSP_OK) break;
            if (w > 0) {
                if (!has[i]) mn[i] = buf[x].v;
                mx[i] = buf[x].v;
                has[i] = 1;
            }
            x = y;
        }
    }
    free(buf);
    free(at);
    return st;
}
