/* extremes.c: the min/max aggregate's step kernel (extremes.h). */
#include <stdlib.h>
#include <string.h>
#include "extremes.h"
#include "hash.h"
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

int dbsp_extremes_probe(DbspKeyIndex *ix, const DbspBatch *b, const uint64_t *kh, const int32_t *keys,
                        int32_t nkeys, const DbspAggSpec *slots, int32_t ns, int64_t *group_row, uint64_t *gkh,
                        int64_t *old, int64_t *nw, uint8_t *need, int64_t *ng, int64_t **held) {
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
    int st = held ? dbsp_keyindex_get_slots(ix, b, keys, group_row, gkh, g, old, held)  /* design note 5 */
                  : dbsp_keyindex_get(ix, b, keys, group_row, gkh, g, old);
    if (st != DBSP_OK) return st;
    /* the fold, slot by slot over every group (design note 9): each slot's kind and column read once, not per group;
     * a min and a max of one column (the usual pair) in one pass over the rows */
    memset(need, 0, (size_t)g);
    const int64_t *wt = b->weights;
    int32_t *flag = malloc((size_t)(ns ? ns : 1) * sizeof *flag);  /* an extreme slot's "not null" value, else -1 */
    uint8_t *done = calloc((size_t)(ns ? ns : 1), 1);
    if (!flag || !done) { free(flag); free(done); return DBSP_ENOMEM; }
    for (int32_t j = 0, e = 0; j < ns; j++)
        flag[j] = slots[j].kind == DBSP_AGG_MIN || slots[j].kind == DBSP_AGG_MAX ? ns + e++ : -1;
    for (int32_t j = 0; j < ns; j++) {
        int32_t k = slots[j].kind;
        const DbspColumn *c = k == DBSP_AGG_COUNT ? NULL : &b->cols[slots[j].col];
        if (done[j]) continue;
        if (k == DBSP_AGG_MIN || k == DBSP_AGG_MAX) {
            /* slots a (the min) and z (the max) of this column: one of them may be absent (-1) */
            int32_t a = k == DBSP_AGG_MIN ? j : -1, z = k == DBSP_AGG_MAX ? j : -1;
            for (int32_t j2 = j + 1; j2 < ns; j2++) {
                int32_t k2 = slots[j2].kind;
                if (done[j2] || slots[j2].col != slots[j].col) continue;
                if (k2 == DBSP_AGG_MIN && a < 0) a = j2, done[j2] = 1;
                else if (k2 == DBSP_AGG_MAX && z < 0) z = j2, done[j2] = 1;
            }
            const int64_t *iv = c->type == DBSP_INT64 ? (const int64_t *)c->values + c->offset : NULL;
            const int fast = iv && !c->validity;
            for (int64_t x = 0; x < g; x++) {
                int64_t lo = group_row[x], hi = x + 1 < g ? group_row[x + 1] : n;
                int has_ins = 0, has_del = 0;
                int64_t imin = 0, imax = 0, dmin = 0, dmax = 0;  /* the inserted and the deleted values' extremes */
                for (int64_t r = lo; r < hi; r++) {
                    int64_t w = wt ? wt[r] : 1;
                    if (w == 0 || (!fast && !dbsp_col_valid(c, r))) continue;
                    int64_t v = iv ? iv[r] : ival(c, r);
                    if (w > 0) {
                        if (!has_ins || v < imin) imin = v;
                        if (!has_ins || v > imax) imax = v;
                        has_ins = 1;
                    } else {
                        if (!has_del || v < dmin) dmin = v;
                        if (!has_del || v > dmax) dmax = v;
                        has_del = 1;
                    }
                }
                const int64_t *o = old + x * V;
                int64_t *nv = nw + x * V;
                for (int side = 0; side < 2; side++) {
                    int32_t q = side == 0 ? a : z;
                    if (q < 0) continue;
                    int is_min = side == 0;
                    int64_t ins = is_min ? imin : imax, del = is_min ? dmin : dmax;
                    int64_t valid = o[flag[q]]; /* 1 while the old extreme is not null (design note 1) */
                    nv[q] = o[q], nv[flag[q]] = valid;
                    if (has_del && (!valid || (is_min ? del <= o[q] : del >= o[q]))) {
                        need[x] = 1; /* a deleted value reached the extreme: the caller recomputes it */
                    } else if (has_ins && (!valid || (is_min ? ins < o[q] : ins > o[q]))) {
                        nv[q] = ins, nv[flag[q]] = 1;
                    }
                }
            }
            continue;
        }
        for (int64_t x = 0; x < g; x++) {
            int64_t lo = group_row[x], hi = x + 1 < g ? group_row[x + 1] : n, d = 0;
            if (k == DBSP_AGG_COUNT && !wt) {
                d = hi - lo;
            } else {
                for (int64_t r = lo; r < hi; r++) {
                    int64_t w = wt ? wt[r] : 1, p;
                    if (k == DBSP_AGG_COUNT) p = w;
                    else if (!dbsp_col_valid(c, r)) continue;
                    else if (k == DBSP_AGG_COUNT_COL) p = w;
                    else if (__builtin_mul_overflow(ival(c, r), w, &p)) goto overflow;
                    if (__builtin_add_overflow(d, p, &d)) goto overflow;
                }
            }
            if (__builtin_add_overflow(old[x * V + j], d, &nw[x * V + j])) goto overflow;
        }
    }
    free(flag);
    free(done);
    *ng = g;
    return DBSP_OK;
overflow:
    free(flag);
    free(done);
    return DBSP_EOVERFLOW;
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

/* a row's values x (V of them) as one more column per slot after the key hash h (hash.h; a slot is null where
 * its flag snull[j] >= 0 is 0): the row hash of (key columns, slot columns) */
static inline uint64_t slots_hash(uint64_t h, const int64_t *x, int32_t ns, const int32_t *snull) {
    const uint64_t hnull = dbsp_mix(DBSP_HASH_NULL);
    for (int32_t j = 0; j < ns; j++) {
        uint64_t v = snull[j] >= 0 && x[snull[j]] == 0 ? hnull : dbsp_mix((uint64_t)x[j] ^ DBSP_HASH_S_INT);
        h = dbsp_mix(h * DBSP_HASH_K_GOLD + v);
    }
    return h;
}

/* values[0..m) narrowed in place to `width` bytes each (the low bytes: a value of a narrower column, sign- or
 * zero-extended, comes back as it was) */
static void narrow(int64_t *values, int64_t m, int32_t width) {
    if (width == 4) {
        int32_t *d = (int32_t *)values;
        for (int64_t i = 0; i < m; i++) d[i] = (int32_t)values[i];
    } else if (width == 2) {
        int16_t *d = (int16_t *)values;
        for (int64_t i = 0; i < m; i++) d[i] = (int16_t)values[i];
    } else if (width == 1) {
        int8_t *d = (int8_t *)values;
        for (int64_t i = 0; i < m; i++) d[i] = (int8_t)values[i];
    }
}

/* column k of an export: the values src[r * V + j] of rows r < m (their groups' rows of old or new totals), null
 * where the flag f >= 0 is 0; *vals and *valid malloc'ed (valid NULL when no null), *nulls counted */
static int column_of(const int64_t *const *src, int64_t m, int32_t j, int32_t f, int32_t width, int64_t **vals,
                     uint8_t **valid, int64_t *nulls) {
    int64_t *v = malloc((size_t)(m ? m : 1) * 8);
    if (!v) return DBSP_ENOMEM;
    int64_t z = 0;
    for (int64_t r = 0; r < m; r++) {
        v[r] = src[r][j];
        z += f >= 0 && src[r][f] == 0;
    }
    uint8_t *b = NULL;
    if (z) {
        if (!(b = calloc((size_t)(m + 7) / 8 + 1, 1))) { free(v); return DBSP_ENOMEM; }
        for (int64_t r = 0; r < m; r++)
            if (src[r][f] != 0) b[r >> 3] |= (uint8_t)(1u << (r & 7));
            else v[r] = 0;
    }
    narrow(v, m, width);
    *vals = v, *valid = b, *nulls = z;
    return DBSP_OK;
}

/* Design note 5: the changed groups' new values stored (chg[g]: whether group g's values changed, from emit_rows):
 * held ones that stay, in place; then new ones (the only stores that allocate; undone on a refusal); then removals
 * and, without held, the stores of groups already there (a put that finds its key writes in place: neither
 * allocates). A group is new when its old count (value 0) is 0. */
static int store(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, int32_t nv, int64_t ng,
                 const int64_t *group_row, const uint64_t *gkh, const int64_t *old, const int64_t *nw,
                 int64_t *const *held, const uint8_t *chg) {
#define CHANGED(g) (chg[g])
#define IS_NEW(g) (old[(g) * nv] == 0)
#define STAYS(g) (nw[(g) * nv] != 0)
    for (int64_t g = 0; held && g < ng; g++)
        if (held[g] && !IS_NEW(g) && STAYS(g) && CHANGED(g)) dbsp_keyindex_set_slot(ix, held[g], nw + g * nv, 1);
    for (int64_t g = 0; g < ng; g++) {
        if (!IS_NEW(g) || !STAYS(g)) continue;  /* (a new group that stays has changed: its count was 0) */
        int st = dbsp_keyindex_put(ix, b, keys, group_row[g], gkh[g], nw + g * nv, 1, ng);
        if (st == DBSP_OK) continue;
        if (st == DBSP_ENOMEM || st == DBSP_ETOOBIG) {  /* undone: the index as before the call */
            dbsp_keyindex_unbreak(ix);  /* (the refused put marked it; nothing of its key was written) */
            for (int64_t u = 0; u < ng; u++) {
                if (u < g && IS_NEW(u) && STAYS(u))  /* a removal: no allocation */
                    (void)dbsp_keyindex_put(ix, b, keys, group_row[u], gkh[u], NULL, 1, 0);
                else if (held && held[u] && !IS_NEW(u) && STAYS(u) && CHANGED(u))  /* found: in place */
                    (void)dbsp_keyindex_put(ix, b, keys, group_row[u], gkh[u], old + u * nv, 1, 0);
            }
            dbsp_keyindex_note_refusal(ix);
        }
        return st;
    }
    for (int64_t g = 0; g < ng; g++) {
        if (IS_NEW(g) || !CHANGED(g) || (held && held[g] && STAYS(g))) continue;
        int st = dbsp_keyindex_put(ix, b, keys, group_row[g], gkh[g], STAYS(g) ? nw + g * nv : NULL, 1, ng);
        if (st != DBSP_OK) return st;
    }
    return DBSP_OK;
#undef CHANGED
#undef IS_NEW
#undef STAYS
}

/* Design note 4: the rows a step emits, in group order, for each group whose new values differ from its old ones: a
 * row of its old totals (-1, when its old count is not 0) and one of its new totals (+1, when its new count is not
 * 0), the two in row-hash order (keyorder: old first, no row hash): src[r] (the row's values), rows[r] (its group's
 * row of b), w[r], kh[r], rh[r] (not with keyorder), *m rows; *ordered 0 on a key-hash or row-hash tie. With osrc,
 * the output's rows too (osrc, orows, ow; *k): those of the batch but a group's two rows showing the same output. */
static void emit_rows(int64_t ng, int32_t nv, int32_t ns, const int64_t *group_row, const uint64_t *gkh,
                      const int64_t *old, const int64_t *nw, const int32_t *snull, int32_t nout, const int32_t *shown,
                      const int32_t *nonnull, int keyorder, const int64_t **src, int64_t *rows, int64_t *w,
                      uint64_t *kh, uint64_t *rh, int64_t *m_out, int *ordered, const int64_t **osrc, int64_t *orows,
                      int64_t *ow, int64_t *k_out, uint8_t *chg) {
    int have_prev = 0;
    uint64_t prev = 0;
    int64_t m = 0, k = 0;
    *ordered = 1;
    for (int64_t g = 0; g < ng; g++) {  /* the rows, in canonical order: key hash, then row hash (keyorder: old first) */
        const int64_t *o = old + g * nv, *x = nw + g * nv;
        int changed = memcmp(o, x, (size_t)nv * 8) != 0;
        if (chg) chg[g] = (uint8_t)changed;
        if (!changed) continue;
        int sub = o[0] != 0, add = x[0] != 0;
        if (!sub && !add) continue;
        if (have_prev && gkh[g] == prev) *ordered = 0;
        have_prev = 1;
        prev = gkh[g];
        uint64_t ho = 0, hx = 0;
        int old_first = 1;
        if (!keyorder) {
            ho = sub ? slots_hash(gkh[g], o, ns, snull) : 0, hx = add ? slots_hash(gkh[g], x, ns, snull) : 0;
            old_first = !add || (sub && ho < hx);
            if (sub && add && ho == hx) *ordered = 0;
        }
        for (int t = 0; t < 2; t++) {
            int is_old = t == 0 ? old_first : !old_first;
            if (is_old ? !sub : !add) continue;
            src[m] = is_old ? o : x;
            rows[m] = group_row[g];
            w[m] = is_old ? -1 : 1;
            kh[m] = gkh[g];
            if (!keyorder) rh[m] = is_old ? ho : hx;
            m++;
        }
        if (!osrc) continue;
        int same = sub && add;  /* the output: a group's two rows cancel when they show the same */
        for (int32_t q = 0; same && q < nout; q++) {
            int f = nonnull[q];
            int na = f >= 0 && o[f] == 0, nb = f >= 0 && x[f] == 0;
            same = (na && nb) || (!na && !nb && o[shown[q]] == x[shown[q]]);
        }
        if (same) continue;
        for (int64_t r = m - (sub + add); r < m; r++) {
            osrc[k] = src[r];
            orows[k] = rows[r];
            ow[k] = w[r];
            k++;
        }
    }
    *m_out = m;
    if (k_out) *k_out = k;
}

/* The export of ncol columns (values ix[c] of src's rows, null where the flag f[c] >= 0 is 0, narrowed to width[c]
 * bytes) after the key columns of b at rows: the totals batch (ix = 0..ns, f = snull) or the output (ix = shown, f =
 * nonnull). Nothing is exported on an error. */
static int export_rows(const DbspBatch *b, const int32_t *keys, int32_t nkeys, const int64_t *const *src,
                       const int64_t *rows, int64_t m, int32_t ncol, const int32_t *ix, const int32_t *f,
                       const int32_t *width, struct ArrowArray *to) {
    int64_t *cols[128];
    uint8_t *valid[128];
    int64_t nulls[128];
    memset(cols, 0, sizeof cols);
    memset(valid, 0, sizeof valid);
    memset(nulls, 0, sizeof nulls);
    int st = DBSP_OK;
    for (int32_t c = 0; c < ncol && st == DBSP_OK; c++)
        st = column_of(src, m, ix ? ix[c] : c, f[c], width[c], &cols[c], &valid[c], &nulls[c]);
    if (st == DBSP_OK && (st = dbsp_cdata_gather_ints(b, keys, nkeys, rows, m, ncol, cols, valid, nulls, to)) == DBSP_OK)
        return DBSP_OK;  /* (the export owns the columns) */
    for (int32_t c = 0; c < ncol; c++) { free(cols[c]); free(valid[c]); }
    return st;
}

static int emit_check(int32_t ns, int32_t nv, const int32_t *snull, const int32_t *swidth, int32_t nout,
                      const int32_t *shown, const int32_t *nonnull, const int32_t *owidth) {
    if (ns < 1 || nout < 0 || ns + nout > 128 || nv < ns) return DBSP_EINVAL;
    for (int32_t j = 0; j < ns; j++)
        if (snull[j] >= nv || (swidth[j] != 1 && swidth[j] != 2 && swidth[j] != 4 && swidth[j] != 8))
            return DBSP_EINVAL;
    for (int32_t o = 0; o < nout; o++)
        if (shown[o] < 0 || shown[o] >= nv || nonnull[o] >= nv
            || (owidth[o] != 1 && owidth[o] != 2 && owidth[o] != 4 && owidth[o] != 8)) return DBSP_EINVAL;
    return DBSP_OK;
}

int dbsp_extremes_emit(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, int32_t nkeys, int32_t ns,
                       int32_t nv, int64_t ng, const int64_t *group_row, const uint64_t *gkh, const int64_t *old,
                       const int64_t *nw, const int32_t *snull, const int32_t *swidth, int32_t nout,
                       const int32_t *shown, const int32_t *nonnull, const int32_t *owidth,
                       struct ArrowArray *batch, struct ArrowArray *out, int64_t **w, uint64_t **kh, uint64_t **rh,
                       int64_t *n, int *ordered, int64_t **ow, int64_t *on, int64_t *const *held, int keyorder) {
    if (batch) batch->release = NULL;
    out->release = NULL;
    *w = NULL, *kh = NULL, *rh = NULL, *ow = NULL, *n = 0, *on = 0, *ordered = 1;
    int st = emit_check(ns, nv, snull, swidth, nout, shown, nonnull, owidth);
    if (st != DBSP_OK) return st;
    size_t cap = (size_t)(ng ? 2 * ng : 1);
    const int64_t **src = malloc(cap * sizeof *src), **osrc = malloc(cap * sizeof *osrc);
    int64_t *rows = malloc(cap * 8), *orows = malloc(cap * 8);
    uint8_t *chg = malloc(cap);
    *w = malloc(cap * 8), *kh = malloc(cap * 8), *ow = malloc(cap * 8);
    if (!keyorder) *rh = malloc(cap * 8);
    int64_t m = 0, k = 0;
    if (!src || !osrc || !rows || !orows || !chg || !*w || !*kh || (!keyorder && !*rh) || !*ow) {
        st = DBSP_ENOMEM;
        goto done;
    }
    emit_rows(ng, nv, ns, group_row, gkh, old, nw, snull, nout, shown, nonnull, keyorder, src, rows, *w, *kh, *rh, &m,
              ordered, osrc, orows, *ow, &k, chg);
    if (m == 0) goto done;
    if (batch && (st = export_rows(b, keys, nkeys, src, rows, m, ns, NULL, snull, swidth, batch)) != DBSP_OK) goto done;
    if ((st = export_rows(b, keys, nkeys, osrc, orows, k, nout, shown, nonnull, owidth, out)) != DBSP_OK) {
        if (batch) batch->release(batch);
        goto done;
    }
    if ((st = store(ix, b, keys, nv, ng, group_row, gkh, old, nw, held, chg)) != DBSP_OK) {  /* the stores last */
        if (batch) batch->release(batch);
        out->release(out);
        goto done;
    }
done:
    free(src); free(osrc); free(rows); free(orows); free(chg);
    if (st != DBSP_OK || m == 0) {
        free(*w); free(*kh); free(*rh); free(*ow);
        *w = NULL, *kh = NULL, *rh = NULL, *ow = NULL, *n = 0, *on = 0;
        return st;
    }
    *n = m, *on = k;
    return DBSP_OK;
}

int dbsp_extremes_batch(const DbspBatch *b, const int32_t *keys, int32_t nkeys, int32_t ns, int32_t nv, int64_t ng,
                        const int64_t *group_row, const uint64_t *gkh, const int64_t *old, const int64_t *nw,
                        const int32_t *snull, const int32_t *swidth, int keyorder, struct ArrowArray *batch,
                        int64_t **w, uint64_t **kh, uint64_t **rh, int64_t *n, int *ordered) {
    batch->release = NULL;
    *w = NULL, *kh = NULL, *rh = NULL, *n = 0, *ordered = 1;
    int st = emit_check(ns, nv, snull, swidth, 0, NULL, NULL, NULL);
    if (st != DBSP_OK) return st;
    size_t cap = (size_t)(ng ? 2 * ng : 1);
    const int64_t **src = malloc(cap * sizeof *src);
    int64_t *rows = malloc(cap * 8), m = 0;
    *w = malloc(cap * 8), *kh = malloc(cap * 8);
    if (!keyorder) *rh = malloc(cap * 8);
    if (!src || !rows || !*w || !*kh || (!keyorder && !*rh)) { st = DBSP_ENOMEM; goto done; }
    emit_rows(ng, nv, ns, group_row, gkh, old, nw, snull, 0, NULL, NULL, keyorder, src, rows, *w, *kh, *rh, &m, ordered,
              NULL, NULL, NULL, NULL, NULL);
    if (m) st = export_rows(b, keys, nkeys, src, rows, m, ns, NULL, snull, swidth, batch);
done:
    free(src); free(rows);
    if (st != DBSP_OK || m == 0) {
        free(*w); free(*kh); free(*rh);
        *w = NULL, *kh = NULL, *rh = NULL, *n = 0;
        return st;
    }
    *n = m;
    return DBSP_OK;
}

typedef struct { int64_t v, w; } ValW;

static int valw_cmp(const void *a, const void *b) {
    int64_t x = ((const ValW *)a)->v, y = ((const ValW *)b)->v;
    return (x > y) - (x < y);
}

/* Keys a scan seeks at a time (design note 6): their positions in every batch first, by seeks that prefetch ahead */
#define SCAN_CHUNK 64
#define SCAN_PF 4  /* keys ahead whose rows in each batch are prefetched while one is read (keys not ascending) */

/* Design note 8: pos[k * SCAN_CHUNK + i] = dbsp_seek(vkh[k], vb[k]->nrows, vfence[k], 0, want[i]) for i < m (want
 * ascending), for every batch k, in three stages, each over every batch before the next, so that its cache misses are
 * in flight together instead of one batch's (or a few keys') at a time: the fence entries of each key in each fenced
 * batch (the fence, small, mostly cached), with a prefetch of the 512-byte block of key hashes each needs; the search
 * in those blocks (a batch without a fence: the gallop over its key hashes, small and recent), with a prefetch of the
 * row found (its key hash, values and weight); the rows are then read by the caller. The same positions as
 * dbsp_seek_all. */
static void scan_seek(const DbspBatch *const *vb, const uint64_t *const *vkh, const uint64_t *const *vfence,
                      int32_t nb, const uint64_t *want, int64_t m, int64_t *pos) {
    for (int32_t k = 0; k < nb; k++) {  /* stage 1: the fence entries, each key's block prefetched */
        const uint64_t *fence = vfence ? vfence[k] : NULL, *kh = vkh[k];
        if (!fence) continue;
        int64_t n = vb[k]->nrows, nf = dbsp_fence_len(n), f = 0, *p = pos + (int64_t)k * SCAN_CHUNK;
        for (int64_t i = 0; i < m; i++) {
            p[i] = f = dbsp_gallop(fence, f, nf, want[i]);  /* first fence entry >= */
            dbsp_prefetch_fence_block(kh, n, f);
        }
    }
    for (int32_t k = 0; k < nb; k++) {  /* stage 2: the positions, each row found prefetched */
        const DbspBatch *v = vb[k];
        const uint64_t *fence = vfence ? vfence[k] : NULL, *kh = vkh[k];
        int64_t n = v->nrows, *p = pos + (int64_t)k * SCAN_CHUNK;
        if (!fence) {
            dbsp_seek_all(kh, n, NULL, want, m, p);  /* (without a fence: its gallop) */
        } else {
            for (int64_t i = 0; i < m; i++) p[i] = dbsp_fence_block_seek(kh, n, p[i], want[i]);
        }
        for (int64_t i = 0; i < m; i++)
            if (p[i] < n && kh[p[i]] == want[i]) dbsp_prefetch_row(v, p[i], NULL, v->ncols);
    }
}

int dbsp_extremes_scan(const DbspBatch *b, const int32_t *keys, int32_t nkeys, const int64_t *rows, const uint64_t *kh,
                       int64_t n, const DbspBatch *const *vb, const uint64_t *const *vkh,
                       const uint64_t *const *vfence, int32_t nb, const int32_t *vkeys, int32_t vcol, uint8_t *has,
                       int64_t *mn, int64_t *mx) {
    for (int32_t k = 0; k < nb; k++) {
        if (vcol < 0 || vcol >= vb[k]->ncols || !holdable(vb[k]->cols[vcol].type)) return DBSP_ETYPE;
        for (int32_t j = 0; j < nkeys; j++)
            if (vkeys[j] < 0 || vkeys[j] >= vb[k]->ncols) return DBSP_EINVAL;
    }
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= b->nrows) return DBSP_EINVAL;
    int asc = 1;  /* the sought key hashes ascending (a change's groups): each batch's seeks in one prefetching pass */
    for (int64_t i = 1; i < n && asc; i++) asc = kh[i] >= kh[i - 1];
    int64_t cap = 64, m;
    ValW *buf = malloc((size_t)cap * sizeof *buf);
    int64_t *pos = malloc((size_t)(nb ? nb : 1) * SCAN_CHUNK * sizeof *pos);  /* pos[k * SCAN_CHUNK + i - i0] */
    if (!buf || !pos) { free(buf); free(pos); return DBSP_ENOMEM; }
    int st = DBSP_OK;
    for (int64_t i0 = 0; i0 < n && st == DBSP_OK; i0 += SCAN_CHUNK) {
        int64_t cnt = n - i0 < SCAN_CHUNK ? n - i0 : SCAN_CHUNK;
        if (asc) {  /* design note 8: the seeks in stages across every batch, each stage's misses in flight at once */
            scan_seek(vb, vkh, vfence, nb, kh + i0, cnt, pos);
        } else {
            for (int32_t k = 0; k < nb; k++) {  /* where each sought key's rows start in batch k */
                const uint64_t *fence = vfence ? vfence[k] : NULL;
                int64_t *p = pos + (int64_t)k * SCAN_CHUNK;
                for (int64_t i = 0; i < cnt; i++) p[i] = dbsp_seek(vkh[k], vb[k]->nrows, fence, 0, kh[i0 + i]);
            }
        }
        for (int64_t i = i0; i < i0 + cnt && st == DBSP_OK; i++) {
            m = 0;
            for (int32_t k = 0; k < nb; k++) {  /* the key's rows of every batch, with their weights */
                const DbspBatch *v = vb[k];
                if (!asc && i + SCAN_PF < i0 + cnt) {
                    int64_t y = pos[(int64_t)k * SCAN_CHUNK + i + SCAN_PF - i0];
                    if (y < v->nrows) dbsp_prefetch_row(v, y, NULL, v->ncols);
                }
                for (int64_t r = pos[(int64_t)k * SCAN_CHUNK + i - i0]; r < v->nrows && vkh[k][r] == kh[i]; r++) {
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
            if (st != DBSP_OK) break;
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
    }
    free(buf);
    free(pos);
    return st;
}
