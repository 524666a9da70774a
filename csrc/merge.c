/* merge.c: the merge cursor, a resumable merge of two consolidated batches that writes its output rows in place (merge.h).
 *
 * Design notes:
 *  1. Both inputs are read front to back and the output is written front to back, so a step is two sequential
 *     reads and one sequential write per column: no index array, no concatenation of the inputs and no gather
 *     (dbsp_zset_merge's result, applied with a take, costs both).
 *  2. A step plans CHUNK output rows at a time (which side each comes from, its weight and key hash), then
 *     copies each column for the chunk in a tight loop per type, so the per-row type dispatch is paid once per
 *     chunk and column.
 *  3. Row order is rows.h's canonical order, decided as in dbsp_zset_merge: key hash, then (only where key
 *     hashes meet) row hash, then the values; with a whole-row key (nkeys == 0) the key hash is the row hash.
 *     Row hashes come with the batches when their owner keeps them (a trace does: where every key meets, as in
 *     an aggregate's state, hashing the meeting rows measured ~270 instructions a row, most of a merge), and
 *     are computed otherwise; equal rows need none.
 *  4. The k-way step picks each row through a tournament of losers over the k heads (log2 k key-hash comparisons a
 *     row, each against the loser's key hash kept in its node; canonical order only where key hashes meet), not a
 *     scan of every head (k - 1): measured (callgrind, bids-like rows with row hashes) 187 -> 147 instructions a row
 *     at k = 8, 271 -> ~170 at k = 16, 872 -> ~210 at k = 64. Equal rows come out of the tree one after another
 *     (first input first) and are summed; a sum past int64 gives back every input advanced for that row.
 */
#include <string.h>
#include "merge.h"
#include "hash.h"
#include "rows.h"
#include "status.h"

#define CHUNK 512

static int is_large(int32_t t) { return t == DBSP_LARGE_UTF8 || t == DBSP_LARGE_BINARY; }

static int64_t col_bytes(const DbspColumn *c, int64_t n) {
    if (n == 0) return 0;
    if (is_large(c->type)) {
        const int64_t *o = (const int64_t *)c->values + c->offset;
        return o[n] - o[0];
    }
    const int32_t *o = (const int32_t *)c->values + c->offset;
    return (int64_t)o[n] - o[0];
}

void dbsp_merge_k_sizes(const DbspColumn *const *cols, const int64_t *n, int32_t k, int64_t *validity,
                        int64_t *values, int64_t *data) {
    int64_t cap = 0;
    int nullable = 0;
    *data = 0;
    for (int32_t x = 0; x < k; x++) {
        cap += n[x];
        nullable |= cols[x]->validity != NULL;
        if (dbsp_type_class(cols[0]->type) == DBSP_CLASS_BYTES) *data += col_bytes(cols[x], n[x]);
    }
    *validity = nullable ? (cap + 7) / 8 : 0;
    if (cols[0]->type == DBSP_BOOL) {
        *values = (cap + 7) / 8;
    } else if (dbsp_type_class(cols[0]->type) == DBSP_CLASS_BYTES) {
        *values = (cap + 1) * (is_large(cols[0]->type) ? 8 : 4);
    } else {
        *values = cap * dbsp_type_width(cols[0]->type);
    }
}

void dbsp_merge_cursor_sizes(const DbspColumn *a, int64_t na, const DbspColumn *b, int64_t nb, int64_t *validity,
                             int64_t *values, int64_t *data) {
    const DbspColumn *cols[2] = { a, b };
    int64_t n[2] = { na, nb };
    dbsp_merge_k_sizes(cols, n, 2, validity, values, data);
}

int dbsp_merge_k_init(const DbspBatch *const *in, int32_t k, DbspOutColumn *out) {
    if (k < 2 || k > DBSP_MERGE_MAX_K) return DBSP_EINVAL;
    for (int32_t x = 1; x < k; x++)
        if (in[x]->ncols != in[0]->ncols) return DBSP_EINVAL;
    for (int32_t c = 0; c < in[0]->ncols; c++) {
        int32_t t = in[0]->cols[c].type;
        if (dbsp_type_class(t) == 0) return DBSP_ETYPE;
        for (int32_t x = 1; x < k; x++)
            if (in[x]->cols[c].type != t) return DBSP_ETYPE;
        out[c].type = t;
        out[c].null_count = 0;
        if (dbsp_type_class(t) == DBSP_CLASS_BYTES) {
            if (is_large(t)) ((int64_t *)out[c].values)[0] = 0;
            else ((int32_t *)out[c].values)[0] = 0;
        }
    }
    return DBSP_OK;
}

int dbsp_merge_cursor_init(const DbspBatch *a, const DbspBatch *b, DbspMergeCursor *m, DbspOutColumn *out) {
    const DbspBatch *in[2] = { a, b };
    memset(m, 0, sizeof *m);
    return dbsp_merge_k_init(in, 2, out);
}

/* bit k of an output bitmap written in row order: a new byte starts at zero (merge.h invariant 3) */
static inline void put_bit(uint8_t *bits, int64_t k, int v) {
    if ((k & 7) == 0) bits[k >> 3] = 0;
    bits[k >> 3] |= (uint8_t)(v << (k & 7));
}

/* Rows of a chunk come from either side in an unpredictable pattern, so the copy loops select the side without a
 * branch: for s < 0 (a row ~s of b) the mask s >> 63 is all ones, it picks b's pointer and s ^ mask == ~s. */
#define PICK(pa, pb, mask) ((const void *)(((uintptr_t)(pa) & ~(uintptr_t)(mask)) | ((uintptr_t)(pb) & (uintptr_t)(mask))))

#define COPY_FIXED(T)                                                                  \
    do {                                                                               \
        const T *av = (const T *)ca->values + ca->offset;                              \
        const T *bv = (const T *)cb->values + cb->offset;                              \
        T *ov = (T *)o->values + n;                                                    \
        for (int64_t k = 0; k < cnt; k++) {                                            \
            int64_t s = src[k], mask = s >> 63;                                        \
            ov[k] = ((const T *)PICK(av, bv, mask))[s ^ mask];                         \
        }                                                                              \
    } while (0)

#define COPY_BYTES(T, LIMIT)                                                           \
    do {                                                                               \
        T *oo = (T *)o->values;                                                        \
        int64_t at = (int64_t)oo[n];                                                   \
        for (int64_t k = 0; k < cnt; k++) {                                            \
            int64_t s = src[k], len;                                                   \
            const uint8_t *p = s >= 0 ? dbsp_col_bytes(ca, s, &len) : dbsp_col_bytes(cb, ~s, &len); \
            if (at + len > (LIMIT)) return DBSP_ETOOBIG;                               \
            if (len) memcpy(o->data + at, p, (size_t)len);                             \
            at += len;                                                                 \
            oo[n + k + 1] = (T)at;                                                     \
        }                                                                              \
    } while (0)

/* output bits [n, n + cnt) from bitmaps abits/bbits (offsets aoff/boff), both non-NULL; returns the zero bits */
static int64_t copy_bits(const uint8_t *abits, int64_t aoff, const uint8_t *bbits, int64_t boff,
                         const int64_t *src, int64_t cnt, int64_t n, uint8_t *out) {
    int64_t zeros = 0;
    for (int64_t k = 0; k < cnt; k++) {
        int64_t s = src[k], mask = s >> 63;
        const uint8_t *bits = (const uint8_t *)PICK(abits, bbits, mask);
        int64_t r = (int64_t)(((uint64_t)aoff & ~(uint64_t)mask) | ((uint64_t)boff & (uint64_t)mask)) + (s ^ mask);
        int v = (bits[r >> 3] >> (r & 7)) & 1;
        put_bit(out, n + k, v);
        zeros += !v;
    }
    return zeros;
}

/* rows src[0..cnt) (s >= 0: row s of a, else row ~s of b) of one column into output rows [n, n + cnt) */
static int copy_column(const DbspColumn *ca, const DbspColumn *cb, const int64_t *src, int64_t cnt, int64_t n,
                       DbspOutColumn *o) {
    if (o->validity) {
        if (ca->validity && cb->validity) {
            o->null_count += copy_bits(ca->validity, ca->offset, cb->validity, cb->offset, src, cnt, n, o->validity);
        } else {
            int64_t nulls = 0;
            for (int64_t k = 0; k < cnt; k++) {
                int64_t s = src[k];
                int v = s >= 0 ? dbsp_col_valid(ca, s) : dbsp_col_valid(cb, ~s);
                put_bit(o->validity, n + k, v);
                nulls += !v;
            }
            o->null_count += nulls;
        }
    }
    if (o->type == DBSP_BOOL) {
        copy_bits((const uint8_t *)ca->values, ca->offset, (const uint8_t *)cb->values, cb->offset, src, cnt, n,
                  (uint8_t *)o->values);
    } else if (dbsp_type_class(o->type) == DBSP_CLASS_BYTES) {
        if (is_large(o->type)) COPY_BYTES(int64_t, INT64_MAX);
        else COPY_BYTES(int32_t, (int64_t)INT32_MAX);
    } else {
        switch (dbsp_type_width(o->type)) {
        case 1: COPY_FIXED(uint8_t); break;
        case 2: COPY_FIXED(uint16_t); break;
        case 4: COPY_FIXED(uint32_t); break;
        default: COPY_FIXED(uint64_t); break;
        }
    }
    return DBSP_OK;
}

/* the row hash of row i of x: from its hashes (xrh; the key hash for a whole-row key), else computed */
static inline uint64_t row_hash(const DbspBatch *x, const uint64_t *xkh, const uint64_t *xrh, int32_t nkeys,
                                int64_t i) {
    return nkeys == 0 ? xkh[i] : xrh ? xrh[i] : dbsp_hash_row(x, i, NULL, 0);
}

int dbsp_merge_cursor_step(const DbspBatch *a, const uint64_t *akh, const uint64_t *arh, const DbspBatch *b,
                           const uint64_t *bkh, const uint64_t *brh, const int32_t *keys, int32_t nkeys,
                           int64_t budget, DbspMergeCursor *m, DbspOutColumn *out, int64_t *w, uint64_t *kh,
                           uint64_t *rh) {
    int64_t i = m->ia, j = m->ib, n = m->n, na = a->nrows, nb = b->nrows;
    int64_t stop = budget >= na + nb - i - j ? na + nb : i + j + (budget > 0 ? budget : 0);
    const int64_t *aw = a->weights, *bw = b->weights;
    /* with a key, rows of equal key hash are ordered by row hash; without given row hashes they are computed
     * only where key hashes meet and the rows differ (and remembered while the walk stays on a row) */
    int64_t arh_at = -1, brh_at = -1;
    uint64_t ah = 0, bh = 0;
    int64_t src[CHUNK];
    int st = DBSP_OK;
    while (i + j < stop && st == DBSP_OK) {
        int64_t cnt = 0;
        while (cnt < CHUNK && i + j < stop) {
            int c;
            if (i == na) c = 1;
            else if (j == nb) c = -1;
            else if (akh[i] != bkh[j]) c = akh[i] < bkh[j] ? -1 : 1;
            else if (nkeys == 0 || (arh && brh)) {
                uint64_t x = nkeys ? arh[i] : akh[i], y = nkeys ? brh[j] : bkh[j];
                c = x != y ? (x < y ? -1 : 1) : dbsp_row_cmp_eqfast(a, i, NULL, b, j, NULL, a->ncols);
            } else if (dbsp_row_cmp(a, i, NULL, b, j, NULL, a->ncols) == 0) {
                c = 0;
            } else {
                if (arh_at != i) { ah = row_hash(a, akh, arh, nkeys, i); arh_at = i; }
                if (brh_at != j) { bh = row_hash(b, bkh, brh, nkeys, j); brh_at = j; }
                c = ah != bh ? (ah < bh ? -1 : 1) : dbsp_row_cmp_eqfast(a, i, NULL, b, j, NULL, a->ncols);
            }
            if (c < 0) {
                src[cnt] = i; w[n + cnt] = aw ? aw[i] : 1; kh[n + cnt] = akh[i];
                if (rh) rh[n + cnt] = arh_at == i ? ah : row_hash(a, akh, arh, nkeys, i);
                cnt++; i++;
            } else if (c > 0) {
                src[cnt] = ~j; w[n + cnt] = bw ? bw[j] : 1; kh[n + cnt] = bkh[j];
                if (rh) rh[n + cnt] = brh_at == j ? bh : row_hash(b, bkh, brh, nkeys, j);
                cnt++; j++;
            } else {
                int64_t s = aw ? aw[i] : 1;
                if ((st = dbsp_add_weight(&s, bw ? bw[j] : 1))) break;
                if (s != 0) {
                    src[cnt] = i; w[n + cnt] = s; kh[n + cnt] = akh[i];
                    if (rh) rh[n + cnt] = arh_at == i ? ah : row_hash(a, akh, arh, nkeys, i);
                    cnt++;
                }
                i++; j++;
            }
        }
        for (int32_t c = 0; c < a->ncols; c++) {
            int cs = copy_column(&a->cols[c], &b->cols[c], src, cnt, n, &out[c]);
            if (cs) return cs;
        }
        n += cnt;
        m->ia = i; m->ib = j; m->n = n;
    }
    return st;
}

/* ---- the k-way merge (merge.h, "k-way"): the same row order, weights and output form as the two-way cursor ---- */

/* rows (sin[r], srow[r]) of one column of k inputs into output rows [n, n + cnt) (design note 2, for k inputs) */
static int copy_column_k(const DbspColumn *const *cc, int32_t k, const uint8_t *sin, const int64_t *srow, int64_t cnt,
                         int64_t n, DbspOutColumn *o) {
    if (o->validity) {
        int64_t nulls = 0;
        for (int64_t r = 0; r < cnt; r++) {
            int v = dbsp_col_valid(cc[sin[r]], srow[r]);
            put_bit(o->validity, n + r, v);
            nulls += !v;
        }
        o->null_count += nulls;
    }
    if (o->type == DBSP_BOOL) {
        for (int64_t r = 0; r < cnt; r++) {
            const DbspColumn *c = cc[sin[r]];
            int64_t at = c->offset + srow[r];
            put_bit((uint8_t *)o->values, n + r, (((const uint8_t *)c->values)[at >> 3] >> (at & 7)) & 1);
        }
    } else if (dbsp_type_class(o->type) == DBSP_CLASS_BYTES) {
        int large = is_large(o->type);
        int64_t limit = large ? INT64_MAX : (int64_t)INT32_MAX;
        int64_t at = large ? ((int64_t *)o->values)[n] : (int64_t)((int32_t *)o->values)[n];
        for (int64_t r = 0; r < cnt; r++) {
            int64_t len;
            const uint8_t *p = dbsp_col_bytes(cc[sin[r]], srow[r], &len);
            if (at + len > limit) return DBSP_ETOOBIG;
            if (len) memcpy(o->data + at, p, (size_t)len);
            at += len;
            if (large) ((int64_t *)o->values)[n + r + 1] = at;
            else ((int32_t *)o->values)[n + r + 1] = (int32_t)at;
        }
    } else {
        int wd = dbsp_type_width(o->type);
        const uint8_t *base[DBSP_MERGE_MAX_K];
        for (int32_t x = 0; x < k; x++) base[x] = (const uint8_t *)cc[x]->values + cc[x]->offset * wd;
#define COPY_K(T)                                                                      \
        do {                                                                           \
            T *ov = (T *)o->values + n;                                                \
            for (int64_t r = 0; r < cnt; r++) ov[r] = ((const T *)base[sin[r]])[srow[r]]; \
        } while (0)
        switch (wd) {
        case 1: COPY_K(uint8_t); break;
        case 2: COPY_K(uint16_t); break;
        case 4: COPY_K(uint32_t); break;
        default: COPY_K(uint64_t); break;
        }
#undef COPY_K
    }
    return DBSP_OK;
}

/* The heads of a k-way merge: per input its row hash at the head, computed at most once per row (design note 3). */
typedef struct {
    const DbspBatch *const *in;
    const uint64_t *const *kh;
    const uint64_t *const *rh;
    int32_t nkeys;
    const int64_t *pos;
    int64_t hat[DBSP_MERGE_MAX_K];
    uint64_t h[DBSP_MERGE_MAX_K];
} KHeads;

static inline uint64_t head_rh(KHeads *s, int32_t x) {
    int64_t i = s->pos[x];
    if (s->hat[x] != i) {
        s->h[x] = row_hash(s->in[x], s->kh[x], s->rh[x], s->nkeys, i);
        s->hat[x] = i;
    }
    return s->h[x];
}

/* canonical order (rows.h) of the heads of inputs x and y: key hash, row hash, values */
static inline int head_cmp(KHeads *s, int32_t x, int32_t y) {
    int64_t i = s->pos[x], j = s->pos[y];
    uint64_t p = s->kh[x][i], q = s->kh[y][j];
    if (p != q) return p < q ? -1 : 1;
    if (s->nkeys != 0) {
        p = head_rh(s, x);
        q = head_rh(s, y);
        if (p != q) return p < q ? -1 : 1;
    }
    return dbsp_row_cmp_eqfast(s->in[x], i, NULL, s->in[y], j, NULL, s->in[x]->ncols);
}

/* The tournament of losers over the k heads (design note 4): leaves 0..K-1 (K the power of two >= k; a leaf past k,
 * or an input out of rows, is dead and loses to every live one), hk[x] the key hash at input x's head (UINT64_MAX
 * when dead). Each inner node keeps its loser with the loser's key hash beside it (one load a level). k_beats is the
 * full order, used only where two heads' key hashes meet: dead last, then canonical order (head_cmp), then input
 * order (so of equal rows the first input's comes first, as a cascade of two-way merges keeps the left side's). */
typedef struct {
    uint64_t k;  /* the loser's key hash */
    int32_t x;   /* the loser */
} KNode;

typedef struct {
    KHeads *s;
    uint32_t K;
    uint64_t hk[DBSP_MERGE_MAX_K];
    uint8_t dead[DBSP_MERGE_MAX_K];
    KNode node[DBSP_MERGE_MAX_K];  /* node[1..K): the loser at each inner node */
} KTree;

static int k_beats(KTree *t, int32_t x, int32_t y) {  /* whether head x comes before head y (their hk[] equal) */
    if (t->dead[x] | t->dead[y]) return t->dead[x] == t->dead[y] ? x < y : t->dead[y];
    int c = head_cmp(t->s, x, y);
    return c != 0 ? c < 0 : x < y;
}

static inline void k_head(KTree *t, const DbspBatch *const *in, const uint64_t *const *kh, const int64_t *pos,
                          int32_t x) {
    if (pos[x] < in[x]->nrows) t->hk[x] = kh[x][pos[x]];
    else { t->hk[x] = UINT64_MAX; t->dead[x] = 1; }
}

/* the winner once leaf w's head moved: w plays the losers on its path to the root */
static inline int32_t k_replay(KTree *t, int32_t w) {
    KNode *node = t->node;
    uint64_t kw = t->hk[w];
    for (uint32_t nd = ((uint32_t)w + t->K) >> 1; nd != 0; nd >>= 1) {
        uint64_t ko = node[nd].k;
        if (ko < kw || (__builtin_expect(ko == kw, 0) && k_beats(t, node[nd].x, w))) {
            int32_t o = node[nd].x;
            node[nd].k = kw;
            node[nd].x = w;
            w = o;
            kw = ko;
        }
    }
    return w;
}

int dbsp_merge_k_step(const DbspBatch *const *in, const uint64_t *const *kh, const uint64_t *const *rh, int32_t k,
                      const int32_t *keys, int32_t nkeys, int64_t budget, int64_t *pos, int64_t *nout,
                      DbspOutColumn *out, int64_t *w, uint64_t *okh, uint64_t *orh) {
    (void)keys;
    if (k < 2 || k > DBSP_MERGE_MAX_K) return DBSP_EINVAL;
    int64_t total = 0, used = 0, n = *nout;
    for (int32_t x = 0; x < k; x++) { total += in[x]->nrows; used += pos[x]; }
    int64_t stop = budget >= total - used ? total : used + (budget > 0 ? budget : 0);
    KHeads s = { in, kh, rh, nkeys, pos, {0}, {0} };
    for (int32_t x = 0; x < k; x++) s.hat[x] = -1;
    const DbspColumn *cc[DBSP_MERGE_MAX_K];
    uint8_t sin[CHUNK];
    int64_t srow[CHUNK];
    int32_t ties[DBSP_MERGE_MAX_K];
    int st = DBSP_OK;
    KTree t;
    int32_t top;
    t.s = &s;
    t.K = 2;
    while ((int32_t)t.K < k) t.K <<= 1;
    {  /* build: the winner of every subtree, bottom up, each inner node keeping its loser */
        int32_t win[2 * DBSP_MERGE_MAX_K];
        for (int32_t x = 0; x < (int32_t)t.K; x++) {
            t.dead[x] = 0;
            if (x < k) k_head(&t, in, kh, pos, x);
            else { t.hk[x] = UINT64_MAX; t.dead[x] = 1; }
            win[t.K + x] = x;
        }
        for (int32_t nd = (int32_t)t.K - 1; nd >= 1; nd--) {
            int32_t a = win[2 * nd], b = win[2 * nd + 1];
            int a_first = t.hk[a] != t.hk[b] ? t.hk[a] < t.hk[b] : k_beats(&t, a, b);
            win[nd] = a_first ? a : b;
            t.node[nd].x = a_first ? b : a;
            t.node[nd].k = t.hk[t.node[nd].x];
        }
        top = win[1];
    }
    while (used < stop && st == DBSP_OK) {
        int64_t cnt = 0;
        while (cnt < CHUNK && used < stop && !t.dead[top]) {
            int32_t best = top, nt = 0;
            int64_t i = pos[best];
            uint64_t kb = t.hk[best];
            int rb_known = orh != NULL;  /* best's row hash: for the output, else once a head meets its key hash */
            uint64_t rb = !rb_known ? 0 : rh[best] != NULL && nkeys != 0 ? rh[best][i] : head_rh(&s, best);
            int64_t sum = in[best]->weights ? in[best]->weights[i] : 1;
            pos[best]++;
            used++;
            k_head(&t, in, kh, pos, best);
            top = k_replay(&t, best);
            /* rows equal to best's: they come next, from other inputs (each input is consolidated), summed into it */
            while (__builtin_expect(t.hk[top] == kb, 0) && !t.dead[top]) {
                int32_t x = top;
                int64_t j = pos[x];
                if (nkeys != 0) {
                    if (!rb_known) { rb = row_hash(in[best], kh[best], rh[best], nkeys, i); rb_known = 1; }
                    if ((rh[x] != NULL ? rh[x][j] : head_rh(&s, x)) != rb) break;
                }
                if (dbsp_row_cmp_eqfast(in[best], i, NULL, in[x], j, NULL, in[best]->ncols) != 0) break;
                if ((st = dbsp_add_weight(&sum, in[x]->weights ? in[x]->weights[j] : 1))) break;
                ties[nt++] = x;
                pos[x]++;
                used++;
                k_head(&t, in, kh, pos, x);
                top = k_replay(&t, x);
            }
            if (st) {  /* the cursor stands before these rows (the tree is left behind: the call returns) */
                pos[best]--;
                used--;
                for (int32_t q = 0; q < nt; q++) { pos[ties[q]]--; used--; }
                break;
            }
            if (sum != 0) {
                sin[cnt] = (uint8_t)best; srow[cnt] = i; w[n + cnt] = sum; okh[n + cnt] = kb;
                if (orh) orh[n + cnt] = rb;
                cnt++;
            }
        }
        for (int32_t c = 0; c < in[0]->ncols; c++) {
            for (int32_t x = 0; x < k; x++) cc[x] = &in[x]->cols[c];
            int cs = copy_column_k(cc, k, sin, srow, cnt, n, &out[c]);
            if (cs) return cs;
        }
        n += cnt;
        *nout = n;
        if (cnt == 0 && st == DBSP_OK) break;  /* (every input is out of rows) */
    }
    return st;
}
