/* zset.c: consolidate, merge and negate for Z-set batches.
 *
 * Design notes (consolidate):
 *  1. Rows are radix-partitioned by the top bits of their key hash into partitions of about 32k rows, so the
 *     hash table of each partition (grown with its distinct rows) stays in cache, and concatenating the
 *     partitions keeps key-hash order.
 *  2. While scattering, each row is serialized into a partition-local arena in a canonical byte form
 *     (a null flag per nullable column, canonical float bits, u32 length + bytes for variable width), so
 *     row equality inside a partition is one memcmp on cache-resident bytes, never a random column access.
 *     Two rows are equal (column.h invariant 2) iff their serialized forms are equal.
 *  3. Each partition's distinct rows with non-zero weight are sorted canonically (rows.h invariant 2) and
 *     appended to the output; weight sums are overflow-checked.
 */
#include <stdlib.h>
#include <string.h>
#include <assert.h>
#include "zset.h"
#include "hash.h"
#ifdef DBSP_PROFILE
#include <stdio.h>
#include <time.h>
static double now_s(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define PROF(name) do{double t_=now_s();fprintf(stderr,"%-10s %.3f\n",name,t_-prof_t);prof_t=t_;}while(0)
#else
#define PROF(name)
#endif

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

/* ---- large scratch buffers: transparent huge pages cut page faults and TLB misses of the scatter ---- */

#include <sys/mman.h>

#define BIG_ALIGN ((size_t)2 << 20)

static void *big_alloc(size_t bytes) {
    if (bytes < BIG_ALIGN) return malloc(bytes ? bytes : 1);
    void *p = NULL;
    size_t sz = (bytes + BIG_ALIGN - 1) & ~(BIG_ALIGN - 1);
    if (posix_memalign(&p, BIG_ALIGN, sz)) return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, sz, MADV_HUGEPAGE);
#endif
    return p;
}

/* ---- canonical row serialization (design note 2) ---- */

static int64_t row_fixed_size(const DbspBatch *b, int *has_var) {
    int64_t f = 0;
    *has_var = 0;
    for (int32_t c = 0; c < b->ncols; c++) {
        const DbspColumn *col = &b->cols[c];
        int w = dbsp_type_width(col->type);
        if (col->validity) f += 1;
        if (w) f += w;
        else { f += 4; *has_var = 1; }
    }
    return f;
}

static inline int64_t row_var_size(const DbspBatch *b, int64_t i) {
    int64_t s = 0;
    for (int32_t c = 0; c < b->ncols; c++) {
        const DbspColumn *col = &b->cols[c];
        if (dbsp_type_class(col->type) == DBSP_CLASS_BYTES && dbsp_col_valid(col, i)) {
            int64_t len;
            (void)dbsp_col_bytes(col, i, &len);
            s += len;
        }
    }
    return s;
}

static inline uint8_t *serialize_row(const DbspBatch *b, int64_t i, uint8_t *p) {
    for (int32_t c = 0; c < b->ncols; c++) {
        const DbspColumn *col = &b->cols[c];
        int valid = dbsp_col_valid(col, i);
        if (col->validity) *p++ = (uint8_t)valid;
        int64_t k = col->offset + i;
        switch (col->type) {
        case DBSP_INT64: case DBSP_UINT64: case DBSP_TIMESTAMP: {
            uint64_t v = valid ? ((const uint64_t *)col->values)[k] : 0;
            memcpy(p, &v, 8); p += 8; break;
        }
        case DBSP_INT32: case DBSP_UINT32: case DBSP_DATE32: {
            uint32_t v = valid ? ((const uint32_t *)col->values)[k] : 0;
            memcpy(p, &v, 4); p += 4; break;
        }
        case DBSP_INT16: case DBSP_UINT16: {
            uint16_t v = valid ? ((const uint16_t *)col->values)[k] : 0;
            memcpy(p, &v, 2); p += 2; break;
        }
        case DBSP_INT8: case DBSP_UINT8:
            *p++ = valid ? ((const uint8_t *)col->values)[k] : 0; break;
        case DBSP_BOOL:
            *p++ = valid ? (uint8_t)dbsp_bit((const uint8_t *)col->values, k) : 0; break;
        case DBSP_FLOAT64: {
            uint64_t v = valid ? dbsp_canon_f64_bits(((const double *)col->values)[k]) : 0;
            memcpy(p, &v, 8); p += 8; break;
        }
        case DBSP_FLOAT32: {
            float f = valid ? ((const float *)col->values)[k] : 0.0f;
            uint32_t v;
            if (f == 0.0f) v = 0;
            else if (f != f) v = 0x7fc00000u;
            else memcpy(&v, &f, 4);
            memcpy(p, &v, 4); p += 4; break;
        }
        default: {
            int64_t len = 0;
            const uint8_t *s = valid ? dbsp_col_bytes(col, i, &len) : NULL;
            uint32_t l32 = (uint32_t)len;
            memcpy(p, &l32, 4); p += 4;
            if (len) { memcpy(p, s, (size_t)len); p += len; }
        }
        }
    }
    return p;
}

/* ---- canonical sort of partition-local records ---- */

typedef struct { uint64_t kh, rh; int64_t idx, w; } Rec;

typedef struct { const DbspBatch *b; } SortCtx;

static inline int rec_cmp(const Rec *x, const Rec *y, const SortCtx *ctx) {
    if (x->kh != y->kh) return x->kh < y->kh ? -1 : 1;
    if (x->rh != y->rh) return x->rh < y->rh ? -1 : 1;
    return dbsp_row_cmp(ctx->b, x->idx, NULL, ctx->b, y->idx, NULL, ctx->b->ncols);
}

static void rec_sort(Rec *a, int64_t n, const SortCtx *ctx) {
    while (n > 16) {
        /* median of three pivot, Hoare partition */
        Rec *m = a + n / 2, *l = a, *r = a + n - 1, t;
        if (rec_cmp(m, l, ctx) < 0) { t = *m; *m = *l; *l = t; }
        if (rec_cmp(r, m, ctx) < 0) { t = *r; *r = *m; *m = t; if (rec_cmp(m, l, ctx) < 0) { t = *m; *m = *l; *l = t; } }
        Rec pivot = *m;
        int64_t i = -1, j = n;
        for (;;) {
            do i++; while (rec_cmp(&a[i], &pivot, ctx) < 0);
            do j--; while (rec_cmp(&a[j], &pivot, ctx) > 0);
            if (i >= j) break;
            t = a[i]; a[i] = a[j]; a[j] = t;
        }
        /* recurse on the smaller side, loop on the larger */
        if (j + 1 < n - j - 1) { rec_sort(a, j + 1, ctx); a += j + 1; n -= j + 1; }
        else { rec_sort(a + j + 1, n - j - 1, ctx); n = j + 1; }
    }
    for (int64_t i = 1; i < n; i++) {
        Rec x = a[i];
        int64_t j = i - 1;
        while (j >= 0 && rec_cmp(&a[j], &x, ctx) > 0) { a[j + 1] = a[j]; j--; }
        a[j + 1] = x;
    }
}

/* Canonical sort of n records whose key hashes share their top `used` bits: one counting pass on the next
 * bits spreads the (uniform) hashes into about n buckets, then each bucket is sorted in place; a bucket made
 * large by many rows of one key falls back to rec_sort. tmp has room for n records. */
static int rec_sort_hashed(Rec *a, Rec *tmp, int64_t n, int used, const SortCtx *ctx, int64_t **cnt_buf,
                           int64_t *cnt_cap) {
    if (n <= 64 || used >= 60) { rec_sort(a, n, ctx); return DBSP_OK; }
    int bb = 0;
    while (bb < 20 && ((int64_t)1 << bb) < n) bb++;
    if (used + bb > 64) bb = 64 - used;
    int64_t nb = (int64_t)1 << bb;
    if (*cnt_cap < nb + 1) {
        free(*cnt_buf);
        *cnt_buf = malloc((size_t)(nb + 1) * 8);
        if (!*cnt_buf) { *cnt_cap = 0; return DBSP_ENOMEM; }
        *cnt_cap = nb + 1;
    }
    int64_t *cnt = *cnt_buf;
    memset(cnt, 0, (size_t)(nb + 1) * 8);
#define BUCKET(kh) ((int64_t)(((kh) << used) >> (64 - bb)))
    for (int64_t i = 0; i < n; i++) cnt[BUCKET(a[i].kh) + 1]++;
    for (int64_t k = 0; k < nb; k++) cnt[k + 1] += cnt[k];
    for (int64_t i = 0; i < n; i++) tmp[cnt[BUCKET(a[i].kh)]++] = a[i];
#undef BUCKET
    /* cnt[k] is now the end of bucket k */
    int64_t s = 0;
    for (int64_t k = 0; k < nb; k++) {
        int64_t e = cnt[k];
        if (e - s > 1) rec_sort(tmp + s, e - s, ctx);
        s = e;
    }
    memcpy(a, tmp, (size_t)n * sizeof(Rec));
    return DBSP_OK;
}

/* ---- consolidate ---- */

/* A scattered entry: a 16-byte header, then (fixed-width rows) the serialized row inline, padded to 8 bytes,
 * so the scatter writes one stream per partition. Variable-width rows keep their bytes in a partition arena
 * written in entry order, and the header holds their length. */
typedef struct { uint32_t h32; uint32_t idx; int64_t w; } EntryHead;
typedef struct { uint32_t h32; uint32_t len; uint64_t off; int64_t w; uint32_t idx; uint32_t pad; uint64_t key8; } Uniq;

#define ROWS_PER_PART 32768

static int part_bits_for(int64_t n) {
    int bits = 0;
    while (bits < 16 && ((int64_t)ROWS_PER_PART << bits) < n) bits++;
    return bits;
}

/* open-addressing table of partition-local uniques, grown by doubling at half load */
typedef struct { int32_t *slots; int64_t cap; } Table;

static int table_reset(Table *t, int64_t cap) {
    if (cap > t->cap) {
        free(t->slots);
        t->slots = malloc((size_t)cap * 4);
        if (!t->slots) { t->cap = 0; return DBSP_ENOMEM; }
        t->cap = cap;
    }
    memset(t->slots, 0, (size_t)cap * 4);
    return DBSP_OK;
}

int dbsp_zset_consolidate(const DbspBatch *b, const int32_t *keys, int32_t nkeys, DbspRows *out) {
    int64_t n = b->nrows;
    int st = DBSP_OK;
    memset(out, 0, sizeof *out);
    if (n == 0) return DBSP_OK;
    if (n >= (int64_t)UINT32_MAX) return DBSP_ETOOBIG;
    for (int32_t c = 0; c < b->ncols; c++)
        if (dbsp_type_class(b->cols[c].type) == 0) return DBSP_ETYPE;

#ifdef DBSP_PROFILE
    double prof_t = now_s(), prof_collect = 0, prof_sort = 0;
#endif
    uint64_t *rh = big_alloc((size_t)n * 8), *kh = NULL;
    uint8_t *E = NULL, *arena = NULL;
    int64_t *cnt = NULL, *start = NULL, *bstart = NULL, *bcur = NULL;
    Table tab = { NULL, 0 };
    Uniq *U = NULL;
    Rec *R = NULL, *R2 = NULL;
    int64_t *sort_cnt = NULL, sort_cnt_cap = 0;
    if (!rh) return DBSP_ENOMEM;
    if ((st = dbsp_hash_columns(b, NULL, 0, rh))) goto done;
    if (nkeys > 0) {
        kh = big_alloc((size_t)n * 8);
        if (!kh) { st = DBSP_ENOMEM; goto done; }
        if ((st = dbsp_hash_columns(b, keys, nkeys, kh))) goto done;
    }
    const uint64_t *pkh = kh ? kh : rh;
    PROF("hash");

    int bits = part_bits_for(n);
    int64_t np = (int64_t)1 << bits;
    int shift = 64 - bits;
#define PART(h) (bits ? (int64_t)((h) >> shift) : 0)
    int has_var;
    int64_t F = row_fixed_size(b, &has_var);
    int64_t S = has_var ? (int64_t)sizeof(EntryHead) + 8 : (int64_t)sizeof(EntryHead) + ((F + 7) & ~(int64_t)7);
    cnt = calloc((size_t)np + 1, 8);
    start = calloc((size_t)np + 1, 8);
    bstart = calloc((size_t)np + 1, 8);
    bcur = calloc((size_t)np + 1, 8);
    if (!cnt || !start || !bstart || !bcur) { st = DBSP_ENOMEM; goto done; }
    /* pass 1: histogram of rows (and arena bytes) per partition */
    for (int64_t i = 0; i < n; i++) cnt[PART(pkh[i])]++;
    if (has_var) {
        for (int64_t i = 0; i < n; i++) {
            int64_t s = F + row_var_size(b, i);
            if (s > (int64_t)UINT32_MAX) { st = DBSP_ETOOBIG; goto done; }
            bstart[PART(pkh[i]) + 1] += s;
        }
    }
    for (int64_t p = 0; p < np; p++) {
        start[p + 1] = start[p] + cnt[p];
        bstart[p + 1] += bstart[p];
    }
    E = big_alloc((size_t)(n * S));
    arena = has_var ? big_alloc((size_t)(bstart[np] ? bstart[np] : 1)) : NULL;
    if (!E || (has_var && !arena)) { st = DBSP_ENOMEM; goto done; }
    /* pass 2: scatter (cnt becomes the entry cursor, bcur the arena cursor) */
    for (int64_t p = 0; p < np; p++) { cnt[p] = start[p]; bcur[p] = bstart[p]; }
    {
        const int64_t *w = b->weights;
        for (int64_t i = 0; i < n; i++) {
            int64_t p = PART(pkh[i]);
            uint8_t *e = E + (cnt[p]++) * S;
            EntryHead *h = (EntryHead *)e;
            h->h32 = (uint32_t)rh[i];
            h->idx = (uint32_t)i;
            h->w = w ? w[i] : 1;
            if (has_var) {
                uint8_t *dst = arena + bcur[p];
                uint32_t len = (uint32_t)(serialize_row(b, i, dst) - dst);
                memcpy(e + sizeof(EntryHead), &len, 4);
                bcur[p] += len;
            } else {
                serialize_row(b, i, e + sizeof(EntryHead));
            }
        }
    }
    PROF("scatter");
#undef PART

    /* per partition: hash aggregation into uniques, then canonical sort of the non-zero ones */
    int64_t maxp = 0;
    for (int64_t p = 0; p < np; p++) if (start[p + 1] - start[p] > maxp) maxp = start[p + 1] - start[p];
    U = malloc((size_t)(maxp ? maxp : 1) * sizeof(Uniq));
    R = malloc((size_t)(maxp ? maxp : 1) * sizeof(Rec));
    R2 = malloc((size_t)(maxp ? maxp : 1) * sizeof(Rec));
    if (!U || !R || !R2) { st = DBSP_ENOMEM; goto done; }
    SortCtx ctx = { b };
    const int fast8 = !has_var && F == 8;
    for (int64_t p = 0; p < np; p++) {
        int64_t es = start[p], ee = start[p + 1];
        if (ee == es) continue;
        int64_t cap = 1024;
        if ((st = table_reset(&tab, cap))) goto done;
        uint64_t mask = (uint64_t)cap - 1;
        int64_t nu = 0;
        uint64_t off = (uint64_t)bstart[p];
        for (int64_t k = es; k < ee; k++) {
            const uint8_t *e = E + k * S;
            const EntryHead *h = (const EntryHead *)e;
            uint32_t len;
            const uint8_t *row;
            if (has_var) { memcpy(&len, e + sizeof(EntryHead), 4); row = arena + off; off += len; }
            else { len = (uint32_t)F; row = e + sizeof(EntryHead); }
            uint64_t s = h->h32 & mask;
            for (;;) {
                int32_t u = tab.slots[s];
                if (u == 0) {
                    Uniq *q = &U[nu++];
                    q->h32 = h->h32; q->len = len; q->w = h->w; q->idx = h->idx;
                    q->off = has_var ? (uint64_t)(row - arena) : (uint64_t)(row - E);
                    if (fast8) memcpy(&q->key8, row, 8);
                    tab.slots[s] = (int32_t)nu;
                    if (2 * nu > cap) {
                        /* grow and rehash the uniques of this partition */
                        cap *= 2;
                        if ((st = table_reset(&tab, cap))) goto done;
                        mask = (uint64_t)cap - 1;
                        for (int64_t t = 0; t < nu; t++) {
                            uint64_t s2 = U[t].h32 & mask;
                            while (tab.slots[s2]) s2 = (s2 + 1) & mask;
                            tab.slots[s2] = (int32_t)(t + 1);
                        }
                    }
                    break;
                }
                Uniq *q = &U[u - 1];
                if (q->h32 == h->h32) {
                    int eq;
                    if (fast8) { uint64_t y; memcpy(&y, row, 8); eq = q->key8 == y; }
                    else eq = q->len == len && memcmp((has_var ? arena : E) + q->off, row, len) == 0;
                    if (eq) {
                        if ((st = dbsp_add_weight(&q->w, h->w))) goto done;
                        break;
                    }
                }
                s = (s + 1) & mask;
            }
        }
#ifdef DBSP_PROFILE
        double tp0 = now_s();
#endif
        int64_t nr = 0;
        for (int64_t u = 0; u < nu; u++) {
            if (u + 16 < nu) {
                __builtin_prefetch(&rh[U[u + 16].idx]);
                if (kh) __builtin_prefetch(&kh[U[u + 16].idx]);
            }
            if (U[u].w == 0) continue;
            Rec *r = &R[nr++];
            r->rh = rh[U[u].idx]; r->kh = kh ? kh[U[u].idx] : r->rh; r->idx = U[u].idx; r->w = U[u].w;
        }
#ifdef DBSP_PROFILE
        double tp1 = now_s();
#endif
        if ((st = rec_sort_hashed(R, R2, nr, bits, &ctx, &sort_cnt, &sort_cnt_cap))) goto done;
#ifdef DBSP_PROFILE
        prof_collect += tp1 - tp0; prof_sort += now_s() - tp1;
#endif
        if ((st = dbsp_rows_reserve(out, nr))) goto done;
        for (int64_t r = 0; r < nr; r++) {
            out->idx[out->n] = R[r].idx;
            out->weights[out->n] = R[r].w;
            out->khash[out->n] = R[r].kh;
            out->n++;
        }
    }
    PROF("aggregate");
#ifdef DBSP_PROFILE
    fprintf(stderr, "  of which collect %.3f sort %.3f\n", prof_collect, prof_sort);
#endif
#ifdef DBSP_CHECK_INVARIANTS
    assert(dbsp_rows_check_order(b, out->idx, out->weights, out->khash, out->n, keys, nkeys) == 0);
#endif
done:
    free(rh); free(kh); free(E); free(arena); free(cnt); free(start); free(bstart); free(bcur); free(tab.slots);
    free(U); free(R); free(R2); free(sort_cnt);
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
    const uint64_t *arh = akh, *brh = bkh;
    uint64_t *arh_own = NULL, *brh_own = NULL;
    if (nkeys > 0) {
        arh_own = malloc((size_t)(a->nrows ? a->nrows : 1) * 8);
        brh_own = malloc((size_t)(b->nrows ? b->nrows : 1) * 8);
        if (!arh_own || !brh_own) { st = DBSP_ENOMEM; goto done; }
        if ((st = dbsp_hash_columns(a, NULL, 0, arh_own)) || (st = dbsp_hash_columns(b, NULL, 0, brh_own))) goto done;
        arh = arh_own; brh = brh_own;
    }
#ifdef DBSP_CHECK_INVARIANTS
    assert(dbsp_rows_check_order(a, NULL, a->weights, akh, a->nrows, keys, nkeys) == 0);
    assert(dbsp_rows_check_order(b, NULL, b->weights, bkh, b->nrows, keys, nkeys) == 0);
#endif
    if ((st = dbsp_rows_reserve(out, a->nrows + b->nrows))) goto done;
    int64_t i = 0, j = 0, na = a->nrows, nb = b->nrows;
    const int64_t *aw = a->weights, *bw = b->weights;
    while (i < na || j < nb) {
        int c;
        if (i == na) c = 1;
        else if (j == nb) c = -1;
        else if (akh[i] != bkh[j]) c = akh[i] < bkh[j] ? -1 : 1;
        else if (arh[i] != brh[j]) c = arh[i] < brh[j] ? -1 : 1;
        else c = dbsp_row_cmp(a, i, NULL, b, j, NULL, a->ncols);
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
    free(arh_own); free(brh_own);
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
