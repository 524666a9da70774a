/* group.c: radix-partitioned hash grouping on canonically serialized identity values, with inline aggregates.
 *
 * Design notes:
 *  1. Rows are radix-partitioned by the top bits of their key hash into partitions of about 8k rows, so each
 *     partition's hash table (grown with its distinct values) stays in cache, and concatenating the partitions
 *     keeps key-hash order.
 *  2. While scattering, each row's identity columns are serialized in a canonical byte form (a null flag per
 *     nullable column, canonical float bits, u32 length + bytes for variable width). Two rows have equal
 *     identity (column.h invariant 2) iff their serialized forms are equal, so equality inside a partition is a
 *     memcmp on cache-resident bytes, never a random column access. Fixed-width forms sit inline in the entry
 *     (one write stream per partition); variable-width forms go to a partition arena written in entry order.
 *  3. Aggregate inputs travel in the entry too (8 bytes each plus a validity mask), so folding never reads
 *     the source columns, except to compare byte strings for MIN/MAX.
 *  4. Each partition's groups are sorted canonically (by the next hash bits, then rec_cmp) and appended.
 *  5. The large scratch buffers (hashes, entries, arena, per-partition tables) come from scratch.h.
 */
#include <stdlib.h>
#include <string.h>
#include "group.h"
#include "hash.h"
#include "scratch.h"

/* ---- canonical serialization of the identity columns (design note 2) ---- */

typedef struct { const DbspBatch *b; const int32_t *cols; int32_t ncols; } Ident;

#define ICOL(id, k) (&(id)->b->cols[(id)->cols ? (id)->cols[k] : (k)])

static int64_t fixed_size(const Ident *id, int *has_var) {
    int64_t f = 0;
    *has_var = 0;
    for (int32_t k = 0; k < id->ncols; k++) {
        const DbspColumn *col = ICOL(id, k);
        int w = dbsp_type_width(col->type);
        if (col->validity) f += 1;
        if (w) f += w;
        else { f += 4; *has_var = 1; }
    }
    return f;
}

static inline int64_t var_size(const Ident *id, int64_t i) {
    int64_t s = 0;
    for (int32_t k = 0; k < id->ncols; k++) {
        const DbspColumn *col = ICOL(id, k);
        if (dbsp_type_class(col->type) == DBSP_CLASS_BYTES && dbsp_col_valid(col, i)) {
            int64_t len;
            (void)dbsp_col_bytes(col, i, &len);
            s += len;
        }
    }
    return s;
}

static inline uint8_t *serialize(const Ident *id, int64_t i, uint8_t *p) {
    for (int32_t c = 0; c < id->ncols; c++) {
        const DbspColumn *col = ICOL(id, c);
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

/* ---- canonical sort of a partition's groups (design note 4) ---- */

typedef struct { uint64_t kh, ih; int64_t idx, u; } Rec;  /* 32 bytes: copies are two vector moves */

static inline int rec_cmp(const Rec *x, const Rec *y, const Ident *id) {
    if (x->kh != y->kh) return x->kh < y->kh ? -1 : 1;
    if (x->ih != y->ih) return x->ih < y->ih ? -1 : 1;
    return dbsp_row_cmp(id->b, x->idx, id->cols, id->b, y->idx, id->cols, id->ncols);
}

static void rec_sort(Rec *a, int64_t n, const Ident *id) {
    while (n > 16) {
        /* median of three pivot, Hoare partition; recurse on the smaller side */
        Rec *m = a + n / 2, *l = a, *r = a + n - 1, t;
        if (rec_cmp(m, l, id) < 0) { t = *m; *m = *l; *l = t; }
        if (rec_cmp(r, m, id) < 0) { t = *r; *r = *m; *m = t; if (rec_cmp(m, l, id) < 0) { t = *m; *m = *l; *l = t; } }
        Rec pivot = *m;
        int64_t i = -1, j = n;
        for (;;) {
            do i++; while (rec_cmp(&a[i], &pivot, id) < 0);
            do j--; while (rec_cmp(&a[j], &pivot, id) > 0);
            if (i >= j) break;
            t = a[i]; a[i] = a[j]; a[j] = t;
        }
        if (j + 1 < n - j - 1) { rec_sort(a, j + 1, id); a += j + 1; n -= j + 1; }
        else { rec_sort(a + j + 1, n - j - 1, id); n = j + 1; }
    }
    for (int64_t i = 1; i < n; i++) {
        Rec x = a[i];
        int64_t j = i - 1;
        while (j >= 0 && rec_cmp(&a[j], &x, id) > 0) { a[j + 1] = a[j]; j--; }
        a[j + 1] = x;
    }
}

/* Records whose key hashes share their top `used` bits: a counting pass on the next bits spreads the (uniform)
 * hashes into about n buckets, each then sorted in place. A bucket of more than RUN_RADIX_MIN records all of one
 * key hash (many rows of one key: a grouping by a column of few values, such as a min/max's value multiset by
 * category) is spread by a second counting pass on the top bits of the identity hash (rec_sort_run), which the
 * canonical order compares next: the comparison sort of such a run cost O(n log n) comparisons, most of the
 * kernel's time at 20 keys (1,150 rows a key: 2.0 -> 0.9 ms for 23k rows, bench/history/RESULTS-2026-11-28-to-2026-12-02.md, branch r37-demo6). */
#define RUN_RADIX_MIN 64

static int ensure_cnt(int64_t **cnt_buf, int64_t *cnt_cap, int64_t nb) {
    if (*cnt_cap < nb + 1) {
        free(*cnt_buf);
        *cnt_buf = malloc((size_t)(nb + 1) * 8);
        if (!*cnt_buf) { *cnt_cap = 0; return DBSP_ENOMEM; }
        *cnt_cap = nb + 1;
    }
    memset(*cnt_buf, 0, (size_t)(nb + 1) * 8);
    return DBSP_OK;
}

/* a[0..n), all of one key hash, sorted canonically through tmp[0..n) (the result in a): a counting pass on the top
 * bits of the identity hash, then each bucket by rec_cmp (equal identity hashes, the rare ties, end in one) */
static int rec_sort_run(Rec *a, Rec *tmp, int64_t n, const Ident *id, int64_t **cnt_buf, int64_t *cnt_cap) {
    int bb = 0;
    while (bb < 20 && ((int64_t)1 << bb) < n) bb++;
    int64_t nb = (int64_t)1 << bb;
    int st = ensure_cnt(cnt_buf, cnt_cap, nb);
    if (st) return st;
    int64_t *cnt = *cnt_buf;
#define BUCKET(h) ((int64_t)((h) >> (64 - bb)))
    for (int64_t i = 0; i < n; i++) cnt[BUCKET(a[i].ih) + 1]++;
    for (int64_t k = 0; k < nb; k++) cnt[k + 1] += cnt[k];
    for (int64_t i = 0; i < n; i++) tmp[cnt[BUCKET(a[i].ih)]++] = a[i];
#undef BUCKET
    int64_t s = 0;
    for (int64_t k = 0; k < nb; k++) {
        if (cnt[k] - s > 1) rec_sort(tmp + s, cnt[k] - s, id);
        s = cnt[k];
    }
    memcpy(a, tmp, (size_t)n * sizeof(Rec));
    return DBSP_OK;
}

/* whether a[0..n) all have one key hash */
static int one_key_hash(const Rec *a, int64_t n) {
    uint64_t d = 0;
    for (int64_t i = 1; i < n; i++) d |= a[i].kh ^ a[0].kh;
    return d == 0;
}

static int rec_sort_hashed(Rec *a, Rec *tmp, int64_t n, int used, const Ident *id, int64_t **cnt_buf,
                           int64_t *cnt_cap) {
    if (n <= RUN_RADIX_MIN || used >= 60) {
        if (n > RUN_RADIX_MIN && one_key_hash(a, n)) return rec_sort_run(a, tmp, n, id, cnt_buf, cnt_cap);
        rec_sort(a, n, id);
        return DBSP_OK;
    }
    int bb = 0;
    while (bb < 20 && ((int64_t)1 << bb) < n) bb++;
    if (used + bb > 64) bb = 64 - used;
    int64_t nb = (int64_t)1 << bb;
    int st = ensure_cnt(cnt_buf, cnt_cap, nb);
    if (st) return st;
    int64_t *cnt = *cnt_buf;
#define BUCKET(kh) ((int64_t)(((kh) << used) >> (64 - bb)))
    for (int64_t i = 0; i < n; i++) cnt[BUCKET(a[i].kh) + 1]++;
    for (int64_t k = 0; k < nb; k++) cnt[k + 1] += cnt[k];
    for (int64_t i = 0; i < n; i++) tmp[cnt[BUCKET(a[i].kh)]++] = a[i];
#undef BUCKET
    /* cnt[k] is now the end of bucket k; the long single-key buckets are noted in cnt[] as negative ends and sorted
     * after this walk (rec_sort_run reuses the count buffer) */
    int64_t s = 0, runs = 0;
    for (int64_t k = 0; k < nb; k++) {
        int64_t e = cnt[k];
        if (e - s > RUN_RADIX_MIN && one_key_hash(tmp + s, e - s)) { cnt[k] = -e - 1; runs++; }
        else if (e - s > 1) rec_sort(tmp + s, e - s, id);
        s = e;
    }
    if (runs) {  /* the runs' bounds, saved before rec_sort_run overwrites the count buffer */
        int64_t *bounds = malloc((size_t)runs * 2 * 8);
        if (!bounds) return DBSP_ENOMEM;
        int64_t r = 0;
        s = 0;
        for (int64_t k = 0; k < nb; k++) {
            int64_t e = cnt[k] < 0 ? -cnt[k] - 1 : cnt[k];
            if (cnt[k] < 0) { bounds[2 * r] = s; bounds[2 * r + 1] = e; r++; }
            s = e;
        }
        for (r = 0; r < runs && !st; r++)  /* sorted in place in tmp, through a (free until the copy below) */
            st = rec_sort_run(tmp + bounds[2 * r], a, bounds[2 * r + 1] - bounds[2 * r], id, cnt_buf, cnt_cap);
        free(bounds);
        if (st) return st;
    }
    memcpy(a, tmp, (size_t)n * sizeof(Rec));
    return DBSP_OK;
}

/* ---- the engine ---- */

/* an entry's head: the identity hash (whole: groups need it for the canonical sort, and reading it from the hash
 * array would cost a cache miss per group), the row, and its weight, or W_FAR when it is outside int32 (then read
 * from the weights, which is rare) */
typedef struct { uint64_t h; uint32_t idx; int32_t w; } EntryHead;
typedef struct { uint64_t h; uint32_t len; uint32_t idx; uint64_t off; int64_t w; uint64_t key8; } Uniq;
#define W_FAR INT32_MIN
#define ENTRY_W(hd) ((hd)->w != W_FAR ? (int64_t)(hd)->w : b->weights[(hd)->idx])

#ifndef ROWS_PER_PART
#define ROWS_PER_PART 8192
#endif
#ifndef WC
#define WC 16  /* entries per write-combining buffer (measured: 1..32 within 5%; 16 among the best) */
#endif

static int part_bits_for(int64_t n) {
    int bits = 0;
    while (bits < 16 && ((int64_t)ROWS_PER_PART << bits) < n) bits++;
    return bits;
}

/* grow-by-doubling scratch array */
static int ensure(void **p, int64_t *cap, int64_t need, size_t item) {
    if (need <= *cap) return DBSP_OK;
    int64_t c = *cap ? *cap : 1024;
    while (c < need) c *= 2;
    void *q = realloc(*p, (size_t)c * item);
    if (!q) return DBSP_ENOMEM;
    *p = q; *cap = c;
    return DBSP_OK;
}

int dbsp_group(const DbspBatch *b, const int32_t *icols, int32_t nicols, const int32_t *kcols, int32_t nkcols,
               const DbspAggSpec *aggs, int32_t naggs, int drop_zero, DbspRows *out, DbspAcc **acc_out) {
    return dbsp_group_ih(b, icols, nicols, kcols, nkcols, aggs, naggs, drop_zero, out, acc_out, NULL);
}

int dbsp_group_ih(const DbspBatch *b, const int32_t *icols, int32_t nicols, const int32_t *kcols, int32_t nkcols,
                  const DbspAggSpec *aggs, int32_t naggs, int drop_zero, DbspRows *out, DbspAcc **acc_out,
                  uint64_t **ih_out) {
    int64_t n = b->nrows;
    int st = DBSP_OK;
    memset(out, 0, sizeof *out);
    if (acc_out) *acc_out = NULL;
    if (ih_out) *ih_out = NULL;
    Ident id = { b, icols, icols ? nicols : b->ncols };
    for (int32_t k = 0; k < id.ncols; k++) {
        if (icols && (icols[k] < 0 || icols[k] >= b->ncols)) return DBSP_EINVAL;
        if (dbsp_type_class(ICOL(&id, k)->type) == 0) return DBSP_ETYPE;
    }
    if ((st = dbsp_aggs_check(b, aggs, naggs))) return st;
    if (naggs && !acc_out) return DBSP_EINVAL;
    if (n == 0) return DBSP_OK;
    if (naggs == 0 && dbsp_group_int_applies(b, icols, nicols, kcols, nkcols, aggs, naggs)) {
        st = dbsp_group_int(b, icols, NULL, 0, drop_zero, out, NULL);  /* one integer column: group_int.c */
        if (st != DBSP_GROUP_INT_NO) return st;
    }
    if (n >= (int64_t)UINT32_MAX) return DBSP_ETOOBIG;

    uint64_t *ih = dbsp_scratch_alloc((size_t)n * 8), *kh = NULL;
    uint8_t *E = NULL, *arena = NULL;
    int64_t *cnt = NULL, *start = NULL, *bstart = NULL, *bcur = NULL, *sort_cnt = NULL, sort_cnt_cap = 0;
    uint64_t *slots = NULL;  /* (hash tag << 32) | (group number + 1); 0 = empty */
    uint8_t *wc = NULL;
    uint32_t *fill = NULL;
    Uniq *U = NULL;
    int32_t *carry = NULL;  /* wraps of each group's weight sum, allocated at the first one */
    DbspAcc *A = NULL, *accs = NULL;
    Rec *R = NULL, *R2 = NULL;
    uint64_t *oih = NULL;  /* the output rows' identity hashes (ih_out) */
    int64_t slots_cap = 0, u_cap = 0, a_cap = 0, r_cap = 0, accs_cap = 0, S_bytes = 0;
    size_t arena_bytes = 0;
    if (!ih) return DBSP_ENOMEM;
    if (ih_out && !(oih = dbsp_alloc_result((size_t)n * 8))) { st = DBSP_ENOMEM; goto done; }
    if ((st = dbsp_hash_columns(b, icols, id.ncols, ih))) goto done;
    if (nkcols > 0) {
        kh = dbsp_scratch_alloc((size_t)n * 8);
        if (!kh) { st = DBSP_ENOMEM; goto done; }
        if ((st = dbsp_hash_columns(b, kcols, nkcols, kh))) goto done;
    }
    const uint64_t *pkh = kh ? kh : ih;

    int bits = part_bits_for(n);
    int64_t np = (int64_t)1 << bits;
    int shift = 64 - bits;
#define PART(h) (bits ? (int64_t)((h) >> shift) : 0)
    int has_var;
    int64_t F = fixed_size(&id, &has_var);
    int64_t keyslot = has_var ? 8 : ((F + 7) & ~(int64_t)7);
    /* aggregate payload: an 8-byte value per non-COUNT aggregate, then a validity mask if any column is nullable */
    int32_t nvals = 0, need_mask = 0;
    int32_t slot_of[64];
    if (naggs > 64) { st = DBSP_EINVAL; goto done; }
    for (int32_t k = 0; k < naggs; k++) {
        slot_of[k] = aggs[k].kind == DBSP_AGG_COUNT ? -1 : nvals++;
        if (aggs[k].kind != DBSP_AGG_COUNT && b->cols[aggs[k].col].validity) need_mask = 1;
    }
    int64_t aggoff = (int64_t)sizeof(EntryHead) + keyslot;
    int64_t maskoff = aggoff + 8 * (int64_t)nvals;
    int64_t S = maskoff + (need_mask ? 8 : 0);
    cnt = calloc((size_t)np + 1, 8);
    start = calloc((size_t)np + 1, 8);
    bstart = calloc((size_t)np + 1, 8);
    bcur = calloc((size_t)np + 1, 8);
    if (!cnt || !start || !bstart || !bcur) { st = DBSP_ENOMEM; goto done; }
    /* pass 1: histogram of rows (and arena bytes) per partition */
    for (int64_t i = 0; i < n; i++) cnt[PART(pkh[i])]++;
    if (has_var) {
        for (int64_t i = 0; i < n; i++) {
            int64_t s = F + var_size(&id, i);
            if (s > (int64_t)UINT32_MAX) { st = DBSP_ETOOBIG; goto done; }
            bstart[PART(pkh[i]) + 1] += s;
        }
    }
    for (int64_t p = 0; p < np; p++) {
        start[p + 1] = start[p] + cnt[p];
        bstart[p + 1] += bstart[p];
    }
    S_bytes = S;
    arena_bytes = has_var ? (size_t)(bstart[np] ? bstart[np] : 1) : 0;
    E = dbsp_scratch_alloc((size_t)(n * S));
    arena = has_var ? dbsp_scratch_alloc(arena_bytes) : NULL;
    if (!E || (has_var && !arena)) { st = DBSP_ENOMEM; goto done; }
    /* pass 2: scatter through per-partition write-combining buffers of WC entries (cnt becomes the entry
     * cursor, bcur the arena cursor, fill the buffer fill) */
    for (int64_t p = 0; p < np; p++) { cnt[p] = start[p]; bcur[p] = bstart[p]; }
    wc = malloc((size_t)(np * WC * S));
    fill = calloc((size_t)np, 4);
    if (!wc || !fill) { st = DBSP_ENOMEM; goto done; }
    {
        const int64_t *w = b->weights;
        for (int64_t i = 0; i < n; i++) {
            int64_t p = PART(pkh[i]);
            uint8_t *e = wc + (p * WC + fill[p]) * S;
            EntryHead *h = (EntryHead *)e;
            h->h = ih[i];
            h->idx = (uint32_t)i;
            h->w = !w ? 1 : (w[i] > W_FAR && w[i] <= INT32_MAX) ? (int32_t)w[i] : W_FAR;
            if (has_var) {
                uint8_t *dst = arena + bcur[p];
                uint32_t len = (uint32_t)(serialize(&id, i, dst) - dst);
                memcpy(e + sizeof(EntryHead), &len, 4);
                bcur[p] += len;
            } else {
                serialize(&id, i, e + sizeof(EntryHead));
            }
            if (nvals) {
                uint64_t mask = 0;
                for (int32_t k = 0; k < naggs; k++) {
                    if (slot_of[k] < 0) continue;
                    DbspAggValue v = dbsp_agg_value(&b->cols[aggs[k].col], i);
                    mask |= (uint64_t)v.valid << k;
                    memcpy(e + aggoff + 8 * slot_of[k], &v.bits, 8);
                }
                if (need_mask) memcpy(e + maskoff, &mask, 8);
            }
            if (++fill[p] == WC) {
                memcpy(E + cnt[p] * S, wc + p * WC * S, (size_t)(WC * S));
                cnt[p] += WC;
                fill[p] = 0;
            }
        }
        for (int64_t p = 0; p < np; p++)
            if (fill[p]) memcpy(E + cnt[p] * S, wc + p * WC * S, (size_t)(fill[p] * S));
    }
#undef PART

    /* per-partition scratch, sized once for the largest partition and taken from the cache */
    int64_t maxp = 0;
    for (int64_t p = 0; p < np; p++) if (start[p + 1] - start[p] > maxp) maxp = start[p + 1] - start[p];
    slots_cap = 1024;
    while (slots_cap < 2 * maxp) slots_cap *= 2;
    u_cap = r_cap = maxp;
    a_cap = maxp * naggs;
    slots = dbsp_scratch_alloc((size_t)slots_cap * 8);
    U = dbsp_scratch_alloc((size_t)u_cap * sizeof(Uniq));
    R = dbsp_scratch_alloc((size_t)r_cap * sizeof(Rec));
    R2 = dbsp_scratch_alloc((size_t)r_cap * sizeof(Rec));
    A = naggs ? dbsp_scratch_alloc((size_t)a_cap * sizeof(DbspAcc)) : NULL;
    if (!slots || !U || !R || !R2 || (naggs && !A)) { st = DBSP_ENOMEM; goto done; }
    if ((st = dbsp_rows_reserve(out, maxp < n / np * 2 ? n / np * 2 : maxp))) goto done;

    /* per partition: hash aggregation into groups, then the canonical sort */
    const int fast8 = !has_var && F == 8;
    int64_t prev_nu = 0, rows_seen = 0;
    for (int64_t p = 0; p < np; p++) {
        int64_t es = start[p], ee = start[p + 1];
        if (ee == es) continue;
        int64_t cap = 1024;  /* sized for the previous partition's groups: uniform hashes spread them evenly */
        while (cap < slots_cap && cap < 2 * (prev_nu + prev_nu / 4)) cap *= 2;
        memset(slots, 0, (size_t)cap * 8);
        uint64_t hmask = (uint64_t)cap - 1;
        int64_t nu = 0;
        uint64_t off = (uint64_t)bstart[p];
        if (carry) memset(carry, 0, (size_t)u_cap * sizeof *carry);
        for (int64_t k = es; k < ee; k++) {
            const uint8_t *e = E + k * S;
            const EntryHead *h = (const EntryHead *)e;
            uint32_t len;
            const uint8_t *row;
            if (has_var) { memcpy(&len, e + sizeof(EntryHead), 4); row = arena + off; off += len; }
            else { len = (uint32_t)F; row = e + sizeof(EntryHead); }
            uint64_t s = (uint32_t)h->h & hmask;
            Uniq *q = NULL;
            const uint64_t tag = h->h << 32;
            const int64_t ew = ENTRY_W(h);
            for (;;) {
                uint64_t sl = slots[s];
                if (sl == 0) break;
                if ((sl & 0xffffffff00000000ULL) == tag) {
                    Uniq *c = &U[(uint32_t)sl - 1];
                    int eq;
                    if (fast8) { uint64_t y; memcpy(&y, row, 8); eq = c->key8 == y; }
                    else eq = c->len == len && memcmp((has_var ? arena : E) + c->off, row, len) == 0;
                    if (eq) { q = c; break; }
                }
                s = (s + 1) & hmask;
            }
            if (q) {
                if (__builtin_add_overflow(q->w, ew, &q->w)) {  /* rare: count the wrap (rows.h dbsp_add_exact) */
                    if (!carry && !(carry = calloc((size_t)u_cap, sizeof *carry))) { st = DBSP_ENOMEM; goto done; }
                    carry[q - U] += ew > 0 ? 1 : -1;
                }
            } else {
                q = &U[nu++];  /* nu <= partition size <= u_cap */
                q->h = h->h; q->len = len; q->w = ew; q->idx = h->idx;
                q->off = has_var ? (uint64_t)(row - arena) : (uint64_t)(row - E);
                if (fast8) memcpy(&q->key8, row, 8);
                for (int32_t a = 0; a < naggs; a++) dbsp_acc_init(&A[(nu - 1) * naggs + a], aggs[a].kind);
                slots[s] = tag | (uint64_t)nu;
                if (2 * nu > cap) {  /* grow the table and rehash this partition's groups */
                    /* to twice the projected groups (group.h); cap <= slots_cap: the table is at most half full of
                     * <= maxp groups */
                    int64_t proj = dbsp_group_projection(nu, k - es + 1, ee - k - 1);
                    cap *= 2;
                    while (cap < slots_cap && cap < 2 * proj) cap *= 2;
                    memset(slots, 0, (size_t)cap * 8);
                    hmask = (uint64_t)cap - 1;
                    for (int64_t t = 0; t < nu; t++) {
                        uint64_t s2 = (uint32_t)U[t].h & hmask;
                        while (slots[s2]) s2 = (s2 + 1) & hmask;
                        slots[s2] = (U[t].h << 32) | (uint64_t)(t + 1);
                    }
                }
            }
            if (naggs) {
                DbspAcc *acc = &A[(q - U) * naggs];
                uint64_t mask = ~(uint64_t)0;
                if (need_mask) memcpy(&mask, e + maskoff, 8);
                for (int32_t a = 0; a < naggs; a++) {
                    DbspAggValue v = { 0, 0 };
                    if (slot_of[a] >= 0) {
                        memcpy(&v.bits, e + aggoff + 8 * slot_of[a], 8);
                        v.valid = (int)((mask >> a) & 1);
                    }
                    const DbspColumn *c = aggs[a].kind == DBSP_AGG_COUNT ? NULL : &b->cols[aggs[a].col];
                    if ((st = dbsp_acc_fold(&acc[a], aggs[a].kind, c, h->idx, v, ew))) goto done;
                }
            }
        }
        prev_nu = nu;
        int64_t nr = 0;
        for (int64_t u = 0; u < nu; u++) {
            if (kh && u + 16 < nu) __builtin_prefetch(&kh[U[u + 16].idx]);
            if (carry && carry[u]) { st = DBSP_EOVERFLOW; goto done; }  /* the exact weight sum does not fit */
            if (drop_zero && U[u].w == 0) continue;
            Rec *r = &R[nr++];
            r->ih = U[u].h; r->kh = kh ? kh[U[u].idx] : r->ih; r->idx = U[u].idx; r->u = u;
        }
        if ((st = rec_sort_hashed(R, R2, nr, bits, &id, &sort_cnt, &sort_cnt_cap))) goto done;
        rows_seen += ee - es;
        if (out->n + nr > out->cap) {  /* reserve for the groups this share of the rows predicts */
            int64_t guess = (int64_t)((double)(out->n + nr) * ((double)n / (double)rows_seen) * 1.05) + 1024;
            if ((st = dbsp_rows_reserve(out, (guess < n ? guess : n) - out->n))) goto done;
        }
        if ((st = dbsp_rows_reserve(out, nr))) goto done;
        if (naggs && (st = ensure((void **)&accs, &accs_cap, (out->n + nr) * naggs, sizeof(DbspAcc)))) goto done;
        for (int64_t r = 0; r < nr; r++) {
            if (naggs) memcpy(&accs[out->n * naggs], &A[R[r].u * naggs], (size_t)naggs * sizeof(DbspAcc));
            if (oih) oih[out->n] = R[r].ih;
            out->idx[out->n] = R[r].idx;
            out->weights[out->n] = U[R[r].u].w;
            out->khash[out->n] = R[r].kh;
            out->n++;
        }
    }
done:
    dbsp_scratch_free(ih, (size_t)n * 8); dbsp_scratch_free(kh, (size_t)n * 8); dbsp_scratch_free(E, (size_t)(n * S_bytes));
    dbsp_scratch_free(arena, arena_bytes); free(wc); free(fill); free(cnt); free(start); free(bstart); free(bcur);
    dbsp_scratch_free(slots, (size_t)slots_cap * 8); dbsp_scratch_free(U, (size_t)u_cap * sizeof(Uniq));
    dbsp_scratch_free(R, (size_t)r_cap * sizeof(Rec)); dbsp_scratch_free(R2, (size_t)r_cap * sizeof(Rec));
    dbsp_scratch_free(A, (size_t)a_cap * sizeof(DbspAcc)); free(sort_cnt); free(carry);
    if (st) { dbsp_rows_free(out); free(accs); accs = NULL; free(oih); oih = NULL; }
    if (acc_out) *acc_out = accs; else free(accs);
    if (oih && out->n < n / 2) {  /* most rows cancelled or summed: give back the unused tail */
        uint64_t *shrunk = realloc(oih, (size_t)(out->n ? out->n : 1) * 8);
        if (shrunk) oih = shrunk;
    }
    if (ih_out) *ih_out = oih;
    return st;
}
