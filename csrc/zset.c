/* zset.c: consolidate (via the grouping engine of group.c), merge and negate for Z-set batches. */
#include <stdlib.h>
#include <string.h>
#include <assert.h>
#include "zset.h"
#include "group.h"
#include "hash.h"
#include "scratch.h"

/* ---- consolidate: small batches by sorting, large ones by the grouping engine ---- */

int64_t dbsp_small_rows = DBSP_SMALL_ROWS;

typedef struct { uint64_t kh, rh; int64_t idx; } SRec;

/* canonical order (rows.h invariant 2), then source row number: equal rows end up adjacent, in row order */
static inline int srec_cmp(const SRec *x, const SRec *y, const DbspBatch *b) {
    if (x->kh != y->kh) return x->kh < y->kh ? -1 : 1;
    if (x->rh != y->rh) return x->rh < y->rh ? -1 : 1;
    int c = dbsp_row_cmp(b, x->idx, NULL, b, y->idx, NULL, b->ncols);
    if (c) return c;
    return x->idx < y->idx ? -1 : (x->idx > y->idx);
}

static void srec_insertion_sort(SRec *a, int64_t n, const DbspBatch *b) {
    for (int64_t i = 1; i < n; i++) {
        SRec x = a[i];
        int64_t j = i - 1;
        while (j >= 0 && srec_cmp(&a[j], &x, b) > 0) { a[j + 1] = a[j]; j--; }
        a[j + 1] = x;
    }
}

/* The rows of t[0..n) (sorted by srec_cmp) consolidated into the output arrays from position *m on (room reserved by
 * the caller): equal rows' weights summed exactly (an overflow is reported for a sum, never a partial sum), zero sums
 * dropped, each kept row's row hash into orh unless NULL. A record whose neighbour differs in key or row hash (almost
 * every one) is a group of one row: kept as it is, without the comparison of values (the output arrays in locals,
 * which stores through a DbspRows would otherwise reload). */
static inline int srec_emit_to(const DbspBatch *b, const SRec *t, int64_t n, int64_t *oi, int64_t *ow, uint64_t *ok,
                               uint64_t *orh, int64_t *pm) {
    const int64_t *w = b->weights;
    int64_t m = *pm;
    for (int64_t i = 0; i < n;) {
        int64_t j = i + 1, sum = w ? w[t[i].idx] : 1;
        if (j < n && t[j].kh == t[i].kh && t[j].rh == t[i].rh) {
            int32_t carry = 0;
            while (j < n && t[j].kh == t[i].kh && t[j].rh == t[i].rh
                   && dbsp_row_cmp(b, t[i].idx, NULL, b, t[j].idx, NULL, b->ncols) == 0) {
                dbsp_add_exact(&sum, w ? w[t[j].idx] : 1, &carry);
                j++;
            }
            if (carry) { *pm = m; return DBSP_EOVERFLOW; }
        }
        if (sum != 0) {
            if (orh) orh[m] = t[i].rh;
            oi[m] = t[i].idx; ow[m] = sum; ok[m] = t[i].kh; m++;
        }
        i = j;
    }
    *pm = m;
    return DBSP_OK;
}

/* srec_emit_to appending to out (its room reserved here) */
static int srec_emit(const DbspBatch *b, const SRec *t, int64_t n, DbspRows *out, uint64_t *orh) {
    int st = dbsp_rows_reserve(out, n);
    return st ? st : srec_emit_to(b, t, n, out->idx, out->weights, out->khash, orh, &out->n);
}

/* (key hash, row hash, source row) order: rows of equal key and row hash are then ordered by value */
static int srec_rh_cmp(const void *x, const void *y) {
    const SRec *a = x, *b = y;
    if (a->kh != b->kh) return a->kh < b->kh ? -1 : 1;
    if (a->rh != b->rh) return a->rh < b->rh ? -1 : 1;
    return (a->idx > b->idx) - (a->idx < b->idx);
}

/* Sorts t[0..n) by srec_cmp: a long run (many rows of one key, or keys whose hashes collide) by key and row hash
 * first, then only its ties by value, so it costs O(n log n), not insertion sort's O(n^2). */
static void srec_sort_run(SRec *t, int64_t n, const DbspBatch *b) {
    if (n <= 32) {
        srec_insertion_sort(t, n, b);
        return;
    }
    qsort(t, (size_t)n, sizeof *t, srec_rh_cmp);
    for (int64_t i = 0; i < n;) {
        int64_t j = i + 1;
        while (j < n && t[j].rh == t[i].rh && t[j].kh == t[i].kh) j++;
        if (j - i > 1) srec_insertion_sort(t + i, j - i, b);  /* mostly equal rows, already in row order */
        i = j;
    }
}

/* Small-batch design notes:
 *  1. A batch of at most dbsp_small_rows rows is consolidated by sorting (key hash, row hash, row number)
 *     records: a counting pass on the top bits of the key hash spreads the (uniform) hashes into about one
 *     bucket per row, and each bucket is insertion-sorted with the full comparison (srec_cmp); a bucket of more
 *     than 32 rows (many rows of one key: a column of few values) is sorted by key and row hash first
 *     (srec_sort_run), not by insertion sort's O(n^2) comparisons.
 *  2. The result equals the grouping engine's bit for bit: the same canonical order, each group represented by
 *     its first source row, its weights summed exactly (rows.h dbsp_add_exact: an overflow is reported when a
 *     sum does not fit, whatever the row order), and
 *     zero sums dropped. It avoids the engine's fixed costs (partition tables, write-combining buffers, hash
 *     table clearing), which dominate below a few thousand rows.
 *  3. The rows are hashed once a column: a key of the batch's first columns in order (a join's key in its first
 *     column) gives the key hashes, which the row hashes continue over the other columns (hash.h: a row hash folds
 *     the columns in order, so its state after the key columns is the key hash), instead of a second pass over the
 *     key columns.
 *  4. Rows of different buckets differ in key hash, so a group of equal rows lies within one bucket: each bucket is
 *     sorted and emitted in the one walk over the buckets (a bucket of one row, the common case, is a group of one,
 *     kept unless its weight is 0; a bucket of two rows of different key hashes is two, ordered by one comparison),
 *     not by a second pass over every record.
 */
static int consolidate_small(const DbspBatch *b, const int32_t *keys, int32_t nkeys, DbspRows *out,
                             uint64_t *orh) {
    int64_t n = b->nrows;
    int st = DBSP_OK;
    int bits = 0;
    while (bits < 16 && ((int64_t)1 << bits) < n) bits++;
    int64_t nb = (int64_t)1 << bits;
    /* a key of the first columns in order hashes as the row's first columns: the row hash continues from the key
     * hash (note 3); a key of every column (a distinct's) is the whole row: its key hash is the row hash */
    int prefix = nkeys > 0 && nkeys <= b->ncols;
    for (int32_t k = 0; prefix && k < nkeys; k++) prefix = keys[k] == k;
    int whole = prefix && nkeys == b->ncols;
    uint64_t *rh = malloc((size_t)n * 8), *kh = nkeys && !whole ? malloc((size_t)n * 8) : NULL;
    SRec *t = malloc((size_t)n * sizeof(SRec));
    int64_t *cnt = calloc((size_t)nb + 1, 8);
    if (!rh || (nkeys && !whole && !kh) || !t || !cnt) { st = DBSP_ENOMEM; goto done; }
    if (prefix && !whole) {
        if ((st = dbsp_hash_columns(b, keys, nkeys, kh))) goto done;
        memcpy(rh, kh, (size_t)n * 8);
        int32_t rest[8], *more = b->ncols - nkeys <= 8 ? rest : malloc((size_t)(b->ncols - nkeys) * 4);
        if (!more) { st = DBSP_ENOMEM; goto done; }
        for (int32_t k = nkeys; k < b->ncols; k++) more[k - nkeys] = k;
        st = dbsp_hash_columns_more(b, more, b->ncols - nkeys, rh);
        if (more != rest) free(more);
        if (st) goto done;
    } else {
        if ((st = dbsp_hash_columns(b, NULL, 0, rh))) goto done;
        if (kh && (st = dbsp_hash_columns(b, keys, nkeys, kh))) goto done;
    }
    const uint64_t *pk = kh ? kh : rh;
#define BUCKET(h) (bits ? (int64_t)((h) >> (64 - bits)) : 0)
    for (int64_t i = 0; i < n; i++) cnt[BUCKET(pk[i]) + 1]++;
    for (int64_t k = 0; k < nb; k++) cnt[k + 1] += cnt[k];
    for (int64_t i = 0; i < n; i++) {
        SRec *x = &t[cnt[BUCKET(pk[i])]++];
        x->kh = pk[i]; x->rh = rh[i]; x->idx = i;
    }
#undef BUCKET
    /* note 4: each bucket sorted and emitted in one walk (rows of different buckets differ in key hash) */
    if ((st = dbsp_rows_reserve(out, n))) goto done;
    {
        int64_t *oi = out->idx, *ow = out->weights, m = out->n, s = 0;  /* cnt[k] is now the end of bucket k */
        uint64_t *ok = out->khash;
        const int64_t *w = b->weights;
        for (int64_t k = 0; k < nb; k++) {
            int64_t e = cnt[k];
#define EMIT_ONE(x) do {                                                         \
                int64_t sum_ = w ? w[(x)->idx] : 1;                              \
                if (sum_ != 0) {                                                 \
                    if (orh) orh[m] = (x)->rh;                                   \
                    oi[m] = (x)->idx; ow[m] = sum_; ok[m] = (x)->kh; m++;        \
                }                                                                \
            } while (0)
            if (e - s == 1) {  /* a group of one row */
                EMIT_ONE(&t[s]);
            } else if (e - s == 2 && t[s].kh != t[s + 1].kh) {  /* two groups of one row, in key-hash order */
                int lo = t[s].kh > t[s + 1].kh;
                EMIT_ONE(&t[s + lo]);
                EMIT_ONE(&t[s + 1 - lo]);
            } else if (e - s > 1) {
                srec_sort_run(t + s, e - s, b);  /* long buckets (many rows of a key): note 1 */
                if ((st = srec_emit_to(b, t + s, e - s, oi, ow, ok, orh, &m))) { out->n = m; goto done; }
            }
            s = e;
        }
#undef EMIT_ONE
        out->n = m;
    }
done:
    free(rh); free(kh); free(t); free(cnt);
    if (st) dbsp_rows_free(out);
    return st;
}

int dbsp_zset_consolidate(const DbspBatch *b, const int32_t *keys, int32_t nkeys, DbspRows *out) {
    return dbsp_zset_consolidate_rh(b, keys, nkeys, out, NULL);
}

int dbsp_zset_consolidate_rh(const DbspBatch *b, const int32_t *keys, int32_t nkeys, DbspRows *out,
                             uint64_t **rhash) {
    int st;
    if (rhash) *rhash = NULL;
    if (b->nrows > 0 && b->nrows <= dbsp_small_rows) {
        memset(out, 0, sizeof *out);
        for (int32_t k = 0; k < b->ncols; k++)
            if (dbsp_type_class(b->cols[k].type) == 0) return DBSP_ETYPE;
        for (int32_t k = 0; k < nkeys; k++)
            if (keys[k] < 0 || keys[k] >= b->ncols) return DBSP_EINVAL;
        uint64_t *rh = rhash ? malloc((size_t)b->nrows * 8) : NULL;
        if (rhash && !rh) return DBSP_ENOMEM;
        st = consolidate_small(b, keys, nkeys, out, rh);
        if (st == DBSP_OK && rhash) *rhash = rh;
        else free(rh);
    } else {
        st = dbsp_group_ih(b, NULL, 0, keys, nkeys, NULL, 0, 1, out, NULL, rhash);  /* identity = the whole row */
    }
#ifdef DBSP_CHECK_INVARIANTS
    if (st == DBSP_OK) assert(dbsp_rows_check_order(b, out->idx, out->weights, out->khash, out->n, keys, nkeys) == 0);
#endif
    return st;
}

int dbsp_zset_consolidate_runs(const DbspBatch *b, const uint64_t *kh, const int64_t *sel, int64_t n, DbspRows *out,
                               uint64_t *orh) {
    int st = DBSP_OK;
    memset(out, 0, sizeof *out);
    for (int32_t k = 0; k < b->ncols; k++)
        if (dbsp_type_class(b->cols[k].type) == 0) return DBSP_ETYPE;
    if (n < 0 || (!sel && n != b->nrows)) return DBSP_EINVAL;
    uint64_t *rh = malloc((size_t)(b->nrows ? b->nrows : 1) * 8);
    SRec *t = malloc((size_t)(n ? n : 1) * sizeof(SRec));
    if (!rh || !t) { st = DBSP_ENOMEM; goto done; }
    if ((st = dbsp_hash_columns(b, NULL, 0, rh))) goto done;
    for (int64_t i = 0; i < n; i++) {
        int64_t r = sel ? sel[i] : i;
        if (r < 0 || r >= b->nrows || (i && kh[r] < t[i - 1].kh)) { st = DBSP_EINVAL; goto done; }
        t[i].kh = kh[r]; t[i].rh = rh[r]; t[i].idx = r;
    }
    for (int64_t i = 0; i < n;) {
        int64_t j = i + 1;
        while (j < n && t[j].kh == t[i].kh) j++;
        if (j - i > 1) srec_sort_run(t + i, j - i, b);
        i = j;
    }
    st = srec_emit(b, t, n, out, orh);
done:
    free(rh); free(t);
    if (st) dbsp_rows_free(out);
    return st;
}

/* ---- merge ---- */

int dbsp_zset_merge(const DbspBatch *a, const uint64_t *akh, const DbspBatch *b, const uint64_t *bkh,
                    const int32_t *keys, int32_t nkeys, DbspRows *out) {
    int st = DBSP_OK;
    memset(out, 0, sizeof *out);
    if (a->ncols != b->ncols) return DBSP_EINVAL;
    for (int32_t c = 0; c < a->ncols; c++)
        if (dbsp_type_class(a->cols[c].type) != dbsp_type_class(b->cols[c].type)) return DBSP_ETYPE;
#ifdef DBSP_CHECK_INVARIANTS
    assert(dbsp_rows_check_order(a, NULL, a->weights, akh, a->nrows, keys, nkeys) == 0);
    assert(dbsp_rows_check_order(b, NULL, b->weights, bkh, b->nrows, keys, nkeys) == 0);
#endif
    if ((st = dbsp_rows_reserve(out, a->nrows + b->nrows))) goto done;
    int64_t i = 0, j = 0, na = a->nrows, nb = b->nrows;
    const int64_t *aw = a->weights, *bw = b->weights;
    /* With a key, rows of equal key hash are ordered by row hash: it is computed only for rows whose key hash
     * occurs on both sides (one row hash per row, remembered while the walk stays on it), not for every row. */
    int64_t arh_at = -1, brh_at = -1;
    uint64_t arh = 0, brh = 0;
    while (i < na || j < nb) {
        int c;
        if (i == na) c = 1;
        else if (j == nb) c = -1;
        else if (akh[i] != bkh[j]) c = akh[i] < bkh[j] ? -1 : 1;
        else {
            if (nkeys > 0) {
                if (arh_at != i) { arh = dbsp_hash_row(a, i, NULL, 0); arh_at = i; }
                if (brh_at != j) { brh = dbsp_hash_row(b, j, NULL, 0); brh_at = j; }
            } else {
                arh = akh[i]; brh = bkh[j];
            }
            c = arh != brh ? (arh < brh ? -1 : 1) : dbsp_row_cmp(a, i, NULL, b, j, NULL, a->ncols);
        }
        int64_t k = out->n;
        if (c < 0) {
            out->idx[k] = i; out->weights[k] = aw ? aw[i] : 1; out->khash[k] = akh[i]; out->n++; i++;
        } else if (c > 0) {
            out->idx[k] = na + j; out->weights[k] = bw ? bw[j] : 1; out->khash[k] = bkh[j]; out->n++; j++;
        } else {
            int64_t w = aw ? aw[i] : 1;
            if ((st = dbsp_add_weight(&w, bw ? bw[j] : 1))) goto done;
            if (w != 0) { out->idx[k] = i; out->weights[k] = w; out->khash[k] = akh[i]; out->n++; }
            i++; j++;
        }
    }
done:
    if (st) dbsp_rows_free(out);
    return st;
}

int dbsp_weights_negate(const int64_t *w, int64_t n, int64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        if (w[i] == INT64_MIN) return DBSP_EOVERFLOW;
        out[i] = -w[i];
    }
    return DBSP_OK;
}

int dbsp_rows_check_order(const DbspBatch *b, const int64_t *sel, const int64_t *weights, const uint64_t *khash,
                          int64_t n, const int32_t *keys, int32_t nkeys) {
    if (n == 0) return 0;
    int64_t nb = b->nrows;
    uint64_t *rh = malloc((size_t)(nb ? nb : 1) * 8), *kh = malloc((size_t)(nb ? nb : 1) * 8);
    int bad = 0;
    if (!rh || !kh) { free(rh); free(kh); return 0; }
    dbsp_hash_columns(b, NULL, 0, rh);
    if (nkeys) dbsp_hash_columns(b, keys, nkeys, kh); else memcpy(kh, rh, (size_t)nb * 8);
    for (int64_t t = 0; t < n && !bad; t++) {
        int64_t i = sel ? sel[t] : t;
        if (weights && weights[t] == 0) bad = 1;
        if (khash && khash[t] != kh[i]) bad = 1;
        if (t > 0) {
            int64_t p = sel ? sel[t - 1] : t - 1;
            int c = kh[p] != kh[i] ? (kh[p] < kh[i] ? -1 : 1)
                  : rh[p] != rh[i] ? (rh[p] < rh[i] ? -1 : 1)
                  : dbsp_row_cmp(b, p, NULL, b, i, NULL, b->ncols);
            if (c >= 0) bad = 1;
        }
    }
    free(rh); free(kh);
    return bad ? -1 : 0;
}

int dbsp_zset_sum_adjacent(const DbspBatch *b, const uint64_t *h, int64_t *idx, int64_t *w, int64_t *n) {
    int64_t k = 0, m = b->nrows;
    for (int64_t i = 0; i < m;) {
        int64_t s = b->weights ? b->weights[i] : 1, j = i + 1;
        while (j < m && h[j] == h[i] && dbsp_row_cmp_eqfast(b, i, NULL, b, j, NULL, b->ncols) == 0) {
            if (__builtin_add_overflow(s, b->weights ? b->weights[j] : 1, &s)) return DBSP_EOVERFLOW;
            j++;
        }
        if (s != 0) idx[k] = i, w[k] = s, k++;
        i = j;
    }
    *n = k;
    return DBSP_OK;
}

/* Distinct-rows design notes:
 *  1. One open-addressing table of 2^k >= 2n slots, indexed by the low bits of the row hash, holds per slot the
 *     high 32 bits of the hash of a group's first row beside its group number + 1 (0: an empty slot, so the
 *     table comes zeroed from calloc, no fill); a row probes from its slot until an empty one (a new group) or a
 *     slot of its hash's high bits whose group's first row has the same hash and equal values
 *     (dbsp_row_cmp_eqfast). Groups are numbered in order of their first row, so the kept rows come out in row
 *     order.
 *  2. A probe reads one slot, not the group's first row and its hash: with the hash's high bits in the slot, rows
 *     of different hashes almost never meet past it, and the slot of the row PREFETCH rows ahead is prefetched,
 *     so the table's cache misses overlap (a step's output of 1M rows: a table of 16 MiB, a miss per row).
 *  3. Rows only move when some are equal: with none (the common case of a step's output), the caller keeps the
 *     batch as it is, and this costs one probe per row, not the sort and gather of a consolidation.
 *  4., 5. and 6. Below, at dbsp_zset_hash_distinct and dbsp_zset_distinct_rows.
 */
enum { DISTINCT_PREFETCH = 16, DISTINCT_BLOCK = 512 };

/* Design note 4 (dbsp_zset_hash_distinct, dbsp_zset_distinct_rows): rows are hashed a block of DISTINCT_BLOCK at a
 * time, column by column, and that block is probed while its hashes are in L1: one pass over the rows where a
 * hash then a distinct walk them twice (a 1M-row output's 8 MiB of hashes stored and read back). A group's hash
 * (its first row's) and carry are set when the group is made; design note 1's table is the only memset. */

/* Design note 5 (dbsp_zset_distinct_rows): when nobody keeps the row hashes (a Z-set made distinct whose hashes no
 * sum reads: a step's output on one worker), the probe needs only a hash that equal rows share, not the row hash
 * of hash.h (two splitmix finalizers a value: ~32 instructions, 2/3 of a 3-column row's distinct check). The
 * probe hash folds a non-null integer value in with one multiply (acc = (acc ^ v) * K_GOLD) and any other value
 * (a null, a float, bytes) as its hash.h value hash, then mixes the row's accumulator once (the table's index is
 * its low bits). It lives only within the call; it is not a format and may change. */
enum { DISTINCT_FUSED_COLS = 8 };  /* the most columns probe_hash_fused folds a row of in registers */

/* Design note 6 (dbsp_zset_distinct_rows): when every column is a non-null 8-byte integer (int64, uint64,
 * timestamp) and there are at most DISTINCT_FUSED_COLS of them, a row's probe hash is folded across its columns in a
 * register (the same value as probe_hash_block's: the seed, then (acc ^ v) * K_GOLD per column, then one mix), not
 * by a pass per column that loads and stores every row's accumulator: a 64-bit multiply does not vectorize here, so
 * each pass cost ~8 instructions a row and column (a 3-column step's output: ~24 of its ~100 a row). */
static int probe_fused_cols(const DbspBatch *b, const uint64_t **vp) {
    if (b->ncols < 1 || b->ncols > DISTINCT_FUSED_COLS) return 0;
    for (int32_t ci = 0; ci < b->ncols; ci++) {
        const DbspColumn *c = &b->cols[ci];
        if (c->validity || !(c->type == DBSP_INT64 || c->type == DBSP_TIMESTAMP || c->type == DBSP_UINT64)) return 0;
        vp[ci] = (const uint64_t *)c->values + c->offset;
    }
    return 1;
}

static void probe_hash_fused(const uint64_t *const *vp, int32_t ncols, int64_t lo, int64_t n, uint64_t *h) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t acc = DBSP_HASH_ROW_SEED;
        for (int32_t ci = 0; ci < ncols; ci++) acc = (acc ^ vp[ci][lo + i]) * DBSP_HASH_K_GOLD;
        h[i] = dbsp_mix(acc);
    }
}

static void probe_hash_block(const DbspBatch *b, int64_t lo, int64_t n, uint64_t *h) {
    for (int64_t i = 0; i < n; i++) h[i] = DBSP_HASH_ROW_SEED;
    for (int32_t ci = 0; ci < b->ncols; ci++) {
        const DbspColumn *c = &b->cols[ci];
        int64_t o = c->offset + lo;
        if (!c->validity && (c->type == DBSP_INT64 || c->type == DBSP_TIMESTAMP || c->type == DBSP_UINT64)) {
            const uint64_t *v = (const uint64_t *)c->values + o;
            for (int64_t i = 0; i < n; i++) h[i] = (h[i] ^ v[i]) * DBSP_HASH_K_GOLD;
        } else if (!c->validity && (c->type == DBSP_INT32 || c->type == DBSP_DATE32)) {
            const int32_t *v = (const int32_t *)c->values + o;
            for (int64_t i = 0; i < n; i++) h[i] = (h[i] ^ (uint64_t)(int64_t)v[i]) * DBSP_HASH_K_GOLD;
        } else {
            for (int64_t i = 0; i < n; i++) h[i] = (h[i] ^ dbsp_hash_value(c, lo + i)) * DBSP_HASH_K_GOLD;
        }
    }
    for (int64_t i = 0; i < n; i++) h[i] = dbsp_mix(h[i]);
}

/* Design note 7 (dbsp_zset_distinct_rows): note 6's case (every column a non-null 8-byte integer, at most
 * DISTINCT_FUSED_COLS of them) has a pass of its own, distinct_fused: a slot's tag (the hash's high 32 bits) met,
 * the rows are compared column by column from the value pointers (no group hash kept to compare first, no generic
 * row comparison), a zero weight is noted as its row is placed (no second walk of the groups), and the slot of a
 * row DISTINCT_PREFETCH ahead is prefetched only when the table outgrows DISTINCT_PREFETCH_MIN bytes (a step's
 * output of 1k rows: a 16 KiB table, in L1 once touched, where the prefetch's hash load and address were ~7
 * instructions a row for nothing). Same result as distinct_pass: the groups numbered in row order, each at its
 * first row. */
enum { DISTINCT_PREFETCH_MIN = 1 << 18 };

static int distinct_fused(const DbspBatch *b, const uint64_t *const *vp, int64_t *idx, int64_t *w, int64_t *n) {
    const int64_t m = b->nrows;
    const int32_t nc = b->ncols;
    int64_t ng = 0;
    int64_t cap = 16;
    while (cap < 2 * m) cap <<= 1;
    const uint64_t mask = (uint64_t)cap - 1;
    uint64_t *slot = dbsp_scratch_alloc((size_t)cap * 8);
    int32_t *carry = dbsp_scratch_alloc((size_t)m * 4);
    uint64_t hb[DISTINCT_BLOCK];
    int st = DBSP_OK;
    if (!slot || !carry) { st = DBSP_ENOMEM; goto done; }
    memset(slot, 0, (size_t)cap * 8);
    const int64_t *bw = b->weights;
    const int prefetch = (size_t)cap * 8 >= DISTINCT_PREFETCH_MIN;
    int merged = 0, zero = 0;
    for (int64_t lo = 0; lo < m; lo += DISTINCT_BLOCK) {
        int64_t hi = lo + DISTINCT_BLOCK < m ? lo + DISTINCT_BLOCK : m;
        probe_hash_fused(vp, nc, lo, hi - lo, hb);
        for (int64_t i = lo; i < hi; i++) {
            if (prefetch && i + DISTINCT_PREFETCH < hi)
                __builtin_prefetch(&slot[hb[i + DISTINCT_PREFETCH - lo] & mask], 1);
            const uint64_t h = hb[i - lo], tag = h & 0xffffffff00000000ULL;
            const int64_t wi = bw ? bw[i] : 1;
            uint64_t p = h & mask;
            for (;;) {
                const uint64_t e = slot[p];
                if (e == 0) {  /* a new group, numbered in row order (design note 1) */
                    slot[p] = tag | (uint64_t)(ng + 1);
                    idx[ng] = i; w[ng] = wi; carry[ng] = 0;
                    ng++;
                    zero |= wi == 0;
                    break;
                }
                if ((e & 0xffffffff00000000ULL) == tag) {
                    const int64_t g = (int64_t)(e & 0xffffffffULL) - 1, j = idx[g];
                    int32_t ci = 0;
                    while (ci < nc && vp[ci][j] == vp[ci][i]) ci++;
                    if (ci == nc) {
                        dbsp_add_exact(&w[g], wi, &carry[g]);
                        merged = 1;
                        break;
                    }
                }
                p = (p + 1) & mask;
            }
        }
    }
    if (!merged && !zero) { *n = ng; goto done; }  /* every row its own group, none zero (a step's usual output) */
    int64_t k = 0;
    for (int64_t g = 0; g < ng; g++) {
        if (carry[g]) { st = DBSP_EOVERFLOW; goto done; }
        if (w[g] != 0) { idx[k] = idx[g]; w[k] = w[g]; k++; }
    }
    *n = k;
done:
    dbsp_scratch_free(slot, (size_t)cap * 8);
    dbsp_scratch_free(carry, (size_t)m * 4);
    return st;
}

enum { DISTINCT_GIVEN, DISTINCT_ROW_HASH, DISTINCT_PROBE_HASH };  /* where a row's hash comes from */

static int distinct_pass(const DbspBatch *b, const uint64_t *given, uint64_t *rh, int mode, int64_t *idx,
                         int64_t *w, int64_t *n) {
    int64_t m = b->nrows, ng = 0;
    *n = 0;
    if (m == 0) return DBSP_OK;
    if (m >= (int64_t)UINT32_MAX) return DBSP_ETOOBIG;
    for (int32_t c = 0; mode != DISTINCT_GIVEN && c < b->ncols; c++)  /* (a type no hash knows: before any work) */
        if (dbsp_type_class(b->cols[c].type) == 0) return DBSP_ETYPE;
    int64_t cap = 16;
    while (cap < 2 * m) cap <<= 1;
    const uint64_t mask = (uint64_t)cap - 1;
    /* the table, the groups' hashes and carries from this thread's scratch cache (scratch.h: reused across calls,
     * so a step's output does not fault a fresh table in); slot: (hash >> 32) << 32 | (group + 1), 0 empty (design
     * note 1) */
    uint64_t *slot = dbsp_scratch_alloc((size_t)cap * 8);
    uint64_t *gh = dbsp_scratch_alloc((size_t)m * 8);
    int32_t *carry = dbsp_scratch_alloc((size_t)m * 4);
    DbspColumn *bc = NULL;
    uint64_t hb[DISTINCT_BLOCK];  /* a block's probe hashes (design note 5) */
    int st = DBSP_OK;
    if (!slot || !gh || !carry) { st = DBSP_ENOMEM; goto done; }
    DbspBatch blk = *b;  /* a view of one block of rows (design note 4) */
    if (mode == DISTINCT_ROW_HASH && b->ncols > 0) {
        bc = malloc((size_t)b->ncols * sizeof(DbspColumn));
        if (!bc) { st = DBSP_ENOMEM; goto done; }
        memcpy(bc, b->cols, (size_t)b->ncols * sizeof(DbspColumn));
        blk.cols = bc;
    }
    memset(slot, 0, (size_t)cap * 8);
    const int64_t *bw = b->weights;
    int merged = 0;  /* a row met a group made before it (so a carry or a zero sum may have come up) */
    for (int64_t lo = 0; lo < m; lo += DISTINCT_BLOCK) {
        int64_t hi = lo + DISTINCT_BLOCK < m ? lo + DISTINCT_BLOCK : m;
        const uint64_t *hs;  /* hs[i - lo]: row i's hash */
        if (mode == DISTINCT_ROW_HASH) {
            blk.nrows = hi - lo;
            for (int32_t c = 0; c < b->ncols; c++) bc[c].offset = b->cols[c].offset + lo;
            st = dbsp_hash_columns(&blk, NULL, 0, rh + lo);
            if (st) goto done;
            hs = rh + lo;
        } else if (mode == DISTINCT_PROBE_HASH) {
            probe_hash_block(b, lo, hi - lo, hb);  /* (note 6's rows go to distinct_fused: note 7) */
            hs = hb;
        } else {
            hs = given + lo;
        }
        for (int64_t i = lo; i < hi; i++) {
            if (i + DISTINCT_PREFETCH < hi) __builtin_prefetch(&slot[hs[i + DISTINCT_PREFETCH - lo] & mask], 1);
            uint64_t h = hs[i - lo], p = h & mask, tag = h & 0xffffffff00000000ULL;
            int64_t g;
            for (;;) {
                uint64_t e = slot[p];
                if (e == 0) { g = -1; break; }
                g = (int64_t)(e & 0xffffffffULL) - 1;
                if ((e & 0xffffffff00000000ULL) == tag && gh[g] == h
                    && dbsp_row_cmp_eqfast(b, idx[g], NULL, b, i, NULL, b->ncols) == 0)
                    break;
                p = (p + 1) & mask;
            }
            if (g < 0) {  /* a new group, numbered in row order (design note 1) */
                g = ng++;
                slot[p] = tag | (uint64_t)(g + 1);
                idx[g] = i; w[g] = bw ? bw[i] : 1; gh[g] = h; carry[g] = 0;
            } else {
                dbsp_add_exact(&w[g], bw ? bw[i] : 1, &carry[g]);
                merged = 1;
            }
        }
    }
    int64_t k = 0;
    if (!merged) {  /* every row its own group (a step's usual output): no carry, so only a zero weight drops one; a
                     * check the compiler vectorizes, not the compaction's loads and stores of every group */
        int zero = 0;
        for (int64_t g = 0; g < ng; g++) zero |= w[g] == 0;
        if (!zero) { *n = ng; goto done; }
    }
    for (int64_t g = 0; g < ng; g++) {
        if (carry[g]) { st = DBSP_EOVERFLOW; goto done; }
        if (w[g] != 0) { idx[k] = idx[g]; w[k] = w[g]; k++; }
    }
    *n = k;
done:
    free(bc);
    dbsp_scratch_free(slot, (size_t)cap * 8);
    dbsp_scratch_free(gh, (size_t)m * 8);
    dbsp_scratch_free(carry, (size_t)m * 4);
    return st;
}

int dbsp_zset_distinct(const DbspBatch *b, const uint64_t *rh, int64_t *idx, int64_t *w, int64_t *n) {
    return distinct_pass(b, rh, NULL, DISTINCT_GIVEN, idx, w, n);
}

int dbsp_zset_hash_distinct(const DbspBatch *b, uint64_t *rh, int64_t *idx, int64_t *w, int64_t *n) {
    return distinct_pass(b, NULL, rh, DISTINCT_ROW_HASH, idx, w, n);
}

int dbsp_zset_distinct_rows(const DbspBatch *b, int64_t *idx, int64_t *w, int64_t *n) {
    const uint64_t *vp[DISTINCT_FUSED_COLS];
    *n = 0;
    if (b->nrows == 0) return DBSP_OK;
    if (b->nrows < (int64_t)UINT32_MAX && probe_fused_cols(b, vp))
        return distinct_fused(b, vp, idx, w, n);  /* design note 7 */
    return distinct_pass(b, NULL, NULL, DISTINCT_PROBE_HASH, idx, w, n);
}
