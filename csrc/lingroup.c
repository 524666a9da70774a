/* lingroup.c: a linear group-by's change grouped in one hashing pass into a table sized by the change (see lingroup.h). */
#include <stdlib.h>
#include <string.h>
#include "lingroup.h"
#include "hash.h"
#include "keyindex.h"
#include "linrun.h"
#include "status.h"

void dbsp_lingroup_free(DbspLinGroup *g) {
    free(g->tab); free(g->gh); free(g->gw); free(g->gpos); free(g->gfirst); free(g->ord); free(g->cnt); free(g->gs);
    free(g->group_row); free(g->khash); free(g->ivals);
    memset(g, 0, sizeof *g);
}

/* room for n rows of nkeys keys and ns slots (invariant 3); the table comes zeroed and is kept so */
static int reserve(DbspLinGroup *g, int64_t n, int32_t nkeys, int32_t ns) {
    if (g->rows >= n && g->ns == ns && g->nkeys == nkeys) return DBSP_OK;
    dbsp_lingroup_free(g);
    int64_t rows = n < 1024 ? 1024 : n, cap = 64;
    while (cap < 2 * rows) cap *= 2;
    g->tab = calloc((size_t)cap, 4);
    g->cnt = malloc((size_t)(cap + 1) * 4);
    g->gh = malloc((size_t)rows * 8);
    g->gw = malloc((size_t)(rows * nkeys) * 8);
    g->gpos = malloc((size_t)rows * 4);
    g->gfirst = malloc((size_t)rows * 4);
    g->ord = malloc((size_t)rows * 4);
    g->gs = malloc((size_t)(rows * ns) * 8);
    g->group_row = malloc((size_t)rows * 8);
    g->khash = malloc((size_t)rows * 8);
    g->ivals = malloc((size_t)(rows * ns) * 8);
    if (!g->tab || !g->cnt || !g->gh || !g->gw || !g->gpos || !g->gfirst || !g->ord || !g->gs || !g->group_row || !g->khash
        || !g->ivals) {
        dbsp_lingroup_free(g);
        return DBSP_ENOMEM;
    }
    g->rows = rows;
    g->tcap = cap;
    g->ns = ns;
    g->nkeys = nkeys;
    return DBSP_OK;
}

/* a slot's source (invariant 1): what a row adds to it times its weight */
enum { SRC_ONE, SRC_COL, SRC_HI, SRC_LO };

static int served(const DbspBatch *b, const int32_t *keys, int32_t nkeys, const DbspAggSpec *specs, int32_t ns,
                  int32_t *src) {
    if (nkeys < 1 || nkeys > DBSP_KEYINDEX_MAX_KEYS || ns < 1 || ns > 64 || b->nrows >= (int64_t)INT32_MAX)
        return 0;
    for (int32_t k = 0; k < nkeys; k++) {
        if (keys[k] < 0 || keys[k] >= b->ncols) return 0;
        const DbspColumn *c = &b->cols[keys[k]];
        if (c->validity || c->type == DBSP_BOOL || !dbsp_type_width(c->type)) return 0;
    }
    for (int32_t j = 0; j < ns; j++) {
        int32_t kind = specs[j].kind, col = specs[j].col;
        if (kind == DBSP_AGG_COUNT) { src[j] = SRC_ONE; continue; }
        if (col < 0 || col >= b->ncols || b->cols[col].validity) return 0;
        int32_t t = b->cols[col].type;
        if (kind == DBSP_AGG_COUNT_COL) src[j] = SRC_ONE;
        else if (kind == DBSP_AGG_SUM && t != DBSP_BOOL && t != DBSP_UINT64 && t != DBSP_DATE32
                 && (dbsp_type_class(t) == DBSP_CLASS_SIGNED || dbsp_type_class(t) == DBSP_CLASS_UNSIGNED))
            src[j] = SRC_COL;
        else if ((kind == DBSP_LINRUN_SUM_HI || kind == DBSP_LINRUN_SUM_LO) && t == DBSP_INT64)
            src[j] = kind == DBSP_LINRUN_SUM_HI ? SRC_HI : SRC_LO;
        else return 0;
    }
    return 1;
}

/* the canonical word of a fixed-width value (keyindex.h invariant 1) and its value hash (hash.h) */
static inline uint64_t canon(const DbspColumn *c, int64_t i, uint64_t *vh) {
    if (dbsp_type_class(c->type) == DBSP_CLASS_FLOAT) {
        uint64_t u = dbsp_canon_f64_bits(dbsp_col_f64(c, i));
        *vh = dbsp_mix(u ^ DBSP_HASH_S_FLOAT);
        return u;
    }
    uint64_t u = dbsp_col_u64(c, i);
    *vh = dbsp_mix(u ^ DBSP_HASH_S_INT);
    return u;
}

/* the group of a row of key words w[0..nk) and hash h, made when new (invariant 2); -1 past the table's groups */
static inline __attribute__((always_inline)) int64_t group_of(DbspLinGroup *g, const uint64_t *w, int32_t nk,
                                                              uint64_t h, int64_t *ng, int64_t r, int32_t ns) {
    const uint64_t mask = (uint64_t)g->tcap - 1;
    for (uint64_t at = h & mask;; at = (at + 1) & mask) {
        uint32_t e = g->tab[at];
        if (e == 0) {
            int64_t n = (*ng)++;
            g->tab[at] = (uint32_t)(n + 1);
            g->gh[n] = h;
            g->gpos[n] = (uint32_t)at;
            g->gfirst[n] = (uint32_t)r;
            for (int32_t k = 0; k < nk; k++) g->gw[n * nk + k] = w[k];
            for (int32_t j = 0; j < ns; j++) g->gs[n * ns + j] = 0;
            return n;
        }
        int64_t q = (int64_t)e - 1;
        if (g->gh[q] != h) continue;
        int same = 1;
        for (int32_t k = 0; k < nk; k++) same &= g->gw[q * nk + k] == w[k];
        if (same) return q;
    }
}

/* add w times each slot's source for row r into sums s; 0 when something leaves int64 */
static inline __attribute__((always_inline)) int add_row(int64_t *s, const int32_t *src, const int64_t *const *cv,
                                                         const DbspBatch *b, const DbspAggSpec *specs, int32_t ns,
                                                         int64_t r, int64_t w) {
    for (int32_t j = 0; j < ns; j++) {
        int64_t x, p;
        switch (src[j]) {
        case SRC_ONE: x = 1; break;
        case SRC_HI: x = cv[j][r] >> 32; break;
        case SRC_LO: x = cv[j][r] & 0xFFFFFFFF; break;
        default: x = cv[j] ? cv[j][r] : (int64_t)dbsp_col_u64(&b->cols[specs[j].col], r); break;
        }
        if (__builtin_mul_overflow(x, w, &p) || __builtin_add_overflow(s[j], p, &s[j])) return 0;
    }
    return 1;
}

int dbsp_lingroup(DbspLinGroup *g, const DbspBatch *b, const int32_t *keys, int32_t nkeys, const DbspAggSpec *specs,
                  int32_t ns, int64_t *ng) {
    int32_t src[64];
    const int64_t *cv[64];
    *ng = 0;
    if (!served(b, keys, nkeys, specs, ns, src)) return DBSP_LINGROUP_NO;
    const int64_t n = b->nrows;
    if (n == 0) return DBSP_OK;
    int st = reserve(g, n, nkeys, ns);
    if (st != DBSP_OK) return st;
    for (int32_t j = 0; j < ns; j++) {  /* int64 columns read straight; narrower ones through dbsp_col_u64 */
        const DbspColumn *c = src[j] == SRC_ONE ? NULL : &b->cols[specs[j].col];
        cv[j] = c && (c->type == DBSP_INT64 || c->type == DBSP_TIMESTAMP) ? (const int64_t *)c->values + c->offset
                                                                          : NULL;
    }
    const int64_t *wt = b->weights;
    int64_t m = 0;
    int ok = 1;
    const DbspColumn *k0 = &b->cols[keys[0]];
    if (nkeys == 1 && (k0->type == DBSP_INT64 || k0->type == DBSP_UINT64 || k0->type == DBSP_TIMESTAMP)) {
        const uint64_t *kv = (const uint64_t *)k0->values + k0->offset;  /* the commonest key: one 64-bit integer */
        for (int64_t r = 0; ok && r < n; r++) {
            uint64_t u = kv[r];
            int64_t q = group_of(g, &u, 1, dbsp_hash_int_row(u), &m, r, ns);
            ok = add_row(g->gs + q * ns, src, cv, b, specs, ns, r, wt ? wt[r] : 1);
        }
    } else {
        uint64_t w[DBSP_KEYINDEX_MAX_KEYS];
        for (int64_t r = 0; ok && r < n; r++) {
            uint64_t h = DBSP_HASH_ROW_SEED, vh;
            for (int32_t k = 0; k < nkeys; k++) {
                w[k] = canon(&b->cols[keys[k]], r, &vh);
                h = dbsp_mix(h * DBSP_HASH_K_GOLD + vh);
            }
            int64_t q = group_of(g, w, nkeys, h, &m, r, ns);
            ok = add_row(g->gs + q * ns, src, cv, b, specs, ns, r, wt ? wt[r] : 1);
        }
    }
    for (int64_t q = 0; q < m; q++) g->tab[g->gpos[q]] = 0;  /* invariant 3: only the slots filled */
    if (!ok) return DBSP_LINGROUP_NO;
    /* invariant 2: key-hash order by the top bits (buckets about a group each), then an insertion pass */
    int bits = 1;
    while (bits < 30 && ((int64_t)1 << bits) < m) bits++;
    const int64_t nb = (int64_t)1 << bits;
    const int sh = 64 - bits;
    uint32_t *cnt = g->cnt;
    memset(cnt, 0, (size_t)(nb + 1) * 4);
    for (int64_t q = 0; q < m; q++) cnt[(g->gh[q] >> sh) + 1]++;
    for (int64_t i = 0; i < nb; i++) cnt[i + 1] += cnt[i];
    for (int64_t q = 0; q < m; q++) g->ord[cnt[g->gh[q] >> sh]++] = (uint32_t)q;
    for (int64_t i = 1; i < m; i++) {
        uint32_t q = g->ord[i];
        uint64_t h = g->gh[q];
        int64_t j = i;
        while (j > 0 && g->gh[g->ord[j - 1]] > h) { g->ord[j] = g->ord[j - 1]; j--; }
        g->ord[j] = q;
    }
    for (int64_t i = 0; i < m; i++) {
        uint32_t q = g->ord[i];
        g->group_row[i] = g->gfirst[q];
        g->khash[i] = g->gh[q];
        for (int32_t j = 0; j < ns; j++) g->ivals[i * ns + j] = g->gs[q * ns + j];
    }
    *ng = m;
    return DBSP_OK;
}
