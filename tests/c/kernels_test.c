/* kernels_test.c: unit tests of the Z-set kernels against naive reference computations, in plain C. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include "hash.h"
#include "zset.h"
#include "partition.h"
#include "join.h"
#include "reduce.h"
#include "lookup.h"
#include "keyindex.h"
#include "group.h"
#include "gather.h"
#include "split.h"
#include "timefmt.h"
#include "merge.h"

static int failures = 0;
#define CHECK(cond) do { if (!(cond)) { fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); failures++; } } while (0)

static uint64_t rng = 88172645463325252ULL;
static uint64_t next(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }

/* a two-column batch: nullable int64 k, nullable utf8 s */
typedef struct {
    int64_t n;
    int64_t *k; uint8_t *kvalid; int32_t *soff; char *sdata; uint8_t *svalid; int64_t *w;
    DbspColumn cols[2];
    DbspBatch b;
} TBatch;

static const char *WORDS[] = { "", "a", "b", "ab", "longer string value" };

static void set_bit(uint8_t *bm, int64_t i, int v) { if (v) bm[i >> 3] |= (uint8_t)(1 << (i & 7)); else bm[i >> 3] &= (uint8_t)~(1 << (i & 7)); }

static void tb_make(TBatch *t, int64_t n, int64_t kdom, int wlo, int whi) {
    t->n = n;
    t->k = malloc((size_t)(n ? n : 1) * 8); t->w = malloc((size_t)(n ? n : 1) * 8);
    t->kvalid = calloc((size_t)(n / 8 + 1), 1); t->svalid = calloc((size_t)(n / 8 + 1), 1);
    t->soff = malloc((size_t)(n + 1) * 4); t->sdata = malloc((size_t)(n * 20 + 1));
    int32_t off = 0;
    for (int64_t i = 0; i < n; i++) {
        t->k[i] = (int64_t)(next() % (uint64_t)kdom) - kdom / 2;
        set_bit(t->kvalid, i, next() % 10 != 0);
        int wi = (int)(next() % 5);
        set_bit(t->svalid, i, next() % 10 != 0);
        t->soff[i] = off;
        size_t l = strlen(WORDS[wi]);
        memcpy(t->sdata + off, WORDS[wi], l); off += (int32_t)l;
        t->w[i] = wlo + (int64_t)(next() % (uint64_t)(whi - wlo + 1));
    }
    t->soff[n] = off;
    t->cols[0] = (DbspColumn){ DBSP_INT64, 0, t->kvalid, t->k, NULL };
    t->cols[1] = (DbspColumn){ DBSP_UTF8, 0, t->svalid, t->soff, (const uint8_t *)t->sdata };
    t->b = (DbspBatch){ n, 2, t->cols, t->w };
}

static void tb_free(TBatch *t) { free(t->k); free(t->w); free(t->kvalid); free(t->svalid); free(t->soff); free(t->sdata); }

/* gather rows sel[0..m) of src (with weights w) into dst */
static void tb_gather(TBatch *dst, const TBatch *src, const int64_t *sel, const int64_t *w, int64_t m) {
    dst->n = m;
    dst->k = malloc((size_t)(m ? m : 1) * 8); dst->w = malloc((size_t)(m ? m : 1) * 8);
    dst->kvalid = calloc((size_t)(m / 8 + 1), 1); dst->svalid = calloc((size_t)(m / 8 + 1), 1);
    dst->soff = malloc((size_t)(m + 1) * 4); dst->sdata = malloc((size_t)(m * 20 + 1));
    int32_t off = 0;
    for (int64_t i = 0; i < m; i++) {
        int64_t r = sel[i];
        dst->k[i] = src->k[r]; dst->w[i] = w[i];
        set_bit(dst->kvalid, i, dbsp_bit(src->kvalid, r));
        set_bit(dst->svalid, i, dbsp_bit(src->svalid, r));
        int32_t l = src->soff[r + 1] - src->soff[r];
        dst->soff[i] = off; memcpy(dst->sdata + off, src->sdata + src->soff[r], (size_t)l); off += l;
    }
    dst->soff[m] = off;
    dst->cols[0] = (DbspColumn){ DBSP_INT64, 0, dst->kvalid, dst->k, NULL };
    dst->cols[1] = (DbspColumn){ DBSP_UTF8, 0, dst->svalid, dst->soff, (const uint8_t *)dst->sdata };
    dst->b = (DbspBatch){ m, 2, dst->cols, dst->w };
}

/* naive: total weight of rows of b equal to row i of a */
static int64_t naive_weight(const DbspBatch *b, const DbspBatch *a, int64_t i) {
    int64_t s = 0;
    for (int64_t j = 0; j < b->nrows; j++)
        if (dbsp_row_cmp(a, i, NULL, b, j, NULL, a->ncols) == 0) s += b->weights[j];
    return s;
}

static void test_consolidate(int64_t n, int64_t kdom, int keyed) {
    TBatch t; tb_make(&t, n, kdom, -2, 2);
    DbspRows r;
    int32_t key = 0;
    CHECK(dbsp_zset_consolidate(&t.b, keyed ? &key : NULL, keyed ? 1 : 0, &r) == DBSP_OK);
    CHECK(dbsp_rows_check_order(&t.b, r.idx, r.weights, r.khash, r.n, keyed ? &key : NULL, keyed ? 1 : 0) == 0);
    /* each output row carries its naive total; every input row with a non-zero total is represented */
    int64_t distinct_nonzero = 0, total = 0, got_total = 0;
    for (int64_t i = 0; i < n; i++) total += t.w[i];
    for (int64_t x = 0; x < r.n; x++) got_total += r.weights[x];
    CHECK(total == got_total);
    for (int64_t i = 0; i < (n <= 2000 ? n : 0); i++) {
        int first = 1;
        for (int64_t j = 0; j < i; j++) if (dbsp_row_cmp(&t.b, i, NULL, &t.b, j, NULL, 2) == 0) { first = 0; break; }
        if (first && naive_weight(&t.b, &t.b, i) != 0) distinct_nonzero++;
    }
    if (n <= 2000) CHECK(r.n == distinct_nonzero);
    for (int64_t x = 0; x < r.n; x++) CHECK(r.weights[x] == naive_weight(&t.b, &t.b, r.idx[x]));
    dbsp_rows_free(&r);
    tb_free(&t);
}

/* the sorting path for small batches (dbsp_small_rows) gives the grouping engine's result exactly: same rows,
 * representatives, weights, key hashes and order, or the same error */
static void consolidate_paths_on(TBatch *t, int keyed) {
    int32_t key = 0;
    DbspRows small, big;
    int64_t saved = dbsp_small_rows;
    dbsp_small_rows = t->n;
    int s1 = dbsp_zset_consolidate(&t->b, keyed ? &key : NULL, keyed ? 1 : 0, &small);
    dbsp_small_rows = 0;
    int s2 = dbsp_zset_consolidate(&t->b, keyed ? &key : NULL, keyed ? 1 : 0, &big);
    dbsp_small_rows = saved;
    CHECK(s1 == s2);
    if (s1 == DBSP_OK && s2 == DBSP_OK) {
        CHECK(small.n == big.n);
        for (int64_t x = 0; x < small.n && x < big.n; x++) {
            CHECK(small.idx[x] == big.idx[x]);
            CHECK(small.weights[x] == big.weights[x]);
            CHECK(small.khash[x] == big.khash[x]);
        }
        dbsp_rows_free(&small); dbsp_rows_free(&big);
    }
}

/* the sorting path for small batches (dbsp_small_rows) gives the grouping engine's result exactly: same rows,
 * representatives, weights, key hashes and order, or the same error */
static void test_consolidate_paths(int64_t n, int64_t kdom, int keyed, int wlo, int whi) {
    TBatch t; tb_make(&t, n, kdom, wlo, whi);
    consolidate_paths_on(&t, keyed);
    tb_free(&t);
}

static void test_consolidate_paths_overflow(void) {
    TBatch t; tb_make(&t, 8, 1, 1, 1);
    for (int64_t i = 0; i <= 8; i++) t.soff[i] = 0;  /* eight equal rows: (0, "") */
    for (int64_t i = 0; i < 8; i++) { t.k[i] = 0; set_bit(t.kvalid, i, 1); set_bit(t.svalid, i, 1); t.w[i] = INT64_MAX / 4; }
    int32_t key = 0;
    DbspRows r;
    dbsp_small_rows = 8;
    CHECK(dbsp_zset_consolidate(&t.b, &key, 1, &r) == DBSP_EOVERFLOW);
    dbsp_small_rows = DBSP_SMALL_ROWS;
    consolidate_paths_on(&t, 1);
    consolidate_paths_on(&t, 0);
    tb_free(&t);
}

/* weights outside int32 travel outside the grouping engine's entries: same sums as the naive model */
static void test_consolidate_far_weights(void) {
    TBatch t; tb_make(&t, 3000, 50, -2, 2);
    for (int64_t i = 0; i < t.n; i += 3) t.w[i] *= (int64_t)1 << 35;
    t.w[1] = INT32_MIN; t.w[2] = (int64_t)INT32_MAX + 1;
    DbspRows r;
    dbsp_small_rows = 0;  /* the grouping engine's entries (the sorting path is compared below) */
    CHECK(dbsp_zset_consolidate(&t.b, NULL, 0, &r) == DBSP_OK);
    dbsp_small_rows = DBSP_SMALL_ROWS;
    CHECK(dbsp_rows_check_order(&t.b, r.idx, r.weights, r.khash, r.n, NULL, 0) == 0);
    for (int64_t x = 0; x < r.n; x++) CHECK(r.weights[x] == naive_weight(&t.b, &t.b, r.idx[x]));
    int64_t total = 0, got = 0;
    for (int64_t i = 0; i < t.n; i++) total += t.w[i];
    for (int64_t x = 0; x < r.n; x++) got += r.weights[x];
    CHECK(total == got);
    dbsp_rows_free(&r);
    consolidate_paths_on(&t, 0);
    tb_free(&t);
}

static void test_merge(int keyed) {
    TBatch a0, b0, a, b;
    tb_make(&a0, 300, 40, -2, 2); tb_make(&b0, 250, 40, -2, 2);
    DbspRows ra, rb, m;
    int32_t key = 0;
    const int32_t *keys = keyed ? &key : NULL;
    int32_t nkeys = keyed ? 1 : 0;
    CHECK(dbsp_zset_consolidate(&a0.b, keys, nkeys, &ra) == DBSP_OK);
    CHECK(dbsp_zset_consolidate(&b0.b, keys, nkeys, &rb) == DBSP_OK);
    tb_gather(&a, &a0, ra.idx, ra.weights, ra.n);
    tb_gather(&b, &b0, rb.idx, rb.weights, rb.n);
    CHECK(dbsp_zset_merge(&a.b, ra.khash, &b.b, rb.khash, keys, nkeys, &m) == DBSP_OK);
    /* row hashes of both sides, computed whole-batch, to check the canonical order independently */
    uint64_t *arh = malloc((size_t)(a.n + 1) * 8), *brh = malloc((size_t)(b.n + 1) * 8);
    CHECK(dbsp_hash_columns(&a.b, NULL, 0, arh) == DBSP_OK);
    CHECK(dbsp_hash_columns(&b.b, NULL, 0, brh) == DBSP_OK);
    for (int64_t i = 0; i < a.n; i++) CHECK(dbsp_hash_row(&a.b, i, NULL, 0) == arh[i]);
    for (int64_t x = 0; x < m.n; x++) {
        int64_t src = m.idx[x];
        const DbspBatch *sb = src < a.n ? &a.b : &b.b;
        int64_t si = src < a.n ? src : src - a.n;
        CHECK(m.weights[x] == naive_weight(&a0.b, sb, si) + naive_weight(&b0.b, sb, si));
        CHECK(m.weights[x] != 0);
        if (x > 0) {
            int64_t ps = m.idx[x - 1];
            const DbspBatch *pb = ps < a.n ? &a.b : &b.b;
            int64_t pi = ps < a.n ? ps : ps - a.n;
            uint64_t prh = ps < a.n ? arh[pi] : brh[pi], crh = src < a.n ? arh[si] : brh[si];
            int ord = m.khash[x - 1] != m.khash[x] ? (m.khash[x - 1] < m.khash[x] ? -1 : 1)
                    : prh != crh ? (prh < crh ? -1 : 1) : dbsp_row_cmp(pb, pi, NULL, sb, si, NULL, 2);
            CHECK(ord < 0);
        }
    }
    /* every row with a non-zero total in a0 + b0 is in the merge */
    int64_t want = 0;
    for (int64_t i = 0; i < a.n; i++) if (naive_weight(&a0.b, &a.b, i) + naive_weight(&b0.b, &a.b, i) != 0) want++;
    for (int64_t j = 0; j < b.n; j++) if (naive_weight(&a.b, &b.b, j) == 0 && naive_weight(&b0.b, &b.b, j) != 0) want++;
    CHECK(m.n == want);
    free(arh); free(brh);
    dbsp_rows_free(&ra); dbsp_rows_free(&rb); dbsp_rows_free(&m);
    tb_free(&a0); tb_free(&b0); tb_free(&a); tb_free(&b);
}

/* dbsp_merge_cursor_step in random budgets writes exactly dbsp_zset_merge's rows (taken from a or b), weights and key
 * hashes, and a consistent Arrow layout (offsets, bits, null counts) */
static void test_merge_steps(int keyed, int64_t na0, int64_t nb0, int given_rh) {
    TBatch a0, b0, a, b;
    tb_make(&a0, na0, 40, -2, 2); tb_make(&b0, nb0, 40, -2, 2);
    DbspRows ra, rb, m;
    int32_t key = 0;
    const int32_t *keys = keyed ? &key : NULL;
    int32_t nkeys = keyed ? 1 : 0;
    CHECK(dbsp_zset_consolidate(&a0.b, keys, nkeys, &ra) == DBSP_OK);
    CHECK(dbsp_zset_consolidate(&b0.b, keys, nkeys, &rb) == DBSP_OK);
    tb_gather(&a, &a0, ra.idx, ra.weights, ra.n);
    tb_gather(&b, &b0, rb.idx, rb.weights, rb.n);
    CHECK(dbsp_zset_merge(&a.b, ra.khash, &b.b, rb.khash, keys, nkeys, &m) == DBSP_OK);
    int64_t cap = a.n + b.n, sz[3][2];
    DbspOutColumn out[2];
    memset(out, 0, sizeof out);
    for (int c = 0; c < 2; c++) {
        dbsp_merge_cursor_sizes(&a.cols[c], a.n, &b.cols[c], b.n, &sz[0][c], &sz[1][c], &sz[2][c]);
        CHECK(sz[0][c] == (cap + 7) / 8);  /* both sides have validity bitmaps */
        out[c].validity = malloc((size_t)sz[0][c] + 1);
        memset(out[c].validity, 0xff, (size_t)sz[0][c] + 1);  /* garbage: the kernel zeroes each new byte */
        out[c].values = malloc((size_t)sz[1][c] + 1);
        out[c].data = sz[2][c] || c == 1 ? malloc((size_t)sz[2][c] + 1) : NULL;
    }
    CHECK(sz[1][0] == cap * 8 && sz[1][1] == (cap + 1) * 4);
    CHECK(sz[2][1] == (int64_t)a.soff[a.n] + b.soff[b.n]);
    int64_t *w = malloc((size_t)(cap + 1) * 8);
    uint64_t *kh = malloc((size_t)(cap + 1) * 8), *rh = malloc((size_t)(cap + 1) * 8);
    uint64_t *arh = malloc((size_t)(a.n + 1) * 8), *brh = malloc((size_t)(b.n + 1) * 8);
    CHECK(dbsp_hash_columns(&a.b, NULL, 0, arh) == DBSP_OK);
    CHECK(dbsp_hash_columns(&b.b, NULL, 0, brh) == DBSP_OK);
    DbspMergeCursor st;
    CHECK(dbsp_merge_cursor_init(&a.b, &b.b, &st, out) == DBSP_OK);
    int guard = 0;
    while ((st.ia < a.n || st.ib < b.n) && guard++ < 100000) {
        int64_t before = st.ia + st.ib, budget = (int64_t)(next() % 7);
        CHECK(dbsp_merge_cursor_step(&a.b, ra.khash, given_rh & 1 ? arh : NULL, &b.b, rb.khash,
                                     given_rh & 2 ? brh : NULL, keys, nkeys, budget, &st, out, w, kh, rh) == DBSP_OK);
        CHECK(st.ia + st.ib >= before + budget || (st.ia == a.n && st.ib == b.n));
        CHECK(st.ia + st.ib <= before + budget + 1);  /* a pair of equal rows is consumed together */
    }
    CHECK(st.n == m.n);
    int64_t nulls[2] = { 0, 0 };
    for (int64_t x = 0; x < m.n && x < st.n; x++) {
        int64_t src = m.idx[x];
        const TBatch *sb = src < a.n ? &a : &b;
        int64_t si = src < a.n ? src : src - a.n;
        CHECK(w[x] == m.weights[x] && kh[x] == m.khash[x]);
        CHECK(rh[x] == (src < a.n ? arh[si] : brh[si]));
        int kv = dbsp_bit(out[0].validity, x), sv = dbsp_bit(out[1].validity, x);
        CHECK(kv == dbsp_bit(sb->kvalid, si) && sv == dbsp_bit(sb->svalid, si));
        nulls[0] += !kv; nulls[1] += !sv;
        CHECK(((int64_t *)out[0].values)[x] == sb->k[si]);
        const int32_t *oo = (const int32_t *)out[1].values;
        int32_t l = sb->soff[si + 1] - sb->soff[si];
        CHECK(oo[x + 1] - oo[x] == l && memcmp(out[1].data + oo[x], sb->sdata + sb->soff[si], (size_t)l) == 0);
    }
    CHECK(out[0].null_count == nulls[0] && out[1].null_count == nulls[1]);
    for (int64_t x = st.n; x < ((st.n + 7) & ~7); x++) CHECK(dbsp_bit(out[0].validity, x) == 0);
    for (int c = 0; c < 2; c++) { free(out[c].validity); free(out[c].values); free(out[c].data); }
    free(w); free(kh); free(rh); free(arh); free(brh);
    dbsp_rows_free(&ra); dbsp_rows_free(&rb); dbsp_rows_free(&m);
    tb_free(&a0); tb_free(&b0); tb_free(&a); tb_free(&b);
}

static void test_join_and_reduce(int64_t na, int64_t nb) {
    TBatch a0, b0, a, b;
    tb_make(&a0, na, 30, 1, 2); tb_make(&b0, nb, 30, -1, 2);
    int32_t key = 0;
    DbspRows ra, rb;
    CHECK(dbsp_zset_consolidate(&a0.b, &key, 1, &ra) == DBSP_OK);
    CHECK(dbsp_zset_consolidate(&b0.b, &key, 1, &rb) == DBSP_OK);
    tb_gather(&a, &a0, ra.idx, ra.weights, ra.n);
    tb_gather(&b, &b0, rb.idx, rb.weights, rb.n);
    uint64_t *af = malloc((size_t)(dbsp_fence_len(a.n) + 1) * 8), *bf = malloc((size_t)(dbsp_fence_len(b.n) + 1) * 8);
    for (int64_t k = 0; k < dbsp_fence_len(a.n); k++) af[k] = ra.khash[k << DBSP_FENCE_SHIFT];
    for (int64_t k = 0; k < dbsp_fence_len(b.n); k++) bf[k] = rb.khash[k << DBSP_FENCE_SHIFT];
    for (int outer = 0; outer < 4; outer++) {
        DbspPairs p;
        if (outer < 2) CHECK(dbsp_join(&a.b, ra.khash, &key, &b.b, rb.khash, &key, 1, outer, &p) == DBSP_OK);
        else CHECK(dbsp_join_fenced(&a.b, ra.khash, af, &key, &b.b, rb.khash, bf, &key, 1, outer - 2, &p) == DBSP_OK);
        int64_t npairs = 0, wsum = 0, unmatched = 0;
        for (int64_t x = 0; x < a.n; x++) {
            int m = 0;
            for (int64_t y = 0; y < b.n; y++)
                if (dbsp_bit(a.kvalid, x) && dbsp_bit(b.kvalid, y) && a.k[x] == b.k[y]) { npairs++; wsum += a.w[x] * b.w[y]; m = 1; }
            if (!m) unmatched++;
        }
        int64_t gw = 0, gpairs = 0, gun = 0;
        for (int64_t i = 0; i < p.n; i++) {
            if (p.ri[i] < 0) { gun++; continue; }
            gpairs++; gw += p.w[i];
            CHECK(a.k[p.li[i]] == b.k[p.ri[i]] && dbsp_bit(a.kvalid, p.li[i]) && dbsp_bit(b.kvalid, p.ri[i]));
        }
        CHECK(gpairs == npairs && gw == wsum);
        CHECK(gun == (outer & 1 ? unmatched : 0));
        dbsp_pairs_free(&p);
    }
    free(af); free(bf);
    /* hash join of the raw (unconsolidated) batches: the same pairs as a nested loop over raw rows */
    {
        DbspPairs p;
        CHECK(dbsp_hash_join(&a0.b, &key, &b0.b, &key, 1, 0, &p) == DBSP_OK);
        int64_t npairs = 0, wsum = 0, gw = 0;
        for (int64_t x = 0; x < a0.n; x++)
            for (int64_t y = 0; y < b0.n; y++)
                if (dbsp_bit(a0.kvalid, x) && dbsp_bit(b0.kvalid, y) && a0.k[x] == b0.k[y]) { npairs++; wsum += a0.w[x] * b0.w[y]; }
        for (int64_t i = 0; i < p.n; i++) {
            gw += p.w[i];
            CHECK(a0.k[p.li[i]] == b0.k[p.ri[i]]);
        }
        CHECK(p.n == npairs && gw == wsum);
        dbsp_pairs_free(&p);
    }
    /* reduce: count, count_col, min, max of s per key */
    DbspAggSpec aggs[3] = { { DBSP_AGG_COUNT, -1 }, { DBSP_AGG_COUNT_COL, 1 }, { DBSP_AGG_MAX, 1 } };
    DbspReduceOut r;
    CHECK(dbsp_reduce(&b.b, rb.khash, &key, 1, aggs, 3, &r) == DBSP_OK);
    int64_t groups = 0;
    for (int64_t y = 0; y < b.n; y++) {
        int first = 1;
        for (int64_t z = 0; z < y; z++) if (dbsp_value_cmp(&b.cols[0], y, &b.cols[0], z) == 0) { first = 0; break; }
        groups += first;
    }
    CHECK(r.ngroups == groups);
    for (int64_t g = 0; g < r.ngroups; g++) {
        int64_t lead = r.group_row[g], cnt = 0, cc = 0, best = -1;
        for (int64_t y = 0; y < b.n; y++) {
            if (dbsp_value_cmp(&b.cols[0], y, &b.cols[0], lead) != 0) continue;
            cnt += b.w[y];
            if (dbsp_col_valid(&b.cols[1], y)) {
                cc += b.w[y];
                if (b.w[y] > 0 && (best < 0 || dbsp_value_cmp(&b.cols[1], y, &b.cols[1], best) > 0)) best = y;
            }
        }
        CHECK(r.ivals[g * 3 + 0] == cnt);
        CHECK(r.ivals[g * 3 + 1] == cc);
        CHECK(r.valid[g * 3 + 2] == (best >= 0));
        if (best >= 0) CHECK(dbsp_value_cmp(&b.cols[1], r.ivals[g * 3 + 2], &b.cols[1], best) == 0);
    }
    dbsp_reduce_free(&r);
    dbsp_rows_free(&ra); dbsp_rows_free(&rb);
    tb_free(&a0); tb_free(&b0); tb_free(&a); tb_free(&b);
}

static void test_partition(void) {
    int64_t n = 5000;
    uint64_t *h = malloc((size_t)n * 8);
    for (int64_t i = 0; i < n; i++) h[i] = next();
    int32_t map[8] = { 2, 0, 1, 1, 0, 2, 2, 0 };
    int64_t *perm = malloc((size_t)n * 8), off[4];
    CHECK(dbsp_partition(h, n, map, 3, 3, perm, off) == DBSP_OK);
    CHECK(off[0] == 0 && off[3] == n);
    char *seen = calloc((size_t)n, 1);
    for (int p = 0; p < 3; p++)
        for (int64_t x = off[p]; x < off[p + 1]; x++) {
            CHECK(map[h[perm[x]] >> 61] == p);
            if (x > off[p]) CHECK(perm[x] > perm[x - 1]);  /* stable */
            seen[perm[x]]++;
        }
    for (int64_t i = 0; i < n; i++) CHECK(seen[i] == 1);
    int32_t bad[2] = { 0, 3 };
    CHECK(dbsp_partition(h, n, bad, 1, 3, perm, off) == DBSP_EINVAL);
    free(h); free(perm); free(seen);
}

static void test_overflow_and_hash(void) {
    int64_t k[2] = { 7, 7 }, w[2] = { INT64_MAX, 1 };
    DbspColumn c = { DBSP_INT64, 0, NULL, k, NULL };
    DbspBatch b = { 2, 1, &c, w };
    DbspRows r;
    CHECK(dbsp_zset_consolidate(&b, NULL, 0, &r) == DBSP_EOVERFLOW);
    int64_t m[1] = { INT64_MIN }, o[1];
    CHECK(dbsp_weights_negate(m, 1, o) == DBSP_EOVERFLOW);
    /* hash v1: int32 and int64 of one value hash alike; known answer for int64 0 */
    int32_t k32[1] = { 7 };
    DbspColumn c32 = { DBSP_INT32, 0, NULL, k32, NULL };
    DbspBatch b32 = { 1, 1, &c32, NULL };
    uint64_t h64[2], h32[1];
    CHECK(dbsp_hash_columns(&b, NULL, 0, h64) == DBSP_OK);
    CHECK(dbsp_hash_columns(&b32, NULL, 0, h32) == DBSP_OK);
    CHECK(h64[0] == h32[0] && h64[1] == h64[0]);
    int64_t zero[1] = { 0 };
    DbspColumn cz = { DBSP_INT64, 0, NULL, zero, NULL };
    DbspBatch bz = { 1, 1, &cz, NULL };
    uint64_t hz;
    dbsp_hash_columns(&bz, NULL, 0, &hz);
    uint64_t want = dbsp_hash_mix(0x082efa98ec4e6c89ULL * 0x9e3779b97f4a7c15ULL + dbsp_hash_mix(0 ^ 0x243f6a8885a308d3ULL));
    CHECK(hz == want);
}

/* lookup: against a linear scan, with duplicate wanted hashes, runs of equal batch hashes and empty inputs */
static void test_lookup(void) {
    for (int rep = 0; rep < 20; rep++) {
        int64_t n = rep == 0 ? 0 : (int64_t)(next() % 3000), nw = rep == 1 ? 0 : (int64_t)(next() % 200);
        uint64_t dom = 1 + next() % 5000;
        uint64_t *kh = malloc((size_t)(n ? n : 1) * 8), *want = malloc((size_t)(nw ? nw : 1) * 8);
        for (int64_t i = 0; i < n; i++) kh[i] = next() % dom;
        for (int64_t i = 0; i < nw; i++) want[i] = next() % dom;
        /* insertion sorts keep the test free of qsort callbacks */
        for (int64_t i = 1; i < n; i++) { uint64_t x = kh[i]; int64_t j = i - 1; while (j >= 0 && kh[j] > x) { kh[j + 1] = kh[j]; j--; } kh[j + 1] = x; }
        for (int64_t i = 1; i < nw; i++) { uint64_t x = want[i]; int64_t j = i - 1; while (j >= 0 && want[j] > x) { want[j + 1] = want[j]; j--; } want[j + 1] = x; }
        int64_t *idx, m;
        uint64_t *fence = malloc((size_t)(dbsp_fence_len(n) + 1) * 8);
        for (int64_t k = 0; k < dbsp_fence_len(n); k++) fence[k] = kh[k << DBSP_FENCE_SHIFT];
        for (int64_t t = 0; t < 50; t++) {  /* seek: first index >= lo with kh >= target, fenced or not */
            int64_t lo = n ? (int64_t)(next() % (uint64_t)(n + 1)) : 0;
            uint64_t target = next() % (dom + 2);
            int64_t want_at = lo;
            while (want_at < n && kh[want_at] < target) want_at++;
            CHECK(dbsp_seek(kh, n, fence, lo, target) == want_at);
            CHECK(dbsp_seek(kh, n, NULL, lo, target) == want_at);
        }
        int64_t *fidx, fm;
        CHECK(dbsp_lookup_fenced(kh, n, fence, want, nw, &fidx, &fm) == DBSP_OK);
        CHECK(dbsp_lookup(kh, n, want, nw, &idx, &m) == DBSP_OK);
        CHECK(fm == m);
        for (int64_t x = 0; x < m && x < fm; x++) CHECK(fidx[x] == idx[x]);
        free(fidx); free(fence);
        int64_t expect = 0, at = 0;
        for (int64_t i = 0; i < n; i++) {
            int hit = 0;
            for (int64_t q = 0; q < nw; q++) if (want[q] == kh[i]) { hit = 1; break; }
            if (hit) { expect++; if (at < m) CHECK(idx[at] == i); at++; }
        }
        CHECK(m == expect);
        free(idx);
        if (nw >= 2) {  /* unsorted wanted hashes are refused */
            uint64_t t = want[0]; want[0] = want[nw - 1] + 1; 
            CHECK(dbsp_lookup(kh, n, want, nw, &idx, &m) == DBSP_EINVAL);
            want[0] = t;
        }
        free(kh); free(want);
    }
}

/* match_weights: for distinct's index (the whole row is the key) against a naive search of b */
static void test_match_weights(void) {
    TBatch a0, b0, a, b;
    tb_make(&a0, 300, 20, -2, 2); tb_make(&b0, 400, 20, -3, 3);
    DbspRows ra, rb;
    CHECK(dbsp_zset_consolidate(&a0.b, NULL, 0, &ra) == DBSP_OK);
    CHECK(dbsp_zset_consolidate(&b0.b, NULL, 0, &rb) == DBSP_OK);
    tb_gather(&a, &a0, ra.idx, ra.weights, ra.n);
    tb_gather(&b, &b0, rb.idx, rb.weights, rb.n);
    int64_t *acc = calloc((size_t)(a.n ? a.n : 1), 8);
    for (int64_t i = 0; i < a.n; i++) acc[i] = 5;
    CHECK(dbsp_match_weights(&a.b, ra.khash, &b.b, rb.khash, acc) == DBSP_OK);
    for (int64_t i = 0; i < a.n; i++) CHECK(acc[i] == 5 + naive_weight(&b.b, &a.b, i));
    uint64_t *bf = malloc((size_t)(dbsp_fence_len(b.n) + 1) * 8);
    for (int64_t k = 0; k < dbsp_fence_len(b.n); k++) bf[k] = rb.khash[k << DBSP_FENCE_SHIFT];
    CHECK(dbsp_match_weights_fenced(&a.b, ra.khash, &b.b, rb.khash, bf, acc) == DBSP_OK);
    for (int64_t i = 0; i < a.n; i++) CHECK(acc[i] == 5 + 2 * naive_weight(&b.b, &a.b, i));
    free(bf);
    /* overflow of an accumulator is reported */
    int64_t any = -1;
    for (int64_t i = 0; i < a.n && any < 0; i++) if (naive_weight(&b.b, &a.b, i) > 0) any = i;
    CHECK(any >= 0);
    for (int64_t i = 0; i < a.n; i++) acc[i] = INT64_MAX;
    CHECK(dbsp_match_weights(&a.b, ra.khash, &b.b, rb.khash, acc) == DBSP_EOVERFLOW);
    free(acc);
    dbsp_rows_free(&ra); dbsp_rows_free(&rb);
    tb_free(&a0); tb_free(&b0); tb_free(&a); tb_free(&b);
}

/* match_sums: per selected key of a, the weighted sum of b's int64 column over b's rows with an equal key */
static void test_match_sums(void) {
    TBatch a0, b0, b;
    tb_make(&a0, 200, 60, 1, 1); tb_make(&b0, 500, 60, -3, 3);
    int32_t key = 0, vcol = 0;
    DbspRows ga, rb;
    /* a's distinct keys in key-hash order: consolidating a's key column alone groups by key */
    DbspBatch akeys = { a0.n, 1, a0.cols, NULL };
    CHECK(dbsp_zset_consolidate(&akeys, NULL, 0, &ga) == DBSP_OK);
    CHECK(dbsp_zset_consolidate(&b0.b, &key, 1, &rb) == DBSP_OK);
    tb_gather(&b, &b0, rb.idx, rb.weights, rb.n);
    /* the sum column: b's k itself (int64, nullable: a null counts as 0) */
    int64_t *acc = calloc((size_t)(ga.n ? ga.n : 1), 8);
    uint64_t *bf = malloc((size_t)(dbsp_fence_len(b.n) + 1) * 8);
    for (int64_t k = 0; k < dbsp_fence_len(b.n); k++) bf[k] = rb.khash[k << DBSP_FENCE_SHIFT];
    CHECK(dbsp_match_sums(&a0.b, ga.khash, ga.idx, ga.n, &key, &b.b, rb.khash, NULL, &key, 1, &vcol, 1, acc) == DBSP_OK);
    CHECK(dbsp_match_sums(&a0.b, ga.khash, ga.idx, ga.n, &key, &b.b, rb.khash, bf, &key, 1, &vcol, 1, acc) == DBSP_OK);
    for (int64_t g = 0; g < ga.n; g++) acc[g] /= 2;
    free(bf);
    for (int64_t g = 0; g < ga.n; g++) {
        int64_t r = ga.idx[g], want = 0;
        for (int64_t y = 0; y < b0.n; y++)
            if (dbsp_value_cmp(&a0.cols[0], r, &b0.cols[0], y) == 0 && dbsp_bit(b0.kvalid, y)) want += b0.w[y] * b0.k[y];
        CHECK(acc[g] == want);
    }
    int32_t scol = 1;  /* a utf8 column cannot be summed */
    CHECK(dbsp_match_sums(&a0.b, ga.khash, ga.idx, ga.n, &key, &b.b, rb.khash, NULL, &key, 1, &scol, 1, acc) == DBSP_ETYPE);
    free(acc);
    dbsp_rows_free(&ga); dbsp_rows_free(&rb);
    tb_free(&a0); tb_free(&b0); tb_free(&b);
}

/* group_reduce_all keeps groups whose weights sum to 0; group_reduce drops them; the sums agree */
static void test_group_reduce_all(void) {
    int64_t k[4] = { 1, 1, 2, 3 }, v[4] = { 5, 7, 4, 9 }, w[4] = { 1, -1, 1, 2 };
    DbspColumn cols[2] = { { DBSP_INT64, 0, NULL, k, NULL }, { DBSP_INT64, 0, NULL, v, NULL } };
    DbspBatch b = { 4, 2, cols, w };
    int32_t key = 0;
    DbspAggSpec aggs[2] = { { DBSP_AGG_COUNT, -1 }, { DBSP_AGG_SUM, 1 } };
    DbspReduceOut all, some;
    CHECK(dbsp_group_reduce_all(&b, &key, 1, aggs, 2, &all) == DBSP_OK);
    CHECK(dbsp_group_reduce(&b, &key, 1, aggs, 2, &some) == DBSP_OK);
    CHECK(all.ngroups == 3 && some.ngroups == 2);
    int64_t seen = 0;
    for (int64_t g = 0; g < all.ngroups; g++) {
        int64_t kk = k[all.group_row[g]];
        if (kk == 1) { CHECK(all.ivals[g * 2] == 0 && all.ivals[g * 2 + 1] == -2); seen |= 1; }
        if (kk == 2) { CHECK(all.ivals[g * 2] == 1 && all.ivals[g * 2 + 1] == 4); seen |= 2; }
        if (kk == 3) { CHECK(all.ivals[g * 2] == 2 && all.ivals[g * 2 + 1] == 18); seen |= 4; }
        if (g) CHECK((uint64_t)all.khash[g - 1] <= (uint64_t)all.khash[g]);
    }
    CHECK(seen == 7);
    dbsp_reduce_free(&all); dbsp_reduce_free(&some);
}

/* group_int.c against the general engine: the same batch with an all-valid validity bitmap on every column takes
 * the general path (dbsp_group_int_applies refuses nullable columns) and must give the same result, bit for bit */
static void check_group_int_case(int64_t n, uint64_t kdom, int ktype, int64_t wlo, int64_t whi, int big_vals) {
    int64_t *k = malloc((size_t)(n ? n : 1) * 8), *v = malloc((size_t)(n ? n : 1) * 8), *v2 = malloc((size_t)(n ? n : 1) * 8);
    int64_t *w = malloc((size_t)(n ? n : 1) * 8);
    uint8_t *ones = malloc((size_t)(n / 8 + 1));
    memset(ones, 0xff, (size_t)(n / 8 + 1));
    for (int64_t i = 0; i < n; i++) {
        k[i] = (int64_t)(next() % kdom) - (int64_t)(kdom / 2);
        v[i] = big_vals ? (int64_t)(next() >> 1) * (next() % 2 ? 1 : -1) : (int64_t)(next() % 2001) - 1000;
        v2[i] = (int64_t)(next() % 7);
        w[i] = wlo + (int64_t)(next() % (uint64_t)(whi - wlo + 1));
    }
    DbspColumn fast[3] = { { ktype, 0, NULL, k, NULL }, { DBSP_INT64, 0, NULL, v, NULL }, { DBSP_TIMESTAMP, 0, NULL, v2, NULL } };
    DbspColumn slow[3] = { { ktype, 0, ones, k, NULL }, { DBSP_INT64, 0, ones, v, NULL }, { DBSP_TIMESTAMP, 0, ones, v2, NULL } };
    DbspBatch bf = { n, 3, fast, w }, bs = { n, 3, slow, w };
    int32_t key = 0;
    DbspAggSpec specs[5][3] = {
        { { DBSP_AGG_SUM, 1 } },
        { { DBSP_AGG_COUNT, -1 }, { DBSP_AGG_SUM, 1 } },
        { { DBSP_AGG_SUM, 2 }, { DBSP_AGG_COUNT, -1 }, { DBSP_AGG_SUM, 1 } },
        { { DBSP_AGG_COUNT, -1 } },
        { { DBSP_AGG_SUM, 1 }, { DBSP_AGG_SUM, 1 }, { DBSP_AGG_SUM, 2 } },
    };
    int32_t nspecs[5] = { 1, 2, 3, 1, 3 };
    for (int s = 0; s < 5; s++)
        for (int all = 0; all < 2; all++) {
            CHECK(dbsp_group_int_applies(&bf, &key, 1, NULL, 0, specs[s], nspecs[s]) == 1);
            CHECK(dbsp_group_int_applies(&bs, &key, 1, NULL, 0, specs[s], nspecs[s]) == 0);
            DbspReduceOut rf, rs;
            int sf = all ? dbsp_group_reduce_all(&bf, &key, 1, specs[s], nspecs[s], &rf) : dbsp_group_reduce(&bf, &key, 1, specs[s], nspecs[s], &rf);
            int ss = all ? dbsp_group_reduce_all(&bs, &key, 1, specs[s], nspecs[s], &rs) : dbsp_group_reduce(&bs, &key, 1, specs[s], nspecs[s], &rs);
            CHECK(sf == ss);
            if (sf == DBSP_OK && ss == DBSP_OK) {
                CHECK(rf.ngroups == rs.ngroups);
                for (int64_t g = 0; g < rf.ngroups && g < rs.ngroups; g++) {
                    CHECK(rf.group_row[g] == rs.group_row[g]);
                    CHECK(rf.khash[g] == rs.khash[g]);
                    for (int32_t a = 0; a < nspecs[s]; a++) {
                        int64_t at = g * nspecs[s] + a;
                        CHECK(rf.ivals[at] == rs.ivals[at]);
                        CHECK(rf.valid[at] == rs.valid[at]);
                        CHECK(memcmp(&rf.fvals[at], &rs.fvals[at], 8) == 0);
                    }
                }
            }
            if (sf == DBSP_OK) dbsp_reduce_free(&rf);
            if (ss == DBSP_OK) dbsp_reduce_free(&rs);
        }
    /* consolidate of the key column alone (whole row, and keyed by it) */
    DbspBatch cf = { n, 1, fast, w }, cs = { n, 1, slow, w };
    for (int keyed = 0; keyed < 2; keyed++) {
        DbspRows of, os;
        int sf = dbsp_zset_consolidate(&cf, keyed ? &key : NULL, keyed, &of);
        int ss = dbsp_zset_consolidate(&cs, keyed ? &key : NULL, keyed, &os);
        CHECK(sf == ss);
        if (sf == DBSP_OK && ss == DBSP_OK) {
            CHECK(of.n == os.n);
            for (int64_t x = 0; x < of.n && x < os.n; x++)
                CHECK(of.idx[x] == os.idx[x] && of.weights[x] == os.weights[x] && of.khash[x] == os.khash[x]);
            CHECK(dbsp_rows_check_order(&cf, of.idx, of.weights, of.khash, of.n, keyed ? &key : NULL, keyed) == 0);
        }
        if (sf == DBSP_OK) dbsp_rows_free(&of);
        if (ss == DBSP_OK) dbsp_rows_free(&os);
    }
    free(k); free(v); free(v2); free(w); free(ones);
}

static void test_group_int(void) {
    check_group_int_case(0, 10, DBSP_INT64, -2, 2, 0);
    check_group_int_case(1, 10, DBSP_INT64, 1, 1, 0);
    check_group_int_case(300, 20, DBSP_INT64, -2, 2, 0);         /* zero-weight groups */
    check_group_int_case(3000, 1ULL << 62, DBSP_UINT64, 1, 3, 0); /* nearly all distinct */
    check_group_int_case(5000, 50, DBSP_TIMESTAMP, -3, 3, 1);    /* sums overflow */
    check_group_int_case(2000, 40, DBSP_INT64, -(1LL << 40), 1LL << 40, 0);  /* weights outside int32: general path */
    check_group_int_case(150000, 9000, DBSP_INT64, -1, 2, 0);    /* several partitions, tables that grow */
    check_group_int_case(140000, 140000, DBSP_INT64, 1, 1, 0);
    /* sums are exact whatever the row order: MAX + 1 - 1 and MAX - 1 + 1 are both MAX; MAX + 1 overflows */
    int64_t k[3] = { 4, 4, 4 }, up[3] = { INT64_MAX, 1, -1 }, down[3] = { INT64_MAX, -1, 1 }, wt[3] = { 1, 1, 1 };
    DbspColumn cu[2] = { { DBSP_INT64, 0, NULL, k, NULL }, { DBSP_INT64, 0, NULL, up, NULL } };
    DbspColumn cd[2] = { { DBSP_INT64, 0, NULL, k, NULL }, { DBSP_INT64, 0, NULL, down, NULL } };
    DbspBatch bu = { 3, 2, cu, wt }, bd = { 3, 2, cd, wt };
    int32_t key = 0;
    DbspAggSpec sum = { DBSP_AGG_SUM, 1 };
    DbspReduceOut r;
    CHECK(dbsp_group_reduce(&bu, &key, 1, &sum, 1, &r) == DBSP_OK);
    CHECK(r.ngroups == 1 && r.ivals[0] == INT64_MAX && r.group_row[0] == 0);
    dbsp_reduce_free(&r);
    CHECK(dbsp_group_reduce(&bd, &key, 1, &sum, 1, &r) == DBSP_OK);
    CHECK(r.ngroups == 1 && r.ivals[0] == INT64_MAX && r.group_row[0] == 0);
    dbsp_reduce_free(&r);
    CHECK(dbsp_group_reduce(&bu, &key, 1, &sum, 1, &r) == DBSP_OK);
    dbsp_reduce_free(&r);
    bu.nrows = 2;  /* MAX + 1 */
    CHECK(dbsp_group_reduce(&bu, &key, 1, &sum, 1, &r) == DBSP_EOVERFLOW);
    /* weight sums likewise: [MAX, 1, -2] and [-2, 1, MAX] both consolidate to MAX - 1 */
    int64_t w1[3] = { INT64_MAX, 1, -2 }, w2[3] = { -2, 1, INT64_MAX };
    DbspColumn ck = { DBSP_INT64, 0, NULL, k, NULL };
    DbspBatch o1 = { 3, 1, &ck, w1 }, o2 = { 3, 1, &ck, w2 };
    for (int path = 0; path < 2; path++) {  /* the small-batch sort and the grouping engine */
        dbsp_small_rows = path ? 0 : DBSP_SMALL_ROWS;
        DbspRows x;
        CHECK(dbsp_zset_consolidate(&o1, NULL, 0, &x) == DBSP_OK);
        CHECK(x.n == 1 && x.weights[0] == INT64_MAX - 1);
        dbsp_rows_free(&x);
        CHECK(dbsp_zset_consolidate(&o2, NULL, 0, &x) == DBSP_OK);
        CHECK(x.n == 1 && x.weights[0] == INT64_MAX - 1);
        dbsp_rows_free(&x);
        o1.nrows = 2;
        CHECK(dbsp_zset_consolidate(&o1, NULL, 0, &x) == DBSP_EOVERFLOW);
        o1.nrows = 3;
    }
    dbsp_small_rows = DBSP_SMALL_ROWS;
    int64_t wbig[2] = { INT32_MAX, INT32_MAX }, kk[2] = { 9, 9 };  /* weight sums leave int32, not int64 */
    DbspColumn c1 = { DBSP_INT64, 0, NULL, kk, NULL };
    DbspBatch b1 = { 2, 1, &c1, wbig };
    DbspRows rows;
    CHECK(dbsp_zset_consolidate(&b1, NULL, 0, &rows) == DBSP_OK);
    CHECK(rows.n == 1 && rows.weights[0] == 2 * (int64_t)INT32_MAX);
    dbsp_rows_free(&rows);
}

/* gather: every column kind against a naive copy, at random indices with repeats, from a sliced batch */
/* split.h against a naive model: part `want` of s[0, len) split at sep, as (start, length), or start -1 */
static void naive_part(const uint8_t *s, int64_t len, const uint8_t *sep, int64_t seplen, int64_t want,
                       int64_t *start, int64_t *plen) {
    int64_t from = 0, part = 0, i = 0;
    *start = -1;
    while (1) {
        int64_t at = -1;
        for (i = from; i + seplen <= len; i++)
            if (memcmp(s + i, sep, (size_t)seplen) == 0) { at = i; break; }
        if (part == want) { *start = from; *plen = (at < 0 ? len : at) - from; return; }
        if (at < 0) return;
        from = at + seplen;
        part++;
    }
}

static void test_split(int64_t nrows, const char *sepstr) {
    /* strings of 0-24 bytes over {a, b, /} in a buffer of exactly the bytes in use (ASan sees any over-read),
     * some null, viewed from row 5 (a non-zero Arrow offset) */
    const uint8_t *sep = (const uint8_t *)sepstr;
    int64_t seplen = (int64_t)strlen(sepstr), off = 5, n = nrows - off;
    int32_t *soff = malloc((size_t)(nrows + 1) * 4);
    uint8_t *bytes = malloc((size_t)nrows * 24 + 1), *valid = calloc((size_t)(nrows / 8 + 1), 1);
    soff[0] = 0;
    for (int64_t i = 0; i < nrows; i++) {
        int32_t len = (int32_t)(next() % 25);
        for (int32_t b = 0; b < len; b++) bytes[soff[i] + b] = (uint8_t)"ab/"[next() % 3];
        soff[i + 1] = soff[i] + len;
        set_bit(valid, i, next() % 8 != 0);
    }
    bytes = realloc(bytes, (size_t)soff[nrows] + 1);
    DbspColumn col = { DBSP_UTF8, off, valid, soff, bytes };
    int64_t idx[4] = { 3, 0, 1, 0 };
    int32_t k = 4;
    int64_t *start = malloc((size_t)(n * k + 1) * 8), nulls[4], nbytes[4];
    int32_t *offs[4];
    uint8_t *vals[4];
    for (int32_t j = 0; j < k; j++) { offs[j] = malloc((size_t)(n + 1) * 4); vals[j] = malloc((size_t)(n / 8 + 1)); }
    CHECK(dbsp_split_locate(&col, n, sep, seplen, idx, k, start, offs, vals, nulls, nbytes) == DBSP_OK);
    for (int32_t j = 0; j < k; j++) {
        uint8_t *data = malloc((size_t)nbytes[j] + 1);
        CHECK(dbsp_split_copy(&col, n, start + j * n, offs[j], data) == DBSP_OK);
        int64_t want_nulls = 0;
        for (int64_t i = 0; i < n; i++) {
            int64_t ws = -1, wl = 0, len = 0;
            if (dbsp_col_valid(&col, i)) {
                const uint8_t *s = dbsp_col_bytes(&col, i, &len);
                naive_part(s, len, sep, seplen, idx[j], &ws, &wl);
                if (ws >= 0) ws += s - bytes;
            }
            want_nulls += ws < 0;
            CHECK(dbsp_bit(vals[j], i) == (ws >= 0));
            CHECK((int64_t)offs[j][i + 1] - offs[j][i] == (ws >= 0 ? wl : 0));
            if (ws >= 0) CHECK(memcmp(data + offs[j][i], bytes + ws, (size_t)wl) == 0);
        }
        CHECK(nulls[j] == want_nulls && offs[j][n] == nbytes[j]);
        free(data);
    }
    CHECK(dbsp_split_locate(&col, n, sep, 0, idx, k, start, offs, vals, nulls, nbytes) == DBSP_EINVAL);
    idx[0] = -1;
    CHECK(dbsp_split_locate(&col, n, sep, seplen, idx, k, start, offs, vals, nulls, nbytes) == DBSP_EINVAL);
    col.type = DBSP_LARGE_UTF8;
    CHECK(dbsp_split_locate(&col, n, sep, seplen, idx, k, start, offs, vals, nulls, nbytes) == DBSP_ETYPE);
    for (int32_t j = 0; j < k; j++) { free(offs[j]); free(vals[j]); }
    free(start); free(soff); free(bytes); free(valid);
}

/* timefmt.h against a naive calendar: the civil date of a day count by walking years and months from 1970 */
static int leap(int64_t y) { return (y % 4 == 0 && y % 100 != 0) || y % 400 == 0; }

static void naive_civil(int64_t days, int64_t *y, int *m, int *d) {
    static const int mdays[12] = { 31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31 };
    int64_t yy = 1970;
    while (days < 0) { yy--; days += 365 + leap(yy); }
    while (days >= 365 + leap(yy)) { days -= 365 + leap(yy); yy++; }
    int mm = 0;
    while (days >= mdays[mm] + (mm == 1 && leap(yy))) { days -= mdays[mm] + (mm == 1 && leap(yy)); mm++; }
    *y = yy; *m = mm + 1; *d = (int)days + 1;
}

static void test_timefmt(int width, int64_t upd) {
    /* values over years 0-9999 (a date32 or an int64 time of upd units a day), some null, viewed from row 3 */
    const char *fmt = "%Y-%m-%d|%H:%M %% x";
    const char *datefmt = "%d.%m.%Y%%";
    int date = width == 4;
    const char *f = date ? datefmt : fmt;
    int64_t nrows = 4000, off = 3, n = nrows - off, lo = -719528, hi = 2932896;  /* 0000-01-01 .. 9999-12-31 */
    int ns = upd > 86400000000LL;  /* int64 nanoseconds reach 1677-09-21 .. 2262-04-11 only */
    if (ns) { lo = -106000; hi = 106000; }
    int64_t *v64 = malloc((size_t)nrows * 8);
    int32_t *v32 = malloc((size_t)nrows * 4);
    uint8_t *valid = calloc((size_t)(nrows / 8 + 1), 1);
    for (int64_t i = 0; i < nrows; i++) {
        int64_t day = i < 8 ? (int64_t[]){ 0, -1, 1, lo, hi, 59, 60, -306 }[i] : lo + (int64_t)(next() % (uint64_t)(hi - lo + 1));
        if (i > 8 && i % 7 == 0) day = (i & 1) ? lo + (int64_t)(next() % 400) : hi - (int64_t)(next() % 400);
        int64_t within = date ? 0 : (int64_t)(next() % (uint64_t)upd);
        if (i % 11 == 0 && !date) within = upd - 1;
        v64[i] = day * upd + within;
        v32[i] = (int32_t)day;
        set_bit(valid, i, next() % 9 != 0);
    }
    int64_t w = dbsp_timefmt_width((const uint8_t *)f, (int64_t)strlen(f));
    CHECK(w == (date ? 11 : 20));
    int32_t *offs = malloc((size_t)(n + 1) * 4);
    uint8_t *data = malloc((size_t)(n * w + 1));
    const void *vals = date ? (const void *)(v32 + off) : (const void *)(v64 + off);
    CHECK(dbsp_timefmt(vals, width, valid, off, n, upd, (const uint8_t *)f, (int64_t)strlen(f), offs, data) == DBSP_OK);
    CHECK(offs[0] == 0);
    for (int64_t i = 0; i < n; i++) {
        int64_t r = i + off, y;
        int m, d;
        int64_t len = offs[i + 1] - offs[i];
        if (!dbsp_bit(valid, r)) { CHECK(len == 0); continue; }
        int64_t day = date ? v32[r] : v64[r] / upd, rem = date ? 0 : v64[r] % upd;
        if (rem < 0) { day--; rem += upd; }
        naive_civil(day, &y, &m, &d);
        int64_t minute = rem / (upd / 1440 ? upd / 1440 : 1);
        char want[64];
        if (date) snprintf(want, sizeof want, "%02d.%02d.%04lld%%", d, m, (long long)y);
        else snprintf(want, sizeof want, "%04lld-%02d-%02d|%02d:%02d %% x", (long long)y, m, d, (int)(minute / 60),
                      (int)(minute % 60));
        CHECK(len == w && (int64_t)strlen(want) == w && memcmp(data + offs[i], want, (size_t)w) == 0);
    }
    /* a year past 9999 or before 0, a bad format, a time field over dates: refused */
    int64_t past[2] = { (hi + 1) * upd, (lo - 1) * upd };
    int32_t past32[2] = { (int32_t)(hi + 1), (int32_t)(lo - 1) };
    for (int k = 0; k < 2 && !ns; k++)
        CHECK(dbsp_timefmt(date ? (const void *)(past32 + k) : (const void *)(past + k), width, NULL, 0, 1, upd,
                           (const uint8_t *)f, (int64_t)strlen(f), offs, data) == DBSP_ETOOBIG);
    CHECK(dbsp_timefmt(vals, width, NULL, 0, 1, upd, (const uint8_t *)"%S", 2, offs, data) == DBSP_EINVAL);
    CHECK(dbsp_timefmt(vals, width, NULL, 0, 1, upd, (const uint8_t *)"x%", 2, offs, data) == DBSP_EINVAL);
    CHECK(dbsp_timefmt(vals, width, NULL, 0, 1, 1000, (const uint8_t *)"%H", 2, offs, data) == DBSP_EINVAL);
    CHECK(dbsp_timefmt_width((const uint8_t *)"%q", 2) == -1);
    free(v64); free(v32); free(valid); free(offs); free(data);
}

static void test_gather(void) {
    TBatch t; tb_make(&t, 3000, 1000, 1, 1);
    int64_t off = 7, n = t.n - off, m = 5000;  /* view rows 7.. as the batch (non-zero Arrow offsets) */
    int64_t *idx = malloc((size_t)m * 8);
    for (int64_t i = 0; i < m; i++) idx[i] = (int64_t)(next() % (uint64_t)n);
    uint8_t *bools = calloc((size_t)(t.n / 8 + 1), 1);
    int16_t *i16 = malloc((size_t)t.n * 2);
    int64_t *loff = malloc((size_t)(t.n + 1) * 8);
    for (int64_t i = 0; i < t.n; i++) { set_bit(bools, i, (int)(next() & 1)); i16[i] = (int16_t)next(); }
    /* strings of 0-20 random bytes, the last ones short, in a buffer of exactly the bytes in use (ASan sees any
     * over-read of the 16-byte copies), with the last rows among the gathered ones */
    int32_t *soff = malloc((size_t)(t.n + 1) * 4);
    uint8_t *exact = malloc((size_t)t.n * 20 + 1);
    soff[0] = 0;
    for (int64_t i = 0; i < t.n; i++) {
        int32_t len = i >= t.n - 6 ? (int32_t)(i % 3) + 1 : (int32_t)(next() % 21);
        for (int32_t b = 0; b < len; b++) exact[soff[i] + b] = (uint8_t)next();
        soff[i + 1] = soff[i] + len;
    }
    exact = realloc(exact, (size_t)soff[t.n]);
    for (int64_t i = 0; i <= t.n; i++) loff[i] = soff[i];
    for (int64_t i = 0; i < 6; i++) idx[i] = n - 1 - i;
    DbspColumn cols[5] = {
        { DBSP_INT64, off, t.kvalid, t.k, NULL }, { DBSP_UTF8, off, t.svalid, soff, exact },
        { DBSP_BOOL, off, NULL, bools, NULL }, { DBSP_INT16, off, t.kvalid, i16, NULL },
        { DBSP_LARGE_BINARY, off, NULL, loff, exact },
    };
    CHECK(dbsp_gather_check(idx, m, n) == DBSP_OK);
    idx[m / 2] = n;
    CHECK(dbsp_gather_check(idx, m, n) == DBSP_EINVAL);
    idx[m / 2] = -1;
    CHECK(dbsp_gather_check(idx, m, n) == DBSP_EINVAL);
    idx[m / 2] = 0;
    uint8_t *validity = malloc((size_t)(m / 8 + 1)), *values = malloc((size_t)(m + 1) * 8);
    int64_t *src = malloc((size_t)m * 8);
    for (int c = 0; c < 5; c++) {
        int64_t nulls = -1, nbytes = -1;
        const DbspColumn *col = &cols[c];
        CHECK(dbsp_gather_column(col, idx, m, validity, values, src, &nulls, &nbytes) == DBSP_OK);
        int64_t want_nulls = 0;
        for (int64_t i = 0; i < m; i++) {
            int valid = dbsp_col_valid(col, idx[i]);
            want_nulls += !valid;
            if (col->validity) CHECK(dbsp_bit(validity, i) == valid);
        }
        CHECK(nulls == want_nulls);
        if (c == 0) for (int64_t i = 0; i < m; i++) CHECK(((int64_t *)values)[i] == t.k[off + idx[i]]);
        if (c == 2) for (int64_t i = 0; i < m; i++) CHECK(dbsp_bit(values, i) == dbsp_bit(bools, off + idx[i]));
        if (c == 3) for (int64_t i = 0; i < m; i++) CHECK(((int16_t *)values)[i] == i16[off + idx[i]]);
        if (c == 1 || c == 4) {
            uint8_t *data = malloc((size_t)nbytes + 16);
            CHECK(dbsp_gather_data(col, n, m, values, src, data) == DBSP_OK);
            int64_t at = 0;
            for (int64_t i = 0; i < m; i++) {
                int64_t len, o0 = c == 1 ? ((int32_t *)values)[i] : ((int64_t *)values)[i];
                int64_t o1 = c == 1 ? ((int32_t *)values)[i + 1] : ((int64_t *)values)[i + 1];
                const uint8_t *want = dbsp_col_bytes(col, idx[i], &len);
                CHECK(o0 == at && o1 - o0 == len && memcmp(data + o0, want, (size_t)len) == 0);
                at = o1;
            }
            CHECK(at == nbytes);
            free(data);
        } else {
            CHECK(nbytes == 0);
        }
    }
    free(idx); free(bools); free(i16); free(loff); free(validity); free(values); free(src); free(exact); free(soff);
    tb_free(&t);
}

/* the key index (keyindex.h) against naive sums: weight and weight * k per key k (null = null), after adds and
 * removals, with every invariant checked; emptied, it holds nothing */
static void test_keyindex(int64_t n, int64_t kdom) {
    TBatch t;
    tb_make(&t, n, kdom, -2, 2);
    int32_t key = 0, types[1] = { DBSP_INT64 }, cols[2] = { -1, 0 };
    uint64_t *kh = malloc((size_t)(n ? n : 1) * 8);
    CHECK(dbsp_hash_columns(&t.b, &key, 1, kh) == DBSP_OK);
    DbspKeyIndex *ix = NULL;
    CHECK(dbsp_keyindex_new(types, 1, 2, 0, &ix) == DBSP_OK);
    CHECK(dbsp_keyindex_add(ix, &t.b, &key, kh, cols, 1) == DBSP_OK);
    CHECK(dbsp_keyindex_check(ix) == DBSP_OK);
    int64_t *acc = calloc((size_t)(n ? n : 1) * 2, 8);
    CHECK(dbsp_keyindex_get(ix, &t.b, &key, NULL, kh, n, acc) == DBSP_OK);
    int64_t live = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t w = 0, wk = 0, first = 1;
        for (int64_t j = 0; j < n; j++) {
            if (dbsp_value_cmp(&t.cols[0], i, &t.cols[0], j) != 0) continue;
            if (j < i) first = 0;
            w += t.w[j];
            wk += t.w[j] * (dbsp_col_valid(&t.cols[0], j) ? t.k[j] : 0);
        }
        CHECK(acc[2 * i] == w && acc[2 * i + 1] == wk);
        live += first && (w != 0 || wk != 0);
    }
    CHECK(dbsp_keyindex_len(ix) == live);
    CHECK(dbsp_keyindex_add(ix, &t.b, &key, kh, cols, -1) == DBSP_OK);  /* every row out again */
    CHECK(dbsp_keyindex_len(ix) == 0 && dbsp_keyindex_check(ix) == DBSP_OK);
    int32_t bad[1] = { DBSP_TYPE_END };  /* no such type (strings are keys: keyindex.h invariant 8) */
    DbspKeyIndex *no = NULL;
    CHECK(dbsp_keyindex_new(bad, 1, 1, 0, &no) == DBSP_ETYPE && no == NULL);
    DbspKeyIndex *small = NULL;  /* a limit of 4 KiB: 128 slots of 4 words (head, key, two sums) fit, 256 do not */
    CHECK(dbsp_keyindex_new(types, 1, 2, 4096, &small) == DBSP_OK);
    if (n > 1000) CHECK(dbsp_keyindex_add(small, &t.b, &key, kh, cols, 1) == DBSP_ETOOBIG);
    dbsp_keyindex_free(small);
    dbsp_keyindex_free(ix);
    free(acc); free(kh); tb_free(&t);
}

/* the key index over (int64, utf8) keys (keyindex.h invariant 8) with every key hash cut to `bits` bits, so that
 * distinct keys share tags and only their bytes tell them apart: rounds of adds and removals of random batches
 * (removed keys' records become garbage, compacted as new ones come), each checked against naive sums (row
 * identity: null = null, "" is not null) and every invariant; at the end everything is removed */
static void test_keyindex_strings(int64_t n, int64_t kdom, uint64_t bits, int rounds) {
    int32_t keys[2] = { 0, 1 }, types[2] = { DBSP_INT64, DBSP_UTF8 }, cols[2] = { -1, 0 };
    DbspKeyIndex *ix = NULL;
    CHECK(dbsp_keyindex_new(types, 2, 2, 0, &ix) == DBSP_OK);
    TBatch *all = calloc((size_t)rounds, sizeof *all);
    int *in = calloc((size_t)rounds, sizeof *in); /* whether a batch's rows are in the index */
    uint64_t **khs = calloc((size_t)rounds, sizeof *khs);
    for (int r = 0; r < rounds; r++) {
        tb_make(&all[r], n, kdom, -1, 2);
        khs[r] = malloc((size_t)(n ? n : 1) * 8);
        CHECK(dbsp_hash_columns(&all[r].b, keys, 2, khs[r]) == DBSP_OK);
        for (int64_t i = 0; i < n; i++) khs[r][i] &= (1ULL << bits) - 1;
        int back = r > 1 && next() % 3 == 0 ? (int)(next() % (uint64_t)r) : r; /* now and then one taken out */
        if (back < r && in[back]) {
            CHECK(dbsp_keyindex_add(ix, &all[back].b, keys, khs[back], cols, -1) == DBSP_OK);
            in[back] = 0;
        } else {
            CHECK(dbsp_keyindex_add(ix, &all[r].b, keys, khs[r], cols, 1) == DBSP_OK);
            in[r] = 1;
        }
        CHECK(dbsp_keyindex_check(ix) == DBSP_OK);
        /* naive sums over the batches in, for every row of this round's batch */
        TBatch *t = &all[r];
        int64_t m = t->n;
        int64_t *acc = calloc((size_t)(m ? m : 1) * 2, 8);
        CHECK(dbsp_keyindex_get(ix, &t->b, keys, NULL, khs[r], m, acc) == DBSP_OK);
        for (int64_t i = 0; i < m; i++) {
            int64_t w = 0, wk = 0;
            for (int q = 0; q <= r; q++) {
                if (!in[q]) continue;
                for (int64_t j = 0; j < all[q].n; j++) {
                    if (dbsp_row_cmp(&t->b, i, keys, &all[q].b, j, keys, 2) != 0) continue;
                    w += all[q].w[j];
                    wk += all[q].w[j] * (dbsp_col_valid(&all[q].cols[0], j) ? all[q].k[j] : 0);
                }
            }
            CHECK(acc[2 * i] == w && acc[2 * i + 1] == wk);
        }
        free(acc);
    }
    for (int r = 0; r < rounds; r++) {
        if (in[r]) CHECK(dbsp_keyindex_add(ix, &all[r].b, keys, khs[r], cols, -1) == DBSP_OK);
        tb_free(&all[r]);
        free(khs[r]);
    }
    CHECK(dbsp_keyindex_len(ix) == 0 && dbsp_keyindex_check(ix) == DBSP_OK);
    dbsp_keyindex_free(ix);
    free(all); free(khs); free(in);
}

/* the key index growing a few slots per row (keyindex.h invariant 5): rows added in small chunks, every invariant
 * checked after each, give the sums of one bulk add of the same rows (checked against naive sums above), and
 * taking every row out again in chunks empties it */
static void test_keyindex_growing(int64_t n, int64_t kdom, int64_t chunk) {
    TBatch t;
    tb_make(&t, n, kdom, -2, 2);
    int32_t key = 0, types[1] = { DBSP_INT64 }, cols[2] = { -1, 0 };
    uint64_t *kh = malloc((size_t)n * 8);
    CHECK(dbsp_hash_columns(&t.b, &key, 1, kh) == DBSP_OK);
    DbspKeyIndex *bulk = NULL, *ix = NULL;
    CHECK(dbsp_keyindex_new(types, 1, 2, 0, &bulk) == DBSP_OK && dbsp_keyindex_new(types, 1, 2, 0, &ix) == DBSP_OK);
    CHECK(dbsp_keyindex_add(bulk, &t.b, &key, kh, cols, 1) == DBSP_OK);
    int growing = 0;
    for (int sign = 1; sign >= -1; sign -= 2) {
        for (int64_t s = 0; s < n; s += chunk) {
            DbspColumn c[2] = { t.cols[0], t.cols[1] };
            c[0].offset += s, c[1].offset += s;
            DbspBatch part = { n - s < chunk ? n - s : chunk, 2, c, t.w + s };
            CHECK(dbsp_keyindex_add(ix, &part, &key, kh + s, cols, sign) == DBSP_OK);
            CHECK(dbsp_keyindex_check(ix) == DBSP_OK);
            growing += dbsp_keyindex_growing(ix);
        }
        if (sign == 1) {
            int64_t *a = calloc((size_t)n * 2, 8), *b = calloc((size_t)n * 2, 8);
            CHECK(dbsp_keyindex_get(ix, &t.b, &key, NULL, kh, n, a) == DBSP_OK);
            CHECK(dbsp_keyindex_get(bulk, &t.b, &key, NULL, kh, n, b) == DBSP_OK);
            CHECK(memcmp(a, b, (size_t)n * 16) == 0 && dbsp_keyindex_len(ix) == dbsp_keyindex_len(bulk));
            free(a); free(b);
        }
    }
    CHECK(growing > 0);  /* the chunks met the index while it grew */
    CHECK(dbsp_keyindex_len(ix) == 0 && dbsp_keyindex_check(ix) == DBSP_OK);
    dbsp_keyindex_free(bulk);
    dbsp_keyindex_free(ix);
    free(kh); tb_free(&t);
}

int main(void) {
    test_consolidate(0, 10, 0);
    test_consolidate(1, 10, 0);
    for (int rep = 0; rep < 5; rep++) {
        test_consolidate(200, 8, 0);
        test_consolidate(400, 100, 1);
    }
    test_consolidate(70000, 500, 0); /* spans several partitions (naive check is O(n^2) only on output rows) */
    for (int rep = 0; rep < 20; rep++) {
        int64_t n = 1 + (int64_t)(next() % 3000);
        test_consolidate_paths(n, 1 + (int64_t)(next() % 200), rep & 1, -2, 2);
        test_consolidate_paths(n, 4, rep & 1, 1, 1);  /* few distinct rows: long runs in one bucket */
    }
    test_consolidate_paths_overflow();
    test_consolidate_far_weights();
    test_merge(0);
    test_merge(1);
    for (int rep = 0; rep < 16; rep++) {
        test_merge_steps(rep & 1, (int64_t)(next() % 400), 1 + (int64_t)(next() % 400), (rep >> 1) & 3);
    }
    test_merge_steps(1, 0, 50, 3);
    test_join_and_reduce(200, 300);
    test_join_and_reduce(12, 1500);  /* a small a against a large b: the batched seek */
    test_partition();
    test_overflow_and_hash();
    test_lookup();
    test_match_weights();
    test_match_sums();
    test_group_reduce_all();
    test_group_int();
    test_gather();
    test_split(3000, "/");
    test_split(3000, "a/");
    test_split(2000, "aa");  /* overlapping matches: "aaa" is "" and "a" */
    test_split(6, "/");
    test_timefmt(4, 1);
    test_timefmt(8, 86400LL);
    test_timefmt(8, 86400000LL);
    test_timefmt(8, 86400000000LL);
    test_timefmt(8, 86400000000000LL);
    test_timefmt(8, 86400LL * 7);  /* a unit the kernel has no constant for */
    test_keyindex(0, 10);
    test_keyindex(300, 40);
    test_keyindex(3000, 100000);  /* grows past several resizes */
    test_keyindex_growing(60000, 200000, 97);
    test_keyindex_growing(5000, 300, 7);  /* few keys: updates and removals while it grows */
    test_keyindex_strings(200, 40, 2, 12);  /* four tags: every probe meets other keys */
    test_keyindex_strings(2000, 3000, 28, 10);
    if (failures) { fprintf(stderr, "%d failures\n", failures); return 1; }
    printf("kernels_test: all checks passed\n");
    return 0;
}
