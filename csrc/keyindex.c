/* keyindex.c: the hash index from fixed-width keys to int64 sums (keyindex.h). */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "keyindex.h"
#include "status.h"

#define OCCUPIED (1ULL << 63)
#define PF_AHEAD 16 /* probes prefetched ahead: a large index is bound by memory latency */
#define HUGE_ALIGN ((size_t)2 << 20) /* tables this large sit on 2 MiB pages: a probe then rarely misses the TLB */

struct DbspKeyIndex {
    int32_t nkeys, nvals, stride; /* stride = 2 + nkeys + nvals words: hash, tag, key words, sums */
    int32_t types[DBSP_KEYINDEX_MAX_KEYS];
    int64_t cap, count; /* cap: a power of two */
    int64_t max_bytes;  /* the slot table's limit (0: none) */
    int broken;
    uint64_t *slots;
};

/* A zeroed slot table of n bytes; large ones aligned to and advised for huge pages (as csrc/scratch.c does). */
static uint64_t *alloc_slots(size_t n) {
    if (n < HUGE_ALIGN) return calloc(n, 1);
    void *p = NULL;
    if (posix_memalign(&p, HUGE_ALIGN, n) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, n, MADV_HUGEPAGE);
#endif
    memset(p, 0, n);
    return p;
}

static int fixed_width(int32_t t) { return t > 0 && t < DBSP_TYPE_END && dbsp_type_width(t) != 0; }

int dbsp_keyindex_new(const int32_t *types, int32_t nkeys, int32_t nvals, int64_t max_bytes, DbspKeyIndex **out) {
    *out = NULL;
    if (nkeys < 1 || nkeys > DBSP_KEYINDEX_MAX_KEYS || nvals < 1 || nvals > DBSP_KEYINDEX_MAX_VALS)
        return DBSP_EINVAL;
    for (int32_t k = 0; k < nkeys; k++)
        if (!fixed_width(types[k])) return DBSP_ETYPE;
    DbspKeyIndex *ix = calloc(1, sizeof *ix);
    if (!ix) return DBSP_ENOMEM;
    ix->nkeys = nkeys;
    ix->nvals = nvals;
    ix->stride = 2 + nkeys + nvals;
    ix->max_bytes = max_bytes;
    memcpy(ix->types, types, (size_t)nkeys * sizeof(int32_t));
    ix->cap = 64;
    ix->slots = alloc_slots((size_t)ix->cap * (size_t)ix->stride * 8);
    if (!ix->slots) {
        free(ix);
        return DBSP_ENOMEM;
    }
    *out = ix;
    return DBSP_OK;
}

void dbsp_keyindex_free(DbspKeyIndex *ix) {
    if (!ix) return;
    free(ix->slots);
    free(ix);
}

int64_t dbsp_keyindex_len(const DbspKeyIndex *ix) { return ix->count; }
int64_t dbsp_keyindex_bytes(const DbspKeyIndex *ix) { return ix->cap * ix->stride * 8; }
int dbsp_keyindex_broken(const DbspKeyIndex *ix) { return ix->broken; }

static int check_keys(const DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys) {
    for (int32_t k = 0; k < ix->nkeys; k++) {
        if (keys[k] < 0 || keys[k] >= b->ncols) return DBSP_EINVAL;
        if (b->cols[keys[k]].type != ix->types[k]) return DBSP_ETYPE;
    }
    return DBSP_OK;
}

/* The canonical key words of row r (invariant 1) into w[0..nkeys); returns the tag (OCCUPIED | null mask). */
static inline uint64_t key_words(const DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, int64_t r,
                                 uint64_t *w) {
    uint64_t tag = OCCUPIED;
    for (int32_t k = 0; k < ix->nkeys; k++) {
        const DbspColumn *c = &b->cols[keys[k]];
        if (!dbsp_col_valid(c, r)) {
            w[k] = 0;
            tag |= 1ULL << k;
        } else if (dbsp_type_class(c->type) == DBSP_CLASS_FLOAT) {
            w[k] = dbsp_canon_f64_bits(dbsp_col_f64(c, r));
        } else {
            w[k] = dbsp_col_u64(c, r);
        }
    }
    return tag;
}

/* The slot holding (h, tag, w), or the empty slot where it would go. */
static inline uint64_t *find(const DbspKeyIndex *ix, uint64_t h, uint64_t tag, const uint64_t *w) {
    uint64_t mask = (uint64_t)ix->cap - 1;
    for (uint64_t i = h & mask;; i = (i + 1) & mask) {
        uint64_t *s = ix->slots + i * (uint64_t)ix->stride;
        if (s[1] == 0) return s;
        if (s[0] == h && s[1] == tag && memcmp(s + 2, w, (size_t)ix->nkeys * 8) == 0) return s;
    }
}

static int resize(DbspKeyIndex *ix, int64_t cap) {
    uint64_t *old = ix->slots;
    int64_t ocap = ix->cap;
    uint64_t *fresh = alloc_slots((size_t)cap * (size_t)ix->stride * 8);
    if (!fresh) return DBSP_ENOMEM;
    ix->slots = fresh;
    ix->cap = cap;
    for (int64_t i = 0; i < ocap; i++) {
        const uint64_t *s = old + i * ix->stride;
        if (s[1] == 0) continue;
        uint64_t *d = find(ix, s[0], s[1], s + 2);
        memcpy(d, s, (size_t)ix->stride * 8);
    }
    free(old);
    return DBSP_OK;
}

/* Empty slot s, shifting back the entries after it that probed past it (invariant 3). */
static void remove_slot(DbspKeyIndex *ix, uint64_t *s) {
    uint64_t mask = (uint64_t)ix->cap - 1, st = (uint64_t)ix->stride;
    uint64_t i = (uint64_t)(s - ix->slots) / st, j = i;
    for (;;) {
        j = (j + 1) & mask;
        uint64_t *sj = ix->slots + j * st;
        if (sj[1] == 0) break;
        uint64_t k = sj[0] & mask; /* where the entry at j wants to be */
        int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (stays) continue;
        memcpy(ix->slots + i * st, sj, st * 8);
        i = j;
    }
    memset(ix->slots + i * st, 0, st * 8);
    ix->count--;
}

int dbsp_keyindex_get(const DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const int64_t *sel,
                      const uint64_t *kh, int64_t n, int64_t *acc) {
    int st = check_keys(ix, b, keys);
    if (st != DBSP_OK) return st;
    uint64_t w[DBSP_KEYINDEX_MAX_KEYS], mask = (uint64_t)ix->cap - 1;
    for (int64_t i = 0; i < n; i++) {
        if (i + PF_AHEAD < n) __builtin_prefetch(ix->slots + (kh[i + PF_AHEAD] & mask) * (uint64_t)ix->stride);
        int64_t r = sel ? sel[i] : i;
        if (r < 0 || r >= b->nrows) return DBSP_EINVAL;
        uint64_t tag = key_words(ix, b, keys, r, w);
        const uint64_t *s = find(ix, kh[i], tag, w);
        if (s[1] == 0) continue; /* absent: all sums zero (invariant 2) */
        const int64_t *v = (const int64_t *)(s + 2 + ix->nkeys);
        int64_t *a = acc + i * ix->nvals;
        for (int32_t j = 0; j < ix->nvals; j++)
            if (__builtin_add_overflow(a[j], v[j], &a[j])) return DBSP_EOVERFLOW;
    }
    return DBSP_OK;
}

int dbsp_keyindex_add(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const uint64_t *kh,
                      const int32_t *cols, int64_t sign) {
    if (ix->broken) return DBSP_EINVAL;
    if (sign != 1 && sign != -1) return DBSP_EINVAL;
    int st = check_keys(ix, b, keys);
    if (st != DBSP_OK) return st;
    for (int32_t j = 0; j < ix->nvals; j++) {
        if (cols[j] >= b->ncols) return DBSP_EINVAL;
        if (cols[j] >= 0 && b->cols[cols[j]].type != DBSP_INT64) return DBSP_ETYPE;
    }
    uint64_t w[DBSP_KEYINDEX_MAX_KEYS], lw[DBSP_KEYINDEX_MAX_KEYS], ltag = 0;
    int64_t d[DBSP_KEYINDEX_MAX_VALS];
    int64_t n = b->nrows;
    uint64_t *last = NULL; /* the slot of the previous row's key: rows of one key are adjacent in index order */
    for (int64_t i = 0; i < n; i++) {
        if (i + PF_AHEAD < n)
            __builtin_prefetch(ix->slots + (kh[i + PF_AHEAD] & ((uint64_t)ix->cap - 1)) * (uint64_t)ix->stride);
        int64_t wt = b->weights ? b->weights[i] : 1;
        if (sign < 0) {
            if (wt == INT64_MIN) goto overflow;
            wt = -wt;
        }
        int nonzero = 0;
        for (int32_t j = 0; j < ix->nvals; j++) {
            if (cols[j] < 0) {
                d[j] = wt;
            } else {
                const DbspColumn *c = &b->cols[cols[j]];
                int64_t x = dbsp_col_valid(c, i) ? ((const int64_t *)c->values)[c->offset + i] : 0;
                if (__builtin_mul_overflow(x, wt, &d[j])) goto overflow;
            }
            nonzero |= d[j] != 0;
        }
        if (!nonzero) continue;
        uint64_t tag = key_words(ix, b, keys, i, w);
        uint64_t *s = last && last[0] == kh[i] && ltag == tag && memcmp(lw, w, (size_t)ix->nkeys * 8) == 0
                          ? last : find(ix, kh[i], tag, w);
        last = NULL;
        if (s[1] == 0) { /* a new entry: grow first if the table would pass 3/4 (invariant 3) */
            if ((ix->count + 1) * 4 > ix->cap * 3) {
                if (ix->max_bytes && ix->cap * 2 * ix->stride * 8 > ix->max_bytes) {
                    ix->broken = 1;
                    return DBSP_ETOOBIG;
                }
                if (resize(ix, ix->cap * 2) != DBSP_OK) {
                    ix->broken = 1;
                    return DBSP_ENOMEM;
                }
                s = find(ix, kh[i], tag, w);
            }
            s[0] = kh[i];
            s[1] = tag;
            memcpy(s + 2, w, (size_t)ix->nkeys * 8);
            memcpy(s + 2 + ix->nkeys, d, (size_t)ix->nvals * 8);
            ix->count++;
            last = s, ltag = tag, memcpy(lw, w, (size_t)ix->nkeys * 8);
            continue;
        }
        int64_t *v = (int64_t *)(s + 2 + ix->nkeys);
        int zero = 1;
        for (int32_t j = 0; j < ix->nvals; j++) {
            if (__builtin_add_overflow(v[j], d[j], &v[j])) goto overflow;
            zero &= v[j] == 0;
        }
        if (zero) {
            remove_slot(ix, s); /* invariant 2; entries may have shifted: no slot is remembered */
        } else {
            last = s, ltag = tag, memcpy(lw, w, (size_t)ix->nkeys * 8);
        }
    }
    if (ix->cap > 64 && ix->count * 16 < ix->cap) { /* mostly emptied: shrink (a failure to shrink is harmless) */
        int64_t cap = ix->cap;
        while (cap > 64 && ix->count * 4 < cap) cap >>= 1;
        (void)resize(ix, cap);
    }
    return DBSP_OK;
overflow:
    ix->broken = 1;
    return DBSP_EOVERFLOW;
}

int dbsp_keyindex_check(const DbspKeyIndex *ix) {
    int64_t seen = 0;
    if (ix->count * 4 > ix->cap * 3) return DBSP_EINVAL;
    for (int64_t i = 0; i < ix->cap; i++) {
        const uint64_t *s = ix->slots + i * ix->stride;
        if (s[1] == 0) continue;
        seen++;
        if (find(ix, s[0], s[1], s + 2) != s) return DBSP_EINVAL;
        const int64_t *v = (const int64_t *)(s + 2 + ix->nkeys);
        int zero = 1;
        for (int32_t j = 0; j < ix->nvals; j++) zero &= v[j] == 0;
        if (zero) return DBSP_EINVAL;
    }
    return seen == ix->count ? DBSP_OK : DBSP_EINVAL;
}
