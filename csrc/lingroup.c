/* lingroup.c: a linear group-by's change grouped in one hashing pass into a table sized by the change (lingroup.h). */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include "lingroup.h"
#include "hash.h"
#include "keyindex.h"
#include "linrun.h"
#include "status.h"

static _Atomic int64_t g_served = 0;

int64_t dbsp_lingroup_served(void) { return atomic_load(&g_served); }

void dbsp_lingroup_free(DbspLinGroup *g) {
    free(g->tab); free(g->gh); free(g->gw); free(g->gpos); free(g->gfirst); free(g->qrow); free(g->ord);
    free(g->cnt); free(g->gs);
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
    g->qrow = malloc((size_t)rows * 4);
    g->ord = malloc((size_t)rows * 4);
    g->gs = malloc((size_t)(rows * ns) * 8);
    g->group_row = malloc((size_t)rows * 8);
    g->khash = malloc((size_t)rows * 8);
    g->ivals = malloc((size_t)(rows * ns) * 8);
    if (!g->tab || !g->cnt || !g->gh || !g->gw || !g->gpos || !g->gfirst || !g->qrow || !g->ord || !g->gs
        || !g->group_row || !g->khash || !g->ivals) {
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

/* the group of a row of key words w[0..nk) and hash h, made when new (invariant 2) */
static inline __attribute__((always_inline)) uint32_t group_of(DbspLinGroup *g, const uint64_t *w, int32_t nk,
                                                               uint64_t h, int64_t *ng, int64_t r) {
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
            return (uint32_t)n;
        }
        uint32_t q = e - 1;
        if (g->gh[q] != h) continue;
        int same = 1;
        for (int32_t k = 0; k < nk; k++) same &= g->gw[(int64_t)q * nk + k] == w[k];
        if (same) return q;
    }
}

/* one slot's sums over the rows (row r in group qr[r], weight wt[r], 1 without weights), x row r's value: a tight
 * loop per kind of slot instead of a dispatch per row and slot; 0 when a product or a sum leaves int64 */
#define SUM_LOOP(x)                                                                                       \
    do {                                                                                                  \
        for (int64_t r = 0; r < n; r++) {                                                                 \
            int64_t p, *t = s + qr[r];                                                                    \
            ovf |= __builtin_mul_overflow((int64_t)(x), wt ? wt[r] : 1, &p) | __builtin_add_overflow(*t, p, t); \
        }                                                                                                 \
    } while (0)

static int sum_slot(int64_t *s, const uint32_t *qr, const int64_t *wt, int64_t n, int32_t src, const DbspColumn *c) {
    int ovf = 0;
    if (src == SRC_ONE) {
        if (!wt) {  /* every weight 1: a count of fewer than 2^31 rows */
            for (int64_t r = 0; r < n; r++) s[qr[r]]++;
            return 1;
        }
        for (int64_t r = 0; r < n; r++) ovf |= __builtin_add_overflow(s[qr[r]], wt[r], &s[qr[r]]);
        return !ovf;
    }
    const int64_t *v = c->type == DBSP_INT64 || c->type == DBSP_TIMESTAMP ? (const int64_t *)c->values + c->offset
                                                                           : NULL;
    if (src == SRC_HI) SUM_LOOP(v[r] >> 32);
    else if (src == SRC_LO) SUM_LOOP(v[r] & 0xFFFFFFFF);
    else if (v) SUM_LOOP(v[r]);
    else SUM_LOOP((int64_t)dbsp_col_u64(c, r));  /* a narrower integer column */
    return !ovf;
}

int dbsp_lingroup(DbspLinGroup *g, const DbspBatch *b, const int32_t *keys, int32_t nkeys, const DbspAggSpec *specs,
                  int32_t ns, int64_t *ng) {
    int32_t src[64], from[64];
    *ng = 0;
    if (!served(b, keys, nkeys, specs, ns, src)) return DBSP_LINGROUP_NO;
    const int64_t n = b->nrows;
    if (n == 0) {
        atomic_fetch_add(&g_served, 1);
        return DBSP_OK;
    }
    int st = reserve(g, n, nkeys, ns);
    if (st != DBSP_OK) return st;
    int64_t m = 0;
    uint32_t *qr = g->qrow;
    const DbspColumn *k0 = &b->cols[keys[0]];
    if (nkeys == 1 && (k0->type == DBSP_INT64 || k0->type == DBSP_UINT64 || k0->type == DBSP_TIMESTAMP)) {
        const uint64_t *kv = (const uint64_t *)k0->values + k0->offset;  /* the commonest key: one 64-bit integer */
        for (int64_t r = 0; r < n; r++) qr[r] = group_of(g, kv + r, 1, dbsp_hash_int_row(kv[r]), &m, r);
    } else {
        uint64_t w[DBSP_KEYINDEX_MAX_KEYS];
        for (int64_t r = 0; r < n; r++) {
            uint64_t h = DBSP_HASH_ROW_SEED, vh;
            for (int32_t k = 0; k < nkeys; k++) {
                w[k] = canon(&b->cols[keys[k]], r, &vh);
                h = dbsp_mix(h * DBSP_HASH_K_GOLD + vh);
            }
            qr[r] = group_of(g, w, nkeys, h, &m, r);
        }
    }
    for (int64_t q = 0; q < m; q++) g->tab[g->gpos[q]] = 0;  /* invariant 3: only the slots filled */
    /* the sums, slot-major (stride g->rows), one pass per slot; a slot counting rows as an earlier one does (a count
     * and a count of a column without nulls) is that one's */
    int ok = 1;
    for (int32_t j = 0; ok && j < ns; j++) {
        from[j] = j;
        for (int32_t i = 0; src[j] == SRC_ONE && i < j; i++)
            if (src[i] == SRC_ONE) { from[j] = i; break; }
        if (from[j] != j) continue;
        int64_t *s = g->gs + j * g->rows;
        for (int64_t q = 0; q < m; q++) s[q] = 0;
        ok = sum_slot(s, qr, b->weights, n, src[j], src[j] == SRC_ONE ? NULL : &b->cols[specs[j].col]);
    }
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
    }
    for (int32_t j = 0; j < ns; j++) {
        const int64_t *sj = g->gs + from[j] * g->rows;
        for (int64_t i = 0; i < m; i++) g->ivals[i * ns + j] = sj[g->ord[i]];
    }
    *ng = m;
    atomic_fetch_add(&g_served, 1);
    return DBSP_OK;
}
