/* linrun.c: a linear group-by's whole step in one call (see linrun.h). */
#include <stdlib.h>
#include <string.h>
#include "linrun.h"
#include "fold.h"
#include "status.h"

static void free_fold(DbspLinRun *s) {
    free(s->old); free(s->slots); free(s->grp); free(s->rows);
    s->old = NULL; s->slots = NULL; s->grp = NULL; s->rows = NULL;
    s->groups = 0;
}

void dbsp_linrun_free(DbspLinRun *s) {
    free_fold(s);
    dbsp_lingroup_free(&s->lg);
    memset(s, 0, sizeof *s);
}

/* the read and fold (dbsp_linear_read), a group's rows by row hash when canon (else key-hash order only: invariant 8) */
static int read_fold(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const DbspReduceOut *r, int32_t ns,
                     int64_t *old, int64_t **slots, int64_t *grp, int64_t *rows, int64_t *w, uint64_t *kh,
                     int64_t *vals, uint64_t *rh, int64_t *n, int *ordered, int canon) {
    int64_t ng = r->ngroups;
    const uint64_t *khash = (const uint64_t *)r->khash;
    *n = 0;
    *ordered = 1;
    if (ng == 0) return DBSP_OK;
    int st = dbsp_keyindex_read_slots(ix, b, keys, r->group_row, khash, ng, old, slots);  /* old: copied, no zeroing */
    if (st == DBSP_OK) st = dbsp_linear_fold2(ng, ns, old, r->ivals, khash, grp, w, kh, vals, n, ordered, rh, canon);
    if (st != DBSP_OK) return st;
    const int64_t m = *n, *gr = r->group_row;
    for (int64_t i = 0; i < m; i++) rows[i] = gr[grp[i]];
    return DBSP_OK;
}

int dbsp_linear_read(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const DbspReduceOut *r, int32_t ns,
                     int64_t *old, int64_t **slots, int64_t *grp, int64_t *rows, int64_t *w, uint64_t *kh,
                     int64_t *vals, uint64_t *rh, int64_t *n, int *ordered) {
    return read_fold(ix, b, keys, r, ns, old, slots, grp, rows, w, kh, vals, rh, n, ordered, 1);
}

/* Invariant 4: put back what the first `upto` rows of dbsp_linear_store's second pass stored (new keys: removed) and
 * what its first pass did (the old totals, in place: a key found is still there, as nothing was removed yet), after a
 * store failed with nothing of the failing key written. Neither put allocates (an existing key's sums are written in
 * place, a removal only moves slot words), so this cannot fail. */
static void undo_store(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, int32_t ns, const int64_t *old,
                       int64_t *const *slots, const int64_t *grp, const int64_t *rows, const int64_t *w,
                       const uint64_t *kh, int64_t m, int64_t upto) {
    dbsp_keyindex_unbreak(ix);
    for (int64_t i = upto - 1; i >= 0; i--)
        if (w[i] > 0 && slots[grp[i]] == NULL) (void)dbsp_keyindex_put(ix, b, keys, rows[i], kh[i], NULL, 1, 0);
    for (int64_t i = 0; i < m; i++)
        if (w[i] > 0 && slots[grp[i]] != NULL)
            (void)dbsp_keyindex_put(ix, b, keys, rows[i], kh[i], old + grp[i] * ns, 1, 0);
}

int dbsp_linear_store(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, int32_t ns, const int64_t *old,
                      int64_t *const *slots, const int64_t *grp, const int64_t *rows, const int64_t *w,
                      const uint64_t *kh, const int64_t *vals, int64_t cap, int64_t m) {
    int st = DBSP_OK, added = 0, gone = 0;
    for (int64_t i = 0; i < m; i++) {  /* new totals of keys held: in place, before the index changes shape */
        int64_t g = grp[i];
        if (w[i] > 0) {
            if (slots[g] != NULL) dbsp_keyindex_set_slot(ix, slots[g], vals + i, cap);
            else added = 1;
        } else if ((i + 1 >= m || grp[i + 1] != g) && (i == 0 || grp[i - 1] != g)) {
            gone = 1;  /* its old row alone: the new count is 0 */
        }
    }
    for (int64_t i = 0; added && i < m; i++) {  /* then new keys: the only stores that allocate (invariant 4) */
        if (w[i] > 0 && slots[grp[i]] == NULL) st = dbsp_keyindex_put(ix, b, keys, rows[i], kh[i], vals + i, cap, m);
        if (st != DBSP_OK) {
            if (st == DBSP_ENOMEM || st == DBSP_ETOOBIG) {
                undo_store(ix, b, keys, ns, old, slots, grp, rows, w, kh, m, i);
                dbsp_keyindex_note_refusal(ix);
            }
            return st;
        }
    }
    for (int64_t i = 0; gone && i < m; i++) {  /* last, groups whose new count is 0 (a removal allocates nothing) */
        int64_t g = grp[i];
        if (w[i] < 0 && (i + 1 >= m || grp[i + 1] != g) && (i == 0 || grp[i - 1] != g)) {  /* its old row alone */
            st = dbsp_keyindex_put(ix, b, keys, rows[i], kh[i], NULL, cap, m);
            if (st != DBSP_OK) return st;
        }
    }
    return DBSP_OK;
}

int dbsp_linear_apply(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const DbspReduceOut *r, int32_t ns,
                      int64_t *old, int64_t **slots, int64_t *grp, int64_t *rows, int64_t *w, uint64_t *kh,
                      int64_t *vals, uint64_t *rh, int64_t *n, int *ordered) {
    int st = dbsp_linear_read(ix, b, keys, r, ns, old, slots, grp, rows, w, kh, vals, rh, n, ordered);
    if (st != DBSP_OK || *n == 0) return st;
    return dbsp_linear_store(ix, b, keys, ns, old, slots, grp, rows, w, kh, vals, 2 * r->ngroups, *n);
}

/* room in s for ng groups of ns slots (invariant 3: kept up to DBSP_LINRUN_KEEP groups) */
static int reserve(DbspLinRun *s, int64_t ng, int32_t ns) {
    if (s->groups >= ng && s->ns == ns) return DBSP_OK;
    free_fold(s);
    int64_t g = ng < 1024 ? 1024 : ng;
    s->old = malloc((size_t)(g * ns) * 8);
    s->slots = malloc((size_t)g * sizeof(int64_t *));
    s->grp = malloc((size_t)(2 * g) * 8);
    s->rows = malloc((size_t)(2 * g) * 8);
    if (!s->old || !s->slots || !s->grp || !s->rows) {
        free_fold(s);
        return DBSP_ENOMEM;
    }
    s->groups = g;
    s->ns = ns;
    return DBSP_OK;
}

int dbsp_linear_run(DbspLinRun *s, const DbspBatch *b, const int32_t *keys, int32_t nkeys, const DbspAggSpec *specs,
                    int32_t ns, DbspKeyIndex *ix, const int32_t *shown, const int32_t *nonnull, int32_t nout,
                    int out_keys, struct ArrowArray *batch, struct ArrowArray *out, int64_t **w, uint64_t **kh,
                    int64_t *n, int *ordered, int *distinct) {
    return dbsp_linear_run2(s, b, keys, nkeys, specs, ns, ix, shown, nonnull, NULL, NULL, nout, out_keys, batch, out,
                            w, kh, n, ordered, distinct);
}

/* an avg's value from its slots (linrun.h), as Aggregate.finalize computes it in long double */
static double avg_of(int64_t hi, int64_t lo, int has_lo, int64_t cnt) {
    long double v;
    if (has_lo) {
        hi += lo >> 32;
        lo &= 0xFFFFFFFF;
        v = (long double)hi * 4294967296.0L + (long double)lo;
    } else {
        v = (long double)hi;
    }
    return cnt ? (double)(v / (long double)cnt) : 0.0;
}

int dbsp_linear_run2(DbspLinRun *s, const DbspBatch *b0, const int32_t *keys, int32_t nkeys, const DbspAggSpec *specs0,
                     int32_t ns, DbspKeyIndex *ix, const int32_t *shown, const int32_t *nonnull, const int32_t *avg,
                     const int32_t *avg_lo, int32_t nout, int out_keys, struct ArrowArray *batch,
                     struct ArrowArray *out, int64_t **w, uint64_t **kh, int64_t *n, int *ordered, int *distinct) {
    return dbsp_linear_run3(s, b0, keys, nkeys, specs0, ns, ix, shown, nonnull, avg, avg_lo, nout, out_keys, batch, out,
                            w, kh, n, ordered, distinct, NULL, NULL);
}

/* invariant 5: per row of the step, whether its group's key is not in the dirty index (one probe a group; with
 * found_dirty, invariant 6, only of the groups ix does not hold) */
static int probe_dirty(const DbspLinRun *s, const DbspKeyIndex *dirty, const DbspBatch *b, const int32_t *keys,
                       const DbspReduceOut *r, int found_dirty, int64_t m, uint8_t *fresh) {
    int64_t ng = r->ngroups, na = 0;
    const uint64_t *khash = (const uint64_t *)r->khash;
    uint8_t *gf = malloc((size_t)ng);  /* per group: its key not dirty */
    int64_t *sel = malloc((size_t)ng * 8), *gi = malloc((size_t)ng * 8), *acc = NULL;
    uint64_t *skh = malloc((size_t)ng * 8);
    int st = gf && sel && gi && skh ? DBSP_OK : DBSP_ENOMEM;
    for (int64_t g = 0; st == DBSP_OK && g < ng; g++) {
        if (found_dirty && s->slots[g]) { gf[g] = 0; continue; }
        sel[na] = r->group_row[g];
        skh[na] = khash[g];
        gi[na++] = g;
    }
    if (st == DBSP_OK && na && !(acc = calloc((size_t)na, 8))) st = DBSP_ENOMEM;
    if (st == DBSP_OK && na) st = dbsp_keyindex_get(dirty, b, keys, sel, skh, na, acc);
    for (int64_t k = 0; st == DBSP_OK && k < na; k++) gf[gi[k]] = acc[k] == 0;
    for (int64_t i = 0; st == DBSP_OK && i < m; i++) fresh[i] = gf[s->grp[i]];
    free(gf); free(sel); free(gi); free(skh); free(acc);
    return st;
}

int dbsp_linear_run3(DbspLinRun *s, const DbspBatch *b0, const int32_t *keys, int32_t nkeys, const DbspAggSpec *specs0,
                     int32_t ns, DbspKeyIndex *ix, const int32_t *shown, const int32_t *nonnull, const int32_t *avg,
                     const int32_t *avg_lo, int32_t nout, int out_keys, struct ArrowArray *batch,
                     struct ArrowArray *out, int64_t **w, uint64_t **kh, int64_t *n, int *ordered, int *distinct,
                     const DbspKeyIndex *dirty, uint8_t **fresh) {
    DbspReduceOut r;
    DbspAggSpec specs[64];
    DbspColumn lcols[64 + 64];  /* the batch's columns, then one int64 column per limb slot */
    int64_t *limbs[64];
    DbspBatch bb = *b0;
    const DbspBatch *b = b0;
    int32_t nlimb = 0;
    DbspCDataCol bc[64 + 64], oc[64 + 64];  /* the exported columns: the trace batch's (keys, slots), the output's */
    const int64_t *ov[64];  /* the output's values */
    DbspCDataShare *sh = NULL;
    int64_t *vals = NULL;  /* the slot values, ns columns of stride vs: the exports' (invariant 8) */
    int64_t ng = 0, cap = 0, m = 0, vs = 0;
    int32_t nok = 0, nown = 0;  /* the output's key columns; its columns whose own buffers are still to free */
    /* (invariants 6, 8; read first: a free of the scratch clears them) */
    const int found_dirty = s->found_dirty, canon = !s->keyorder;
    memset(&r, 0, sizeof r);
    batch->release = NULL;
    out->release = NULL;
    *w = NULL; *kh = NULL; *n = 0; *ordered = 1; *distinct = 1;
    if (fresh) *fresh = NULL;
    if (ns < 1 || nout < 0 || nkeys < 0 || nkeys > 64 || ns + nout > 64 || b0->ncols > 64) return DBSP_EINVAL;
    memset(limbs, 0, sizeof limbs);
    int fused = 0;
    int st = dbsp_lingroup(&s->lg, b0, keys, nkeys, specs0, ns, &ng);  /* invariant 7 */
    if (st == DBSP_OK) {
        fused = 1;
        r.ngroups = ng;
        r.naggs = ns;
        r.group_row = s->lg.group_row;
        r.khash = (int64_t *)(void *)s->lg.khash;
        r.ivals = s->lg.ivals;
        goto grouped;
    }
    if (st != DBSP_LINGROUP_NO) goto done;
    st = DBSP_OK;
    for (int32_t j = 0; j < ns; j++) {  /* limb slots sum a column of limbs made here (linrun.h) */
        specs[j] = specs0[j];
        int32_t kind = specs0[j].kind, c = specs0[j].col;
        if (kind != DBSP_LINRUN_SUM_HI && kind != DBSP_LINRUN_SUM_LO) continue;
        if (c < 0 || c >= b0->ncols || b0->cols[c].type != DBSP_INT64 || b0->cols[c].validity) {
            st = DBSP_EINVAL;
            goto done;
        }
        if (!nlimb) memcpy(lcols, b0->cols, (size_t)b0->ncols * sizeof *lcols);
        int64_t rows = b0->nrows;
        if (!(limbs[nlimb] = malloc((size_t)(rows ? rows : 1) * 8))) { st = DBSP_ENOMEM; goto done; }
        const int64_t *v = (const int64_t *)b0->cols[c].values + b0->cols[c].offset;
        for (int64_t i = 0; i < rows; i++)
            limbs[nlimb][i] = kind == DBSP_LINRUN_SUM_HI ? v[i] >> 32 : v[i] & 0xFFFFFFFF;
        DbspColumn *lc = &lcols[b0->ncols + nlimb];
        memset(lc, 0, sizeof *lc);
        lc->type = DBSP_INT64;
        lc->values = limbs[nlimb];
        specs[j].kind = DBSP_AGG_SUM;
        specs[j].col = b0->ncols + nlimb++;
    }
    if (nlimb) {
        bb.cols = lcols;
        bb.ncols = b0->ncols + nlimb;
        b = &bb;
    }
    st = dbsp_group_reduce_all(b, keys, nkeys, specs, ns, &r);
    ng = r.ngroups;
grouped:
    cap = 2 * ng;
    if (st != DBSP_OK || ng == 0) goto done;
    if ((st = reserve(s, ng, ns)) != DBSP_OK) goto done;
    *w = malloc((size_t)cap * 8);
    *kh = malloc((size_t)cap * 8);
    vals = malloc((size_t)(cap * ns) * 8);
    sh = dbsp_cdata_share_new(1 + 3 * nkeys);  /* vals and the key columns' buffers */
    if (!*w || !*kh || !vals || !sh) { st = DBSP_ENOMEM; goto done; }
    /* read and fold; the exports below; the store last, so that a failure of an export changes nothing, and one of
     * the store is undone (invariant 4) */
    st = read_fold(ix, b, keys, &r, ns, s->old, s->slots, s->grp, s->rows, *w, *kh, vals, NULL, n, ordered, canon);
    m = *n;
    if (st != DBSP_OK || m == 0) goto done;
    vs = cap;
    if (m < cap) {  /* the columns packed to stride m: the exports pin no room beyond their rows */
        for (int32_t j = 1; j < ns; j++) memmove(vals + j * m, vals + j * cap, (size_t)m * 8);
        int64_t *v2 = realloc(vals, (size_t)(m * ns) * 8);
        if (v2) vals = v2;
        vs = m;
    }
    (void)dbsp_cdata_share_take(sh, vals);  /* (room made for it) the share's now */
    int64_t *const vkeep = vals;
    vals = NULL;
    const int64_t *rows = s->rows, *grp = s->grp;
    if (dirty && fresh) {
        if (!(*fresh = malloc((size_t)m))) { st = DBSP_ENOMEM; goto done; }
        if ((st = probe_dirty(s, dirty, b, keys, &r, found_dirty, m, *fresh)) != DBSP_OK) goto done;
    }
    for (int32_t k = 0; k < nkeys; k++) {  /* the key columns at their carrying rows: one copy for both exports */
        if (keys[k] < 0 || keys[k] >= b->ncols) { st = DBSP_EINVAL; goto done; }
        if ((st = dbsp_cdata_share_gather(sh, &b->cols[keys[k]], b->nrows, rows, m, &bc[k])) != DBSP_OK) goto done;
    }
    for (int32_t j = 0; j < ns; j++)
        bc[nkeys + j] = (DbspCDataCol){.null_count = 0, .n_buffers = 2, .bufs = {NULL, vkeep + j * vs, NULL},
                                       .own = {NULL, NULL}};
    nok = out_keys ? nkeys : 0;
    if (nok) memcpy(oc, bc, (size_t)nok * sizeof *oc);
    for (int32_t o = 0; o < nout; o++) {  /* an output column: its slot's values (the batch's buffer), or an avg's */
        int32_t j = shown[o];
        DbspCDataCol *c = &oc[nok + o];
        nown = o + 1;
        *c = (DbspCDataCol){.null_count = 0, .n_buffers = 2, .bufs = {NULL, vkeep + j * vs, NULL}, .own = {NULL, NULL}};
        if (avg && avg[o]) {  /* an avg: its double's bits (the output's own buffer) */
            int64_t *a = malloc((size_t)m * 8);
            if (!a) { st = DBSP_ENOMEM; goto done; }
            c->own[1] = a;
            const int64_t *hi = vkeep + j * vs, *cn = vkeep + nonnull[o] * vs;
            const int64_t *lo = avg_lo[o] >= 0 ? vkeep + avg_lo[o] * vs : NULL;
            for (int64_t i = 0; i < m; i++) {
                double d = avg_of(hi[i], lo ? lo[i] : 0, lo != NULL, cn[i]);
                memcpy(&a[i], &d, 8);
            }
            c->bufs[1] = a;
        }
        ov[o] = c->bufs[1];
        if (nonnull[o] < 0) continue;
        const int64_t *nn = vkeep + nonnull[o] * vs;
        int64_t z = 0;
        for (int64_t i = 0; i < m; i++) z += nn[i] == 0;
        if (!z) continue;
        uint8_t *valid = calloc((size_t)(m + 7) / 8 + 1, 1);
        if (!valid) { st = DBSP_ENOMEM; goto done; }
        c->own[0] = valid;
        for (int64_t i = 0; i < m; i++)
            if (nn[i] != 0) valid[i >> 3] |= (uint8_t)(1u << (i & 7));
        c->bufs[0] = valid;
        c->null_count = z;
    }
    /* distinct unless a group's two rows show equal values (Aggregate.ints_may_cancel; an avg by its value, a null,
     * where the non-null count is 0, equal to a null) */
    if (!out_keys) *distinct = 0;
    const int64_t *onn[64];  /* the output's non-null counts (NULL: never null) */
    for (int32_t o = 0; o < nout; o++) onn[o] = nonnull[o] >= 0 ? vkeep + nonnull[o] * vs : NULL;
    for (int64_t i = 1; out_keys && i < m; i++) {
        if (grp[i] != grp[i - 1]) continue;
        int same = 1;
        for (int32_t o = 0; same && o < nout; o++) {
            int na = onn[o] && onn[o][i] == 0, nb = onn[o] && onn[o][i - 1] == 0;
            same = (na && nb) || (!na && !nb && ov[o][i] == ov[o][i - 1]);
        }
        if (same) { *distinct = 0; break; }
    }
    if ((st = dbsp_cdata_share_export(sh, nkeys + ns, bc, m, batch)) != DBSP_OK) goto done;
    if ((st = dbsp_cdata_share_export(sh, nok + nout, oc, m, out)) != DBSP_OK) { batch->release(batch); goto done; }
    nown = 0;  /* the output's columns own them now */
    st = dbsp_linear_store(ix, b, keys, ns, s->old, s->slots, s->grp, s->rows, *w, *kh, vkeep, vs, m);
    if (st != DBSP_OK) {  /* nothing stored (invariant 4): nothing returned */
        batch->release(batch);
        out->release(out);
        goto done;
    }
    if (m < cap) {  /* the weights and key hashes pin no room beyond their rows (a shrink: in place, no copy) */
        int64_t *w2 = realloc(*w, (size_t)m * 8);
        uint64_t *k2 = realloc(*kh, (size_t)m * 8);
        if (w2) *w = w2;
        if (k2) *kh = k2;
    }
done:
    for (int32_t o = 0; o < nown; o++) { free(oc[nok + o].own[0]); free(oc[nok + o].own[1]); }
    free(vals);  /* (NULL once the share holds it) */
    dbsp_cdata_share_drop(sh);  /* the exports' columns hold the buffers they show */
    for (int32_t k = 0; k < nlimb; k++) free(limbs[k]);
    if (fused) memset(&r, 0, sizeof r);  /* the scratch's (invariant 7), not to be freed */
    dbsp_reduce_free(&r);
    if (ng > DBSP_LINRUN_KEEP || b0->nrows > DBSP_LINRUN_KEEP) dbsp_linrun_free(s);
    s->fused = fused;
    if (st != DBSP_OK || m == 0) {
        free(*w); free(*kh);
        *w = NULL; *kh = NULL; *n = 0;
        if (fresh) { free(*fresh); *fresh = NULL; }
    }
    return st;
}
