/* keyindex.c: the hash index from fixed-width keys to int64 sums (keyindex.h). */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "keyindex.h"
#include "status.h"

#define OCCUPIED (1ULL << 63)
#define NULL_SHIFT 55                    /* a slot's head word: OCCUPIED | null mask << 55 | hash bits 0-54 */
#define HASH_BITS ((1ULL << NULL_SHIFT) - 1)
#define PF_AHEAD 16 /* probes prefetched ahead: a large index is bound by memory latency */
#define HUGE_ALIGN ((size_t)2 << 20) /* tables this large are mapped pages, aligned for 2 MiB (huge) pages */
#define MOVE_PER_ROW 8 /* old slots moved per probing row while growing (invariant 5) */

/* Invariant 6: bytes of every index's slot tables in the process, and the budget on them (0: none). */
static _Atomic int64_t g_total = 0;
static _Atomic int64_t g_limit = 0;

/* A slot table: cap (a power of two) slots of stride words. */
typedef struct {
    uint64_t *slots;
    int64_t cap;
    void *base;    /* what to unmap (mapped tables), NULL for a calloc'ed one */
    size_t mapped; /* bytes mapped at base */
} Table;

struct DbspKeyIndex {
    int32_t nkeys, nvals, stride; /* stride = 1 + nkeys + nvals words: head (hash and tag), key words, sums */
    int32_t types[DBSP_KEYINDEX_MAX_KEYS];
    int64_t count;      /* entries in both tables */
    int64_t max_bytes;  /* the slot tables' limit (0: none) */
    int broken;
    Table cur;          /* the table new entries go to */
    Table old;          /* while growing (old.slots != NULL): the table being moved into cur (invariant 5) */
    uint64_t start;     /* growing: the old slot the move began at (empty when it began) */
    uint64_t moved;     /* growing: old slots moved so far, from start on (so [start, start + moved) is empty) */
    int64_t old_added;  /* growing: new keys put in the old table (at most an eighth of its slots) */
    int64_t spilled;    /* growing: new keys put in cur though their old home is not moved (lookups look twice) */
    int64_t spills;     /* spilled keys, ever (tests) */
    int huge_later;     /* cur was mapped without huge-page advice: give it once growing ends */
};

/* A zeroed table of cap slots. Small ones come from calloc; large ones are anonymous pages aligned to 2 MiB, which
 * the kernel zeroes as they are first written (1.4-2 us per 4 KiB page here: 55-80 ms for a 160 MiB table). With `huge`
 * (a bulk add that will write most of the table anyway) they are advised for transparent huge pages at once, which
 * halves the cost of a cold probe. A table that grows by small steps is not: the first write of each 2 MiB page
 * would then fault in a whole zeroed huge page (and, on a fragmented host, compact memory first: measured 0.35 s
 * for 160 MiB) inside a step. It gets the advice once growing ends (khugepaged then collapses it in the background);
 * meanwhile its 4 KiB pages fault in one by one as the move and new keys reach them, spread over the steps that grow
 * it. (Prefaulting them on a thread of their own was tried: on two cores, with a merger thread beside the steps, it
 * took CPU from the steps and their p99 rose.) */
static int table_alloc(Table *t, int64_t cap, int32_t stride, int huge) {
    size_t n = (size_t)cap * (size_t)stride * 8;
    memset(t, 0, sizeof *t);
    if (n < HUGE_ALIGN) {
        t->slots = calloc(n, 1);
        if (!t->slots) return DBSP_ENOMEM;
        t->cap = cap;
        return DBSP_OK;
    }
    size_t len = n + HUGE_ALIGN;
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return DBSP_ENOMEM;
    t->cap = cap;
    t->base = p;
    t->mapped = len;
    t->slots = (uint64_t *)(((uintptr_t)p + HUGE_ALIGN - 1) & ~(uintptr_t)(HUGE_ALIGN - 1));
#ifdef MADV_HUGEPAGE
    if (huge) madvise(t->slots, n, MADV_HUGEPAGE);
#endif
    return DBSP_OK;
}

static void table_free(Table *t, int32_t stride) {
    if (t->slots) atomic_fetch_sub(&g_total, t->cap * (int64_t)stride * 8);
    if (t->base) munmap(t->base, t->mapped);
    else free(t->slots);
    memset(t, 0, sizeof *t);
}

/* Invariant 6: count `bytes` of a table about to be allocated against the process-wide budget; 0 (nothing counted)
 * when the tables held plus these would pass it. One atomic add, so indexes growing on several worker threads at
 * once cannot pass the budget together. `check` 0: count without checking (a new index's first table, a shrink). */
static int budget_take(int64_t bytes, int check) {
    int64_t after = atomic_fetch_add(&g_total, bytes) + bytes, limit = atomic_load(&g_limit);
    if (check && limit > 0 && after > limit) {
        atomic_fetch_sub(&g_total, bytes);
        return 0;
    }
    return 1;
}

void dbsp_keyindex_set_budget(int64_t bytes) { atomic_store(&g_limit, bytes > 0 ? bytes : 0); }
int64_t dbsp_keyindex_budget(void) { return atomic_load(&g_limit); }
int64_t dbsp_keyindex_total_bytes(void) { return atomic_load(&g_total); }

static void table_advise_huge(Table *t, int32_t stride) {
#ifdef MADV_HUGEPAGE
    if (t->base) madvise(t->slots, (size_t)t->cap * (size_t)stride * 8, MADV_HUGEPAGE);
#else
    (void)t, (void)stride;
#endif
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
    ix->stride = 1 + nkeys + nvals;
    ix->max_bytes = max_bytes;
    memcpy(ix->types, types, (size_t)nkeys * sizeof(int32_t));
    if (table_alloc(&ix->cur, 64, ix->stride, 0) != DBSP_OK) {
        free(ix);
        return DBSP_ENOMEM;
    }
    budget_take(64 * (int64_t)ix->stride * 8, 0);
    *out = ix;
    return DBSP_OK;
}

void dbsp_keyindex_free(DbspKeyIndex *ix) {
    if (!ix) return;
    table_free(&ix->cur, ix->stride);
    table_free(&ix->old, ix->stride);
    free(ix);
}

int64_t dbsp_keyindex_len(const DbspKeyIndex *ix) { return ix->count; }
int64_t dbsp_keyindex_bytes(const DbspKeyIndex *ix) { return (ix->cur.cap + ix->old.cap) * ix->stride * 8; }
int dbsp_keyindex_broken(const DbspKeyIndex *ix) { return ix->broken; }
int dbsp_keyindex_growing(const DbspKeyIndex *ix) { return ix->old.slots != NULL; }
int64_t dbsp_keyindex_spills(const DbspKeyIndex *ix) { return ix->spills; }

/* Whether a column's values can be summed as int64 (dbsp_keyindex_add): integers that fit, dates, timestamps. */
static int summable(int32_t t) {
    int cls = dbsp_type_class(t);
    return (cls == DBSP_CLASS_SIGNED || cls == DBSP_CLASS_UNSIGNED) && t != DBSP_UINT64;
}

static int check_keys(const DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys) {
    for (int32_t k = 0; k < ix->nkeys; k++) {
        if (keys[k] < 0 || keys[k] >= b->ncols) return DBSP_EINVAL;
        if (b->cols[keys[k]].type != ix->types[k]) return DBSP_ETYPE;
    }
    return DBSP_OK;
}

/* The canonical key words of row r (invariant 1) into w[0..nkeys); returns the tag (OCCUPIED | null mask << 55),
 * which head() joins to the key hash. */
static inline uint64_t key_words(const DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, int64_t r,
                                 uint64_t *w) {
    uint64_t tag = OCCUPIED;
    for (int32_t k = 0; k < ix->nkeys; k++) {
        const DbspColumn *c = &b->cols[keys[k]];
        if (!dbsp_col_valid(c, r)) {
            w[k] = 0;
            tag |= 1ULL << (NULL_SHIFT + k);
        } else if (dbsp_type_class(c->type) == DBSP_CLASS_FLOAT) {
            w[k] = dbsp_canon_f64_bits(dbsp_col_f64(c, r));
        } else {
            w[k] = dbsp_col_u64(c, r);
        }
    }
    return tag;
}

static inline int same_words(const uint64_t *a, const uint64_t *b, int32_t n) {
    for (int32_t k = 0; k < n; k++)  /* a loop, not memcmp: keys are a few words, and a libc call per probe
                                        measured 6% of a 1k-row group-by step */
        if (a[k] != b[k]) return 0;
    return 1;
}

/* A slot's head word (invariant 3): the tag of key_words (OCCUPIED, null mask) over the low 55 bits of the key hash,
 * which place the entry (no table has 2^55 slots). Never 0, so 0 marks an empty slot. */
static inline uint64_t head(uint64_t h, uint64_t tag) { return (h & HASH_BITS) | tag; }

/* The slot of table t holding the key (head hd, words w), or the empty slot where it would go. */
static inline uint64_t *find(const DbspKeyIndex *ix, const Table *t, uint64_t hd, const uint64_t *w) {
    uint64_t mask = (uint64_t)t->cap - 1;
    for (uint64_t i = hd & mask;; i = (i + 1) & mask) {
        uint64_t *s = t->slots + i * (uint64_t)ix->stride;
        if (s[0] == 0) return s;
        if (s[0] == hd && same_words(s + 1, w, ix->nkeys)) return s;
    }
}

/* Whether old slot i lies in the part already moved into cur (growing only). */
static inline int old_moved(const DbspKeyIndex *ix, uint64_t i) {
    return ((i - ix->start) & ((uint64_t)ix->old.cap - 1)) < ix->moved;
}

/* The slot holding the key (head hd, words w), or NULL (invariant 5: a key whose old home is moved is in cur; one whose
 * old home is not moved yet is in old, or in cur only when some new key spilled there). */
static inline uint64_t *lookup(const DbspKeyIndex *ix, uint64_t hd, const uint64_t *w) {
    if (ix->old.slots && !old_moved(ix, hd & ((uint64_t)ix->old.cap - 1))) {
        uint64_t *s = find(ix, &ix->old, hd, w);
        if (s[0] != 0) return s;
        if (!ix->spilled) return NULL;
    }
    uint64_t *s = find(ix, &ix->cur, hd, w);
    return s[0] != 0 ? s : NULL;
}

/* The empty slot for a new key, and its table (invariant 5): while growing, in old when the key's home there is not
 * moved yet, so that the new table's pages are first written by the move, in order, rather than by new keys at
 * random (each first write of a page costs a page fault and its zeroing); in cur when the old table holds its
 * share of new keys already or the key's probe run reaches the moved part (a spill). */
static uint64_t *new_slot(DbspKeyIndex *ix, uint64_t hd, const uint64_t *w, Table **tab) {
    if (ix->old.slots && !old_moved(ix, hd & ((uint64_t)ix->old.cap - 1))) {
        if (ix->old_added * 8 < ix->old.cap) {
            uint64_t *s = find(ix, &ix->old, hd, w);
            if (!old_moved(ix, (uint64_t)(s - ix->old.slots) / (uint64_t)ix->stride)) {
                ix->old_added++;
                *tab = &ix->old;
                return s;
            }
        }
        ix->spilled++;
        ix->spills++;
    }
    *tab = &ix->cur;
    return find(ix, &ix->cur, hd, w);
}

/* Move the next old slots into cur: at least `budget`, then on to the end of the cluster (the next empty slot),
 * so that a key's whole probe run moves at once (invariant 5). Ends growing once every old slot is moved. */
static void move_some(DbspKeyIndex *ix, int64_t budget) {
    uint64_t st = (uint64_t)ix->stride, omask = (uint64_t)ix->old.cap - 1;
    while (ix->moved < (uint64_t)ix->old.cap) {
        uint64_t *s = ix->old.slots + ((ix->start + ix->moved) & omask) * st;
        if (s[0] == 0 && budget <= 0) return; /* at a cluster boundary with the budget spent */
        if (s[0] != 0) {
            memcpy(find(ix, &ix->cur, s[0], s + 1), s, st * 8);
            memset(s, 0, st * 8);
        }
        ix->moved++;
        budget--;
    }
    table_free(&ix->old, ix->stride);
    ix->start = ix->moved = 0;
    ix->old_added = ix->spilled = 0;
    if (ix->huge_later) {
        table_advise_huge(&ix->cur, ix->stride);
        ix->huge_later = 0;
    }
}

/* Start growing into a table of twice the slots (invariant 5): the current one becomes old and moves over as rows
 * arrive. `rows`: the rows of the call that grows it; a bulk call (at least a quarter of the new table's slots in
 * rows, such as a load) moves every slot at once, its cost a part of the call's own, and the new table gets the
 * huge-page advice at once (table_alloc). */
static int grow(DbspKeyIndex *ix, int64_t rows) {
    int64_t cap = ix->cur.cap * 2;
    int bulk = rows * 4 >= cap;
    if ((ix->max_bytes && cap * ix->stride * 8 > ix->max_bytes) /* the table it grows to (the old one is freed) */
        || !budget_take(cap * ix->stride * 8, 1)) {            /* invariant 6: beside every table held now */
        ix->broken = 1;
        return DBSP_ETOOBIG;
    }
    Table fresh;
    if (table_alloc(&fresh, cap, ix->stride, bulk) != DBSP_OK) {
        atomic_fetch_sub(&g_total, cap * (int64_t)ix->stride * 8);
        ix->broken = 1;
        return DBSP_ENOMEM;
    }
    ix->huge_later = fresh.base != NULL && !bulk;
    ix->old = ix->cur;
    ix->cur = fresh;
    uint64_t st = (uint64_t)ix->stride, omask = (uint64_t)ix->old.cap - 1;
    uint64_t i = 0;
    while (ix->old.slots[i * st] != 0) i = (i + 1) & omask; /* an empty slot: at most 3/4 are full */
    ix->start = i;
    ix->moved = 0;
    if (bulk) move_some(ix, ix->old.cap);
    return DBSP_OK;
}

/* Rehash every entry into a fresh table of cap slots at once (shrinking a mostly emptied index; not growing). */
static int rehash(DbspKeyIndex *ix, int64_t cap) {
    Table fresh;
    if (table_alloc(&fresh, cap, ix->stride, 0) != DBSP_OK) return DBSP_ENOMEM;
    budget_take(cap * (int64_t)ix->stride * 8, 0); /* smaller than the table it replaces */
    for (int64_t i = 0; i < ix->cur.cap; i++) {
        const uint64_t *s = ix->cur.slots + i * ix->stride;
        if (s[0] == 0) continue;
        memcpy(find(ix, &fresh, s[0], s + 1), s, (size_t)ix->stride * 8);
    }
    table_free(&ix->cur, ix->stride);
    ix->cur = fresh;
    return DBSP_OK;
}

/* Empty slot s of table t, shifting back the entries after it that probed past it (invariant 3). */
static void remove_slot(DbspKeyIndex *ix, Table *t, uint64_t *s) {
    uint64_t mask = (uint64_t)t->cap - 1, st = (uint64_t)ix->stride;
    uint64_t i = (uint64_t)(s - t->slots) / st, j = i;
    for (;;) {
        j = (j + 1) & mask;
        uint64_t *sj = t->slots + j * st;
        if (sj[0] == 0) break;
        uint64_t k = sj[0] & mask; /* where the entry at j wants to be */
        int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (stays) continue;
        memcpy(t->slots + i * st, sj, st * 8);
        i = j;
    }
    memset(t->slots + i * st, 0, st * 8);
    ix->count--;
}

static inline void prefetch_key(const DbspKeyIndex *ix, uint64_t h) {
    __builtin_prefetch(ix->cur.slots + (h & ((uint64_t)ix->cur.cap - 1)) * (uint64_t)ix->stride);
    if (ix->old.slots) __builtin_prefetch(ix->old.slots + (h & ((uint64_t)ix->old.cap - 1)) * (uint64_t)ix->stride);
}

static int get_into(const DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const int64_t *sel,
                    const uint64_t *kh, int64_t n, int64_t *acc, int64_t **slots) {
    int st = check_keys(ix, b, keys);
    if (st != DBSP_OK) return st;
    uint64_t w[DBSP_KEYINDEX_MAX_KEYS];
    for (int64_t i = 0; i < n; i++) {
        if (i + PF_AHEAD < n) prefetch_key(ix, kh[i + PF_AHEAD]);
        int64_t r = sel ? sel[i] : i;
        if (r < 0 || r >= b->nrows) return DBSP_EINVAL;
        uint64_t hd = head(kh[i], key_words(ix, b, keys, r, w));
        uint64_t *s = lookup(ix, hd, w);
        if (slots) slots[i] = s ? (int64_t *)(s + 1 + ix->nkeys) : NULL;
        if (!s) continue; /* absent: all sums zero (invariant 2) */
        const int64_t *v = (const int64_t *)(s + 1 + ix->nkeys);
        int64_t *a = acc + i * ix->nvals;
        for (int32_t j = 0; j < ix->nvals; j++)
            if (__builtin_add_overflow(a[j], v[j], &a[j])) return DBSP_EOVERFLOW;
    }
    return DBSP_OK;
}

int dbsp_keyindex_get(const DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const int64_t *sel,
                      const uint64_t *kh, int64_t n, int64_t *acc) {
    return get_into(ix, b, keys, sel, kh, n, acc, NULL);
}

int dbsp_keyindex_get_slots(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const int64_t *sel,
                            const uint64_t *kh, int64_t n, int64_t *acc, int64_t **slots) {
    if (ix->broken) return DBSP_EINVAL;
    return get_into(ix, b, keys, sel, kh, n, acc, slots);
}

void dbsp_keyindex_set_slot(DbspKeyIndex *ix, int64_t *slot, const int64_t *vals, int64_t vstride) {
    for (int32_t j = 0; j < ix->nvals; j++) slot[j] = vals[j * vstride];
}

int dbsp_keyindex_add(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const uint64_t *kh,
                      const int32_t *cols, int64_t sign) {
    return dbsp_keyindex_add_before(ix, b, keys, kh, cols, sign, NULL);
}

int dbsp_keyindex_add_before(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const uint64_t *kh,
                             const int32_t *cols, int64_t sign, int64_t *before) {
    if (ix->broken) return DBSP_EINVAL;
    if (sign != 1 && sign != -1) return DBSP_EINVAL;
    int st = check_keys(ix, b, keys);
    if (st != DBSP_OK) return st;
    for (int32_t j = 0; j < ix->nvals; j++) {
        int32_t c = cols[j] <= -2 ? -2 - cols[j] : cols[j];
        if (c >= b->ncols) return DBSP_EINVAL;
        if (cols[j] >= 0 && !summable(b->cols[c].type)) return DBSP_ETYPE;
    }
    uint64_t w[DBSP_KEYINDEX_MAX_KEYS], lw[DBSP_KEYINDEX_MAX_KEYS], lhd = 0;
    int64_t d[DBSP_KEYINDEX_MAX_VALS];
    int64_t n = b->nrows;
    uint64_t *last = NULL; /* the slot of the previous row's key: rows of one key are adjacent in index order */
    Table *ltab = NULL;    /* the table it is in */
    for (int64_t i = 0; i < n; i++) {
        if (i + PF_AHEAD < n) prefetch_key(ix, kh[i + PF_AHEAD]);
        int64_t wt = b->weights ? b->weights[i] : 1;
        if (sign < 0) {
            if (wt == INT64_MIN) goto overflow;
            wt = -wt;
        }
        int nonzero = 0;
        for (int32_t j = 0; j < ix->nvals; j++) {
            if (cols[j] == -1) {
                d[j] = wt;
            } else if (cols[j] <= -2) {
                d[j] = dbsp_col_valid(&b->cols[-2 - cols[j]], i) ? wt : 0;
            } else {
                const DbspColumn *c = &b->cols[cols[j]];
                int64_t x = !dbsp_col_valid(c, i) ? 0
                            : c->type == DBSP_INT64 ? ((const int64_t *)c->values)[c->offset + i]
                                                    : (int64_t)dbsp_col_u64(c, i);
                if (__builtin_mul_overflow(x, wt, &d[j])) goto overflow;
            }
            nonzero |= d[j] != 0;
        }
        if (!nonzero && !before) continue;
        uint64_t hd = head(kh[i], key_words(ix, b, keys, i, w));
        uint64_t *s;
        Table *tab;
        if (last && lhd == hd && same_words(lw, w, ix->nkeys)) {
            s = last, tab = ltab;
        } else {
            if (ix->old.slots) move_some(ix, MOVE_PER_ROW); /* growing: every fresh probe moves a few slots first */
            s = lookup(ix, hd, w);
            tab = s && ix->old.slots && (uint64_t)(s - ix->old.slots) < (uint64_t)ix->old.cap * ix->stride
                      ? &ix->old : &ix->cur;
        }
        last = NULL;
        if (before) { /* the key's sums before this row */
            int64_t *o = before + i * ix->nvals;
            if (s) memcpy(o, s + 1 + ix->nkeys, (size_t)ix->nvals * 8);
            else memset(o, 0, (size_t)ix->nvals * 8);
        }
        if (!nonzero) {
            if (s) last = s, ltab = tab, lhd = hd, memcpy(lw, w, (size_t)ix->nkeys * 8);
            continue;
        }
        if (!s) { /* a new entry, in cur; past 3/4, start growing (invariants 3, 5) */
            if (!ix->old.slots && (ix->count + 1) * 4 > ix->cur.cap * 3) {
                st = grow(ix, n);
                if (st != DBSP_OK) return st;
                move_some(ix, MOVE_PER_ROW);
            }
            s = new_slot(ix, hd, w, &tab);
            s[0] = hd;
            memcpy(s + 1, w, (size_t)ix->nkeys * 8);
            memcpy(s + 1 + ix->nkeys, d, (size_t)ix->nvals * 8);
            ix->count++;
            last = s, ltab = tab, lhd = hd, memcpy(lw, w, (size_t)ix->nkeys * 8);
            continue;
        }
        int64_t *v = (int64_t *)(s + 1 + ix->nkeys);
        int zero = 1;
        for (int32_t j = 0; j < ix->nvals; j++) {
            if (__builtin_add_overflow(v[j], d[j], &v[j])) goto overflow;
            zero &= v[j] == 0;
        }
        if (zero) {
            remove_slot(ix, tab, s); /* invariant 2; entries may have shifted: no slot is remembered */
        } else {
            last = s, ltab = tab, lhd = hd, memcpy(lw, w, (size_t)ix->nkeys * 8);
        }
    }
    if (!ix->old.slots && ix->cur.cap > 64 && ix->count * 16 < ix->cur.cap) {
        /* mostly emptied: shrink at once (a failure to shrink is harmless) */
        int64_t cap = ix->cur.cap;
        while (cap > 64 && ix->count * 4 < cap) cap >>= 1;
        (void)rehash(ix, cap);
    }
    return DBSP_OK;
overflow:
    ix->broken = 1;
    return DBSP_EOVERFLOW;
}

int dbsp_keyindex_put(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, int64_t r, uint64_t h,
                      const int64_t *vals, int64_t vstride, int64_t more) {
    if (ix->broken) return DBSP_EINVAL;
    int st = check_keys(ix, b, keys);
    if (st != DBSP_OK) return st;
    if (r < 0 || r >= b->nrows) return DBSP_EINVAL;
    uint64_t w[DBSP_KEYINDEX_MAX_KEYS];
    uint64_t hd = head(h, key_words(ix, b, keys, r, w));
    int zero = 1;
    if (vals)
        for (int32_t j = 0; j < ix->nvals; j++) zero &= vals[j * vstride] == 0;
    if (ix->old.slots) move_some(ix, MOVE_PER_ROW);
    uint64_t *s = lookup(ix, hd, w);
    if (s) {
        Table *tab = ix->old.slots && (uint64_t)(s - ix->old.slots) < (uint64_t)ix->old.cap * ix->stride
                         ? &ix->old : &ix->cur;
        if (zero) {
            remove_slot(ix, tab, s);
        } else {
            int64_t *v = (int64_t *)(s + 1 + ix->nkeys);
            for (int32_t j = 0; j < ix->nvals; j++) v[j] = vals[j * vstride];
        }
        return DBSP_OK;
    }
    if (zero) return DBSP_OK; /* absent already (invariant 2) */
    if (!ix->old.slots && (ix->count + 1) * 4 > ix->cur.cap * 3) {
        st = grow(ix, more);
        if (st != DBSP_OK) return st;
        move_some(ix, MOVE_PER_ROW);
    }
    Table *tab;
    s = new_slot(ix, hd, w, &tab);
    s[0] = hd;
    memcpy(s + 1, w, (size_t)ix->nkeys * 8);
    int64_t *v = (int64_t *)(s + 1 + ix->nkeys);
    for (int32_t j = 0; j < ix->nvals; j++) v[j] = vals[j * vstride];
    ix->count++;
    return DBSP_OK;
}

/* DBSP_OK when every entry of table t (old: its part not moved yet) is findable from its home, else DBSP_EINVAL;
 * counts the entries into *seen. */
static int check_table(const DbspKeyIndex *ix, const Table *t, int old, int64_t *seen) {
    for (int64_t i = 0; i < t->cap; i++) {
        const uint64_t *s = t->slots + i * ix->stride;
        if (s[0] == 0) continue;
        if (old && old_moved(ix, (uint64_t)i)) return DBSP_EINVAL; /* the moved part is empty */
        (*seen)++;
        if (!(s[0] & OCCUPIED) || (s[0] >> NULL_SHIFT & 0xff) >> ix->nkeys) return DBSP_EINVAL; /* a bad tag */
        if (find(ix, t, s[0], s + 1) != s) return DBSP_EINVAL;
        if (old && old_moved(ix, s[0] & ((uint64_t)t->cap - 1))) return DBSP_EINVAL; /* home moved, entry not */
        if (!old && ix->old.slots && !old_moved(ix, s[0] & ((uint64_t)ix->old.cap - 1))
            && (!ix->spilled || find(ix, &ix->old, s[0], s + 1)[0] != 0))
            return DBSP_EINVAL; /* in cur though its old home is not moved, with no spill; or in both tables */
        const int64_t *v = (const int64_t *)(s + 1 + ix->nkeys);
        int zero = 1;
        for (int32_t j = 0; j < ix->nvals; j++) zero &= v[j] == 0;
        if (zero) return DBSP_EINVAL;
    }
    return DBSP_OK;
}

int dbsp_keyindex_check(const DbspKeyIndex *ix) {
    int64_t seen = 0;
    if (ix->count * 4 > ix->cur.cap * 3) return DBSP_EINVAL;
    if (check_table(ix, &ix->cur, 0, &seen) != DBSP_OK) return DBSP_EINVAL;
    if (ix->old.slots) {
        if (ix->moved >= (uint64_t)ix->old.cap || ix->cur.cap != 2 * ix->old.cap) return DBSP_EINVAL;
        if (check_table(ix, &ix->old, 1, &seen) != DBSP_OK) return DBSP_EINVAL;
        if (ix->old_added * 8 > ix->old.cap) return DBSP_EINVAL;
    }
    return seen == ix->count ? DBSP_OK : DBSP_EINVAL;
}
