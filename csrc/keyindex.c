/* keyindex.c: the hash index from fixed-width keys to int64 sums (keyindex.h). */
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "keyindex.h"
#include "scratch.h"
#include "status.h"

#define HASH_BITS 28   /* a slot word (invariant 3): the low 28 bits of the key hash, which place it, */
#define NULL_SHIFT 28  /* the key's null mask in bits 28-35, */
#define ENTRY_SHIFT 36 /* and 1 + the number of its entry in bits 36-63; 0 is an empty slot */
#define HASH_MASK ((1ULL << HASH_BITS) - 1)
#define TAG_MASK ((1ULL << ENTRY_SHIFT) - 1) /* a slot's tag: hash bits and null mask, what a probe compares first */
#define MAX_SLOTS (1LL << HASH_BITS)         /* a table's home is the hash's low bits: at most 2^28 slots */
#define MAX_ENTRIES ((1LL << (64 - ENTRY_SHIFT)) - 1)
#define PF_AHEAD 16 /* probes prefetched ahead: a large index is bound by memory latency (bench_keyindex_add: 16
                     * and 8 ahead 10-15% faster than 24 and 32, 1k-row adds into 1M keys) */
#define PF_GROUP 16 /* rows whose probes get_into prefetches together: their slots, then the entries */
#define PF_NEAR 8    /* rows ahead whose home slot (prefetched PF_AHEAD rows ahead) is read to prefetch its entry */
#define HUGE_ALIGN ((size_t)2 << 20) /* tables this large are mapped pages, aligned for 2 MiB (huge) pages */
#define PAGE ((size_t)4096)
#define MOVE_PER_ROW 8 /* old slots moved per probing row while growing (invariant 5) */
#define MK DBSP_KEYINDEX_MAX_KEYS
/* A probe's key (invariant 1): words [0, MK) the canonical word of each key column (0 for a null or a
 * variable-width value); for a variable-width column k, word MK + k the address of its bytes and 2 * MK + k their
 * length (both 0 for a null). Entries keep, for such a column, 1 + the offset of a record in the arena instead. */
#define PROBE_WORDS (3 * MK)

/* Invariant 6: bytes of every index's slot tables and entries in the process, and the budget on them (0: none). */
static _Atomic int64_t g_total = 0;
static _Atomic int64_t g_limit = 0;
/* Invariant 8: the key hash bits a tag keeps (tests narrow it so that distinct keys share tags). */
static uint64_t g_hash_mask = ((1ULL << 28) - 1);

/* A slot table: cap (a power of two) slot words. */
typedef struct {
    uint64_t *slots;
    int64_t cap;
    void *base;    /* what to unmap (mapped tables), NULL for a calloc'ed one */
    size_t mapped; /* bytes mapped at base */
    int file;      /* a shared mapping of an unlinked file (invariant 7), not anonymous pages */
} Table;

/* The entries (invariant 3): entry e is the ew words at w + e * ew, its key words then its sums. */
typedef struct {
    uint64_t *w;
    int64_t room;  /* entries allocated */
    int64_t used;  /* entries ever handed out (live ones and free ones below it) */
    int64_t free;  /* the first free entry below used (its word 0 holds the next one), -1 when none */
    size_t bytes;  /* bytes allocated (counted in g_total) */
    int mapped;    /* pages grown by mremap (no copy), else malloc'ed */
    int fd;        /* mapped from this unlinked file (invariant 7), -1 for anonymous pages or malloc */
} Entries;

struct DbspKeyIndex {
    int32_t nkeys, nvals, ew; /* ew = nkeys + nvals words per entry: key words, sums */
    int32_t types[DBSP_KEYINDEX_MAX_KEYS];
    int64_t count;      /* entries in both tables */
    int64_t max_bytes;  /* the limit on the slot table plus the entries (0: none) */
    int broken;
    Table cur;          /* the table new entries go to */
    Table old;          /* while growing (old.slots != NULL): the table being moved into cur (invariant 5) */
    Entries ents;
    uint64_t start;     /* growing: the old slot the move began at (empty when it began) */
    uint64_t moved;     /* growing: old slots moved so far, from start on (so [start, start + moved) is empty) */
    int64_t old_added;  /* growing: new keys put in the old table (at most an eighth of its slots) */
    int64_t spilled;    /* growing: new keys put in cur though their old home is not moved (lookups look twice) */
    int64_t spills;     /* spilled keys, ever (tests) */
    int64_t refusals;   /* stores refused and undone (invariant 4; dbsp_keyindex_note_refusal) */
    int huge_later;     /* cur was mapped without huge-page advice: give it once growing ends */
    char *dir;          /* invariant 7: large regions are files in this directory (NULL: anonymous pages) */
    uint32_t var;       /* invariant 8: bit k set when key column k is variable width (bytes) */
    Entries arena;      /* invariant 8: records of those columns' values (ew 1: room and used count words) */
    int64_t arena_live; /* words of the records live entries point to; the rest of arena.used is garbage */
};

/* Invariant 7: an unlinked file of `bytes` zero bytes in dir, open read-write; -1 on failure. */
static int scratch_file(const char *dir, size_t bytes) {
    int fd = -1;
#ifdef O_TMPFILE
    fd = open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
#endif
    if (fd < 0) { /* a file system without O_TMPFILE: a named file, unlinked at once */
        size_t n = strlen(dir) + 32;
        char *path = malloc(n);
        if (!path) return -1;
        snprintf(path, n, "%s/keyindex-XXXXXX", dir);
        fd = mkstemp(path);
        if (fd >= 0) unlink(path);
        free(path);
        if (fd < 0) return -1;
    }
    /* blocks reserved, not a sparse file: a full disk fails here (the owner walks its batches), never as a SIGBUS
     * when a probe or a put first writes a page */
    if (posix_fallocate(fd, 0, (off_t)bytes) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* A zeroed table of cap slots. Small ones come from calloc; large ones are anonymous pages aligned to 2 MiB, which
 * the kernel zeroes as they are first written (1.4-2 us per 4 KiB page here: 55-80 ms for a 160 MiB table). With `huge`
 * (a bulk add that will write most of the table anyway) they are advised for transparent huge pages at once, which
 * halves the cost of a cold probe. A table that grows by small steps is not: the first write of each 2 MiB page
 * would then fault in a whole zeroed huge page (and, on a fragmented host, compact memory first: measured 0.35 s
 * for 160 MiB) inside a step. It gets the advice once growing ends (khugepaged then collapses it in the background);
 * meanwhile its 4 KiB pages fault in one by one as the move and new keys reach them, spread over the steps that grow
 * it. (Prefaulting them on a thread of their own was tried: on two cores, with a merger thread beside the steps, it
 * took CPU from the steps and their p99 rose.) */
static int table_alloc(Table *t, int64_t cap, int huge, const char *dir) {
    size_t n = (size_t)cap * 8;
    memset(t, 0, sizeof *t);
    if (n < HUGE_ALIGN) {
        t->slots = calloc(n, 1);
        if (!t->slots) return DBSP_ENOMEM;
        t->cap = cap;
        return DBSP_OK;
    }
    if (dir) { /* invariant 7: a shared mapping of an unlinked file, whose pages can leave the process */
        int fd = scratch_file(dir, n);
        if (fd < 0) return DBSP_ENOMEM; /* no room in dir: as no memory (the owner walks its batches) */
        void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd); /* the mapping keeps the file */
        if (p == MAP_FAILED) return DBSP_ENOMEM;
        t->cap = cap;
        t->base = t->slots = p;
        t->mapped = n;
        t->file = 1;
        return DBSP_OK;
    }
    size_t len = n + HUGE_ALIGN;
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return DBSP_ENOMEM;
    t->cap = cap;
    t->base = p;
    t->mapped = len;
    t->slots = (uint64_t *)(((uintptr_t)p + HUGE_ALIGN - 1) & ~(uintptr_t)(HUGE_ALIGN - 1));
    if (huge) dbsp_advise_huge(t->slots, n);
    return DBSP_OK;
}

static void table_free(Table *t) {
    if (t->slots) atomic_fetch_sub(&g_total, t->cap * (int64_t)8);
    if (t->base) munmap(t->base, t->mapped);
    else free(t->slots);
    memset(t, 0, sizeof *t);
}

/* Invariant 6: count `bytes` about to be allocated against the process-wide budget; 0 (nothing counted) when the
 * bytes held plus these would pass it. One atomic add, so indexes growing on several worker threads at once cannot
 * pass the budget together. `check` 0: count without checking (a new index's first table, a shrink). */
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

static void table_advise_huge(Table *t) {
    if (t->base) dbsp_advise_huge(t->slots, (size_t)t->cap * 8);
}

static void entries_free(Entries *e) {
    atomic_fetch_sub(&g_total, (int64_t)e->bytes);
    if (e->mapped) munmap(e->w, e->bytes);
    else free(e->w);
    if (e->fd >= 0) close(e->fd);
    memset(e, 0, sizeof *e);
    e->free = -1;
    e->fd = -1;
}

/* An address range of `bytes` aligned to 2 MiB, reserved (no access, no memory) for a mapping to be put there with
 * MAP_FIXED or MREMAP_FIXED; NULL when none is free. */
static void *aligned_range(size_t bytes) {
    size_t len = bytes + HUGE_ALIGN;
    char *p = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return NULL;
    char *a = (char *)(((uintptr_t)p + HUGE_ALIGN - 1) & ~(uintptr_t)(HUGE_ALIGN - 1));
    if (a > p) munmap(p, (size_t)(a - p));
    if (p + len > a + bytes) munmap(a + bytes, (size_t)(p + len - (a + bytes)));
    return a;
}

/* Room for `room` entries of ew words (invariant 3): malloc'ed while small, then pages that grow by mremap (the
 * kernel moves page tables, not bytes: no copy of a large index inside a step), resident only once written:
 * anonymous, or with `dir` a shared mapping of an unlinked file there that grows with it (invariant 7). Counted
 * against max_bytes (beside the slot table `slot_bytes`) and the budget (invariant 6); on failure nothing
 * changes. */
static int entries_grow(Entries *e, int64_t room, int32_t ew, int64_t max_bytes, int64_t slot_bytes,
                        const char *dir) {
    size_t want = (size_t)room * (size_t)ew * 8, bytes = want;
    int map = want >= HUGE_ALIGN;
    if (map) { /* anonymous: whole 2 MiB pages, so the page that new entries are written into is always whole in
                * the mapping and faults in huge (a partial one at its end would fault in 4 KiB pages) */
        size_t unit = dir ? PAGE : HUGE_ALIGN;
        bytes = (want + unit - 1) & ~(unit - 1);
    }
    if (max_bytes && slot_bytes + (int64_t)bytes > max_bytes) return DBSP_ETOOBIG;
    if (!budget_take((int64_t)bytes - (int64_t)e->bytes, 1)) return DBSP_ETOOBIG;
    void *p = NULL;
    int fd = e->fd; /* a file that cannot grow fails as memory does (the owner walks its batches) */
    if (!map) {
        p = realloc(e->w, bytes);
    } else if (e->mapped && (e->fd >= 0) == (dir != NULL)) { /* grows in place: anonymous, or the same file */
        if (e->fd >= 0) {
            if (posix_fallocate(e->fd, 0, (off_t)bytes) == 0) p = mremap(e->w, e->bytes, bytes, MREMAP_MAYMOVE);
        } else { /* to a 2 MiB-aligned place, so its huge pages stay huge and new ones can be */
            void *at = aligned_range(bytes);
            p = at ? mremap(e->w, e->bytes, bytes, MREMAP_MAYMOVE | MREMAP_FIXED, at) : MAP_FAILED;
            if (p == MAP_FAILED && at) munmap(at, bytes);
        }
        if (p == MAP_FAILED) p = NULL;
    } else { /* first mapped, or moving between anonymous pages and a file: copy what is used */
        fd = dir ? scratch_file(dir, bytes) : -1;
        void *at = dir ? NULL : aligned_range(bytes);
        if (dir ? fd >= 0 : at != NULL) {
            p = dir ? mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                    : mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            if (p == MAP_FAILED) {
                if (at) munmap(at, bytes);
                p = NULL;
                if (fd >= 0) close(fd);
                fd = e->fd;
            } else {
                if (e->w) memcpy(p, e->w, (size_t)e->used * (size_t)ew * 8);
                if (e->mapped) munmap(e->w, e->bytes);
                else free(e->w);
                if (e->fd >= 0) close(e->fd);
            }
        }
    }
    if (!p) {
        atomic_fetch_sub(&g_total, (int64_t)bytes - (int64_t)e->bytes);
        return DBSP_ENOMEM;
    }
    e->w = p;
    e->mapped = map;
    e->fd = map ? fd : -1;
    e->bytes = bytes;
    e->room = (int64_t)(bytes / ((size_t)ew * 8));
    /* anonymous entries on huge pages (kept 2 MiB-aligned through growth): probes land at random in them, and a
     * 4 KiB page per probe misses the TLB. Entries are written in order, so a step that adds keys faults in a fresh
     * huge page once per 2 MiB of them (unless DBSP_HUGEPAGES=0: scratch.c design note 2) */
    if (map && fd < 0) dbsp_advise_huge(p, bytes);
    return DBSP_OK;
}

static inline uint64_t *entry_at(const DbspKeyIndex *ix, int64_t e) { return ix->ents.w + e * (int64_t)ix->ew; }

/* The entry a full slot word points to. */
static inline uint64_t *entry_of(const DbspKeyIndex *ix, uint64_t sw) {
    return entry_at(ix, (int64_t)(sw >> ENTRY_SHIFT) - 1);
}

/* A fresh entry's number into *out: a free one, else the next unused one, growing the room by a quarter while it is
 * malloc'ed and by a sixteenth once mapped (a growth is then an mremap: no copy, so small steps cost little and
 * leave little room unused), never past the 3/4 of the slot table that can point to entries. May move the entries:
 * pointers into them are stale after. */
static int entry_take(DbspKeyIndex *ix, int64_t *out) {
    Entries *e = &ix->ents;
    if (e->free >= 0) {
        *out = e->free;
        e->free = (int64_t)entry_at(ix, e->free)[0];
        return DBSP_OK;
    }
    if (e->used >= MAX_ENTRIES) return DBSP_ETOOBIG;
    if (e->used == e->room) {
        int64_t most = ix->cur.cap / 4 * 3, room = e->room + e->room / (e->mapped ? 16 : 4);
        if (room < 16) room = 16;
        if (room > most) room = most;
        if (room <= e->used) room = e->used + 1;
        int st = entries_grow(e, room, ix->ew, ix->max_bytes, ix->cur.cap * 8 + (int64_t)ix->arena.bytes,
                              ix->dir); /* old not counted */
        if (st != DBSP_OK) return st;
    }
    *out = e->used++;
    return DBSP_OK;
}

/* Words of an arena record of len bytes: a length word, then the bytes, zero-padded to a whole word. */
static inline int64_t rec_words(int64_t len) { return 1 + (len + 7) / 8; }

/* The bytes and length of the record an entry word of a variable-width column points to (invariant 8). */
static inline const uint8_t *rec_bytes(const DbspKeyIndex *ix, uint64_t word, int64_t *len) {
    const uint64_t *r = ix->arena.w + (word - 1);
    *len = (int64_t)r[0];
    return (const uint8_t *)(r + 1);
}

static void entry_give(DbspKeyIndex *ix, int64_t n) {
    uint64_t *ent = entry_at(ix, n);
    for (int32_t k = 0; ix->var >> k; k++) /* its records become garbage (invariant 8) */
        if ((ix->var >> k & 1) && ent[k]) ix->arena_live -= rec_words((int64_t)ix->arena.w[ent[k] - 1]);
    entry_at(ix, n)[0] = (uint64_t)ix->ents.free;
    ix->ents.free = n;
}

/* Invariant 8: copy every live entry's records into a fresh arena of their size (and `extra` words more, and a
 * quarter of room), in slot order, and point the entries at them; the old arena goes. O(slots + live bytes), paid
 * when at least half the arena is garbage, so a removed key's bytes are reclaimed at O(1) amortized. On failure
 * (memory, max_bytes, the budget) nothing changes. */
static int arena_compact(DbspKeyIndex *ix, int64_t extra) {
    Entries fresh = {NULL, 0, 0, -1, 0, 0, -1};
    int64_t room = ix->arena_live + extra;
    room += room / 4;
    if (room < 64) room = 64;
    int st = entries_grow(&fresh, room, 1, ix->max_bytes,
                          (ix->cur.cap + ix->old.cap) * 8 + (int64_t)ix->ents.bytes, ix->dir);
    if (st != DBSP_OK) return st;
    const Table *ts[2] = {&ix->cur, &ix->old};
    for (int i = 0; i < 2; i++) {
        if (!ts[i]->slots) continue;
        for (int64_t x = 0; x < ts[i]->cap; x++) {
            uint64_t sw = ts[i]->slots[x];
            if (sw == 0) continue;
            uint64_t *ent = entry_of(ix, sw);
            for (int32_t k = 0; ix->var >> k; k++) {
                if (!(ix->var >> k & 1) || !ent[k]) continue;
                const uint64_t *r = ix->arena.w + (ent[k] - 1);
                int64_t nw = rec_words((int64_t)r[0]);
                memcpy(fresh.w + fresh.used, r, (size_t)nw * 8);
                ent[k] = (uint64_t)fresh.used + 1;
                fresh.used += nw;
            }
        }
    }
    entries_free(&ix->arena);
    ix->arena = fresh;
    ix->arena_live = fresh.used;
    return DBSP_OK;
}

/* Invariant 8: room in the arena for the records of probe w's non-null variable-width values (by tg's null mask): compacting when at
 * least half the arena is garbage, else growing it by a quarter while malloc'ed, by a sixteenth once mapped. */
static int arena_reserve(DbspKeyIndex *ix, uint64_t tg, const uint64_t *w) {
    Entries *a = &ix->arena;
    int64_t need = 0;
    for (int32_t k = 0; ix->var >> k; k++)
        if ((ix->var >> k & 1) && !(tg >> (NULL_SHIFT + k) & 1)) need += rec_words((int64_t)w[2 * MK + k]);
    if (a->used + need <= a->room) return DBSP_OK;
    int64_t garbage = a->used - ix->arena_live;
    if (garbage * 2 >= a->used && garbage >= need) return arena_compact(ix, need);
    int64_t room = a->room + a->room / (a->mapped ? 16 : 4);
    if (room < a->used + need) room = a->used + need;
    if (room < 64) room = 64;
    return entries_grow(a, room, 1, ix->max_bytes, (ix->cur.cap + ix->old.cap) * 8 + (int64_t)ix->ents.bytes,
                        ix->dir);
}

static int fixed_width(int32_t t) { return t > 0 && t < DBSP_TYPE_END && dbsp_type_width(t) != 0; }
static int var_width(int32_t t) { return t > 0 && t < DBSP_TYPE_END && dbsp_type_class(t) == DBSP_CLASS_BYTES; }

void dbsp_keyindex_test_hash_bits(int32_t bits) {
    g_hash_mask = bits <= 0 || bits >= 28 ? ((1ULL << 28) - 1) : ((1ULL << bits) - 1);
}

int dbsp_keyindex_new(const int32_t *types, int32_t nkeys, int32_t nvals, int64_t max_bytes, DbspKeyIndex **out) {
    *out = NULL;
    if (nkeys < 1 || nkeys > DBSP_KEYINDEX_MAX_KEYS || nvals < 1 || nvals > DBSP_KEYINDEX_MAX_VALS)
        return DBSP_EINVAL;
    uint32_t var = 0;
    for (int32_t k = 0; k < nkeys; k++) {
        if (var_width(types[k])) var |= 1u << k;
        else if (!fixed_width(types[k])) return DBSP_ETYPE;
    }
    DbspKeyIndex *ix = calloc(1, sizeof *ix);
    if (!ix) return DBSP_ENOMEM;
    ix->var = var;
    ix->arena.free = -1;
    ix->arena.fd = -1;
    ix->nkeys = nkeys;
    ix->nvals = nvals;
    ix->ew = nkeys + nvals;
    ix->max_bytes = max_bytes;
    ix->ents.free = -1;
    ix->ents.fd = -1;
    memcpy(ix->types, types, (size_t)nkeys * sizeof(int32_t));
    if (table_alloc(&ix->cur, 64, 0, NULL) != DBSP_OK) {
        free(ix);
        return DBSP_ENOMEM;
    }
    budget_take(64 * (int64_t)8, 0);
    *out = ix;
    return DBSP_OK;
}

void dbsp_keyindex_free(DbspKeyIndex *ix) {
    if (!ix) return;
    table_free(&ix->cur);
    table_free(&ix->old);
    entries_free(&ix->ents);
    entries_free(&ix->arena);
    free(ix->dir);
    free(ix);
}

/* Invariant 7: a table's copy in a file of dir (a large anonymous one), or nothing to do. */
static int table_to_file(Table *t, const char *dir) {
    if (!t->base || t->file) return DBSP_OK;
    Table f;
    int st = table_alloc(&f, t->cap, 0, dir);
    if (st != DBSP_OK) return st;
    memcpy(f.slots, t->slots, (size_t)t->cap * 8);
    munmap(t->base, t->mapped); /* same bytes: nothing to count (invariant 6) */
    *t = f;
    return DBSP_OK;
}

int dbsp_keyindex_set_dir(DbspKeyIndex *ix, const char *dir) {
    char *copy = NULL;
    if (dir && !(copy = strdup(dir))) return DBSP_ENOMEM;
    free(ix->dir);
    ix->dir = copy;
    if (!dir) return DBSP_OK; /* regions made from now on are anonymous; files already made stay */
    int st = table_to_file(&ix->cur, dir);
    if (st == DBSP_OK) st = table_to_file(&ix->old, dir);
    if (st == DBSP_OK && ix->ents.mapped && ix->ents.fd < 0)
        st = entries_grow(&ix->ents, ix->ents.room, ix->ew, 0, 0, dir); /* same room: copied into a file */
    if (st == DBSP_OK && ix->arena.mapped && ix->arena.fd < 0)
        st = entries_grow(&ix->arena, ix->arena.room, 1, 0, 0, dir);
    return st;
}

/* The mapped regions of an index (at most 4: two slot tables, the entries and the arena), or only those that are files
 * (invariant 7): their starts into at, their bytes into len; returns how many. */
static int regions(const DbspKeyIndex *ix, int files_only, void **at, size_t *len) {
    int n = 0;
    const Table *ts[2] = {&ix->cur, &ix->old};
    for (int i = 0; i < 2; i++)
        if (ts[i]->base && (ts[i]->file || !files_only)) at[n] = ts[i]->slots, len[n++] = (size_t)ts[i]->cap * 8;
    if (ix->ents.mapped && (ix->ents.fd >= 0 || !files_only)) at[n] = ix->ents.w, len[n++] = ix->ents.bytes;
    if (ix->arena.mapped && (ix->arena.fd >= 0 || !files_only)) at[n] = ix->arena.w, len[n++] = ix->arena.bytes;
    return n;
}

int64_t dbsp_keyindex_drop_pages(DbspKeyIndex *ix) {
    void *at[4];
    size_t len[4];
    int64_t dropped = 0;
    int n = regions(ix, 1, at, len);
    for (int i = 0; i < n; i++)
        if (madvise(at[i], len[i], MADV_DONTNEED) == 0) dropped += (int64_t)len[i];
    return dropped;
}

int dbsp_keyindex_regions(const DbspKeyIndex *ix, void **at, size_t *len) { return regions(ix, 0, at, len); }

int64_t dbsp_keyindex_len(const DbspKeyIndex *ix) { return ix->count; }
int64_t dbsp_keyindex_bytes(const DbspKeyIndex *ix) {
    return (ix->cur.cap + ix->old.cap) * 8 + (int64_t)ix->ents.bytes + (int64_t)ix->arena.bytes;
}
int dbsp_keyindex_broken(const DbspKeyIndex *ix) { return ix->broken; }
void dbsp_keyindex_unbreak(DbspKeyIndex *ix) { ix->broken = 0; }
void dbsp_keyindex_note_refusal(DbspKeyIndex *ix) { ix->refusals++; }
int64_t dbsp_keyindex_refusals(const DbspKeyIndex *ix) { return ix->refusals; }
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

/* The canonical key words of row r (invariant 1) into w[0..nkeys); returns the null mask in its place in a slot word
 * (bits 28-35), which tag() joins to the key hash. */
static inline uint64_t key_words(const DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, int64_t r,
                                 uint64_t *w) {
    uint64_t nulls = 0;
    for (int32_t k = 0; k < ix->nkeys; k++) {
        const DbspColumn *c = &b->cols[keys[k]];
        if (!dbsp_col_valid(c, r)) {
            w[k] = 0;
            nulls |= 1ULL << (NULL_SHIFT + k);
            if (ix->var >> k & 1) w[MK + k] = w[2 * MK + k] = 0;
        } else if (ix->var >> k & 1) { /* invariant 8: the bytes, compared as bytes */
            int64_t len;
            w[k] = 0;
            w[MK + k] = (uint64_t)(uintptr_t)dbsp_col_bytes(c, r, &len);
            w[2 * MK + k] = (uint64_t)len;
        } else if (dbsp_type_class(c->type) == DBSP_CLASS_FLOAT) {
            w[k] = dbsp_canon_f64_bits(dbsp_col_f64(c, r));
        } else {
            w[k] = dbsp_col_u64(c, r);
        }
    }
    return nulls;
}

static inline int same_words(const uint64_t *a, const uint64_t *b, int32_t n) {
    for (int32_t k = 0; k < n; k++)  /* a loop, not memcmp: keys are a few words, and a libc call per probe
                                        measured 6% of a 1k-row group-by step */
        if (a[k] != b[k]) return 0;
    return 1;
}

/* Whether an entry's key is the probe's w (a tag that matched: their null masks are equal). Fixed-width columns by
 * their words; a variable-width one by its record's length and bytes (invariant 8), never by the hash. */
static inline int same_key(const DbspKeyIndex *ix, const uint64_t *ent, const uint64_t *w) {
    if (!ix->var) return same_words(ent, w, ix->nkeys);
    for (int32_t k = 0; k < ix->nkeys; k++) {
        if (!(ix->var >> k & 1)) {
            if (ent[k] != w[k]) return 0;
        } else if (ent[k]) { /* 0: null, as the probe's (the tags' null masks are equal) */
            int64_t len;
            const uint8_t *p = rec_bytes(ix, ent[k], &len);
            if (len != (int64_t)w[2 * MK + k]
                || (len && memcmp(p, (const void *)(uintptr_t)w[MK + k], (size_t)len) != 0))
                return 0;
        }
    }
    return 1;
}

/* Whether two probes (whose tags are equal) hold the same key. */
static inline int same_probe(const DbspKeyIndex *ix, const uint64_t *a, const uint64_t *b) {
    if (!same_words(a, b, ix->nkeys)) return 0;
    for (int32_t k = 0; ix->var >> k; k++)
        if ((ix->var >> k & 1)
            && (a[2 * MK + k] != b[2 * MK + k]
                || (a[2 * MK + k] && a[MK + k] != b[MK + k]
                    && memcmp((const void *)(uintptr_t)a[MK + k], (const void *)(uintptr_t)b[MK + k],
                              (size_t)a[2 * MK + k]) != 0)))
            return 0;
    return 1;
}

/* Keep probe w in lw (add_before's previous key). */
static inline void keep_probe(const DbspKeyIndex *ix, uint64_t *lw, const uint64_t *w) {
    memcpy(lw, w, (size_t)(ix->var ? PROBE_WORDS : ix->nkeys) * 8);
}

/* The probe of an entry's own key (for check): the record's bytes in place of its arena word (invariant 8). */
static void probe_of_entry(const DbspKeyIndex *ix, const uint64_t *ent, uint64_t *w) {
    memcpy(w, ent, (size_t)ix->nkeys * 8);
    for (int32_t k = 0; ix->var >> k; k++) {
        if (!(ix->var >> k & 1)) continue;
        w[k] = w[MK + k] = w[2 * MK + k] = 0;
        if (ent[k]) {
            int64_t len;
            w[MK + k] = (uint64_t)(uintptr_t)rec_bytes(ix, ent[k], &len);
            w[2 * MK + k] = (uint64_t)len;
        }
    }
}

/* A key's tag (invariant 3): the low 28 bits of its key hash, which place it (no table has more than 2^28 slots;
 * fewer under the test hook of invariant 8), and its null mask (key_words). A full slot word is its tag and 1 + its
 * entry's number above. */
static inline uint64_t tag(uint64_t h, uint64_t nulls) { return (h & g_hash_mask) | nulls; }

/* The slot of table t holding the key (tag tg, words w), or the empty slot where it would go. */
static inline uint64_t *find(const DbspKeyIndex *ix, const Table *t, uint64_t tg, const uint64_t *w) {
    uint64_t mask = (uint64_t)t->cap - 1;
    for (uint64_t i = tg & mask;; i = (i + 1) & mask) {
        uint64_t *s = t->slots + i;
        if (*s == 0) return s;
        if ((*s & TAG_MASK) == tg && same_key(ix, entry_of(ix, *s), w)) return s;
    }
}

/* The first empty slot of table t from the home of tag tg on (for a key known to be absent from t). */
static inline uint64_t *find_empty(const Table *t, uint64_t tg) {
    uint64_t mask = (uint64_t)t->cap - 1;
    uint64_t i = tg & mask;
    while (t->slots[i] != 0) i = (i + 1) & mask;
    return t->slots + i;
}

/* Whether old slot i lies in the part already moved into cur (growing only). */
static inline int old_moved(const DbspKeyIndex *ix, uint64_t i) {
    return ((i - ix->start) & ((uint64_t)ix->old.cap - 1)) < ix->moved;
}

/* The slot holding the key (tag tg, words w), or NULL (invariant 5: a key whose old home is moved is in cur; one whose
 * old home is not moved yet is in old, or in cur only when some new key spilled there). */
static inline uint64_t *lookup(const DbspKeyIndex *ix, uint64_t tg, const uint64_t *w) {
    if (ix->old.slots && !old_moved(ix, tg & ((uint64_t)ix->old.cap - 1))) {
        uint64_t *s = find(ix, &ix->old, tg, w);
        if (*s != 0) return s;
        if (!ix->spilled) return NULL;
    }
    uint64_t *s = find(ix, &ix->cur, tg, w);
    return *s != 0 ? s : NULL;
}

/* The empty slot for a new key, and its table (invariant 5): while growing, in old when the key's home there is not
 * moved yet, so that the new table's pages are first written by the move, in order, rather than by new keys at
 * random (each first write of a page costs a page fault and its zeroing); in cur when the old table holds its
 * share of new keys already or the key's probe run reaches the moved part (a spill). */
static uint64_t *new_slot(DbspKeyIndex *ix, uint64_t tg, const uint64_t *w, Table **tab) {
    if (ix->old.slots && !old_moved(ix, tg & ((uint64_t)ix->old.cap - 1))) {
        if (ix->old_added * 8 < ix->old.cap) {
            uint64_t *s = find(ix, &ix->old, tg, w);
            if (!old_moved(ix, (uint64_t)(s - ix->old.slots))) {
                ix->old_added++;
                *tab = &ix->old;
                return s;
            }
        }
        ix->spilled++;
        ix->spills++;
    }
    *tab = &ix->cur;
    return find(ix, &ix->cur, tg, w);
}

/* Move the next old slots into cur: at least `budget`, then on to the end of the cluster (the next empty slot),
 * so that a key's whole probe run moves at once (invariant 5). Ends growing once every old slot is moved. Entries
 * stay where they are: a slot word moves. */
static void move_some(DbspKeyIndex *ix, int64_t budget) {
    uint64_t omask = (uint64_t)ix->old.cap - 1;
    while (ix->moved < (uint64_t)ix->old.cap) {
        uint64_t *s = ix->old.slots + ((ix->start + ix->moved) & omask);
        if (*s == 0 && budget <= 0) return; /* at a cluster boundary with the budget spent */
        if (*s != 0) {
            *find_empty(&ix->cur, *s & TAG_MASK) = *s;
            *s = 0;
        }
        ix->moved++;
        budget--;
    }
    table_free(&ix->old);
    ix->start = ix->moved = 0;
    ix->old_added = ix->spilled = 0;
    if (ix->huge_later) {
        table_advise_huge(&ix->cur);
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
    if (cap > MAX_SLOTS                                                        /* invariant 3: 28 hash bits */
        || (ix->max_bytes && cap * 8 + (int64_t)(ix->ents.bytes + ix->arena.bytes) > ix->max_bytes) /* old freed */
        || !budget_take(cap * 8, 1)) {                                         /* invariant 6 */
        ix->broken = 1;
        return DBSP_ETOOBIG;
    }
    Table fresh;
    int st = table_alloc(&fresh, cap, bulk, ix->dir);
    if (st != DBSP_OK) {
        atomic_fetch_sub(&g_total, cap * (int64_t)8);
        ix->broken = 1;
        return st;
    }
    ix->huge_later = fresh.base != NULL && !bulk;
    ix->old = ix->cur;
    ix->cur = fresh;
    uint64_t omask = (uint64_t)ix->old.cap - 1;
    uint64_t i = 0;
    while (ix->old.slots[i] != 0) i = (i + 1) & omask; /* an empty slot: at most 3/4 are full */
    ix->start = i;
    ix->moved = 0;
    if (bulk) move_some(ix, ix->old.cap);
    return DBSP_OK;
}

/* Rehash every entry into a fresh table of cap slots at once, and copy the live entries into entries of their own
 * size, in slot order (shrinking a mostly emptied index; not growing). */
static int rehash(DbspKeyIndex *ix, int64_t cap) {
    Table fresh;
    Entries ents = {NULL, 0, 0, -1, 0, 0, -1};
    if (table_alloc(&fresh, cap, 0, ix->dir) != DBSP_OK) return DBSP_ENOMEM;
    budget_take(cap * (int64_t)8, 0); /* smaller than the table it replaces */
    if (ix->count && entries_grow(&ents, ix->count, ix->ew, 0, 0, ix->dir) != DBSP_OK) {
        table_free(&fresh);
        return DBSP_ENOMEM;
    }
    size_t eb = (size_t)ix->ew * 8;
    for (int64_t i = 0; i < ix->cur.cap; i++) {
        uint64_t sw = ix->cur.slots[i];
        if (sw == 0) continue;
        memcpy(ents.w + ents.used * ix->ew, entry_of(ix, sw), eb);
        *find_empty(&fresh, sw & TAG_MASK) = (sw & TAG_MASK) | (uint64_t)(++ents.used) << ENTRY_SHIFT;
    }
    table_free(&ix->cur);
    entries_free(&ix->ents);
    ix->cur = fresh;
    ix->ents = ents;
    if (ix->var && ix->arena.used > ix->arena_live) (void)arena_compact(ix, 0); /* invariant 8; harmless if not */
    return DBSP_OK;
}

/* Empty slot s of table t and free its entry, shifting back the slots after it that probed past it (invariant 3). */
static void remove_slot(DbspKeyIndex *ix, Table *t, uint64_t *s) {
    uint64_t mask = (uint64_t)t->cap - 1;
    uint64_t i = (uint64_t)(s - t->slots), j = i;
    entry_give(ix, (int64_t)(*s >> ENTRY_SHIFT) - 1);
    for (;;) {
        j = (j + 1) & mask;
        uint64_t sj = t->slots[j];
        if (sj == 0) break;
        uint64_t k = sj & mask; /* where the slot at j wants to be */
        int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (stays) continue;
        t->slots[i] = sj;
        i = j;
    }
    t->slots[i] = 0;
    ix->count--;
}

/* The prefetch helpers are always_inline: a function that only loads and prefetches has no effect GCC's
 * interprocedural analysis can see, so where it was not inlined first it was found const and its calls deleted (GCC 12
 * -O2/-O3: dbsp_keyindex_add_before prefetched nothing, get_into no entry; tests/c/test_prefetch_kept.py). */
static inline __attribute__((always_inline)) void prefetch_key(const DbspKeyIndex *ix, uint64_t h) {
    __builtin_prefetch(ix->cur.slots + (h & ((uint64_t)ix->cur.cap - 1)));
    if (ix->old.slots) __builtin_prefetch(ix->old.slots + (h & ((uint64_t)ix->old.cap - 1)));
}

/* The second stage of a probe's prefetch: the entry of the key's home slot (prefetched PF_AHEAD rows ago, so
 * read from the cache by now). A key not at its home gets its first slot's entry, which is often its own. */
static inline __attribute__((always_inline)) void prefetch_entry(const DbspKeyIndex *ix, uint64_t h) {
    uint64_t sw = ix->cur.slots[h & ((uint64_t)ix->cur.cap - 1)];
    if (sw) __builtin_prefetch(entry_of(ix, sw));
    if (ix->old.slots) {
        sw = ix->old.slots[h & ((uint64_t)ix->old.cap - 1)];
        if (sw) __builtin_prefetch(entry_of(ix, sw));
    }
}

static inline __attribute__((always_inline)) void prefetch_row(const DbspKeyIndex *ix, const uint64_t *kh, int64_t i, int64_t n) {
    if (i + PF_AHEAD < n) prefetch_key(ix, kh[i + PF_AHEAD]);
    if (i + PF_NEAR < n) prefetch_entry(ix, kh[i + PF_NEAR]);
}

/* get_into for the commonest key: one 64-bit integer column (int64, uint64, timestamp) without nulls, in an index not
 * growing (one table, invariant 5). Its canonical word is the value's 64 bits and its null mask 0 (invariant 1), so a
 * probe compares the slot's tag and then one entry word (invariant 3): the slot lookup() finds, without key_words' and
 * same_key's per-column dispatch (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, r37-gbk: ~175 instructions a probe of a 1k-row step before). */
static int get_into_int(const DbspKeyIndex *ix, const DbspColumn *c, const int64_t *sel, const uint64_t *kh,
                        int64_t nrows, int64_t n, int64_t *acc, int64_t **slots, int copy) {
    const uint64_t *kv = (const uint64_t *)c->values + c->offset;
    const uint64_t *tab = ix->cur.slots, mask = (uint64_t)ix->cur.cap - 1, hm = g_hash_mask;
    const uint64_t *ents = ix->ents.w;
    const int64_t ew = ix->ew;
    const int32_t nv = ix->nvals;
    for (int64_t i = 0; i < n; i++) {
        if ((i & (PF_GROUP - 1)) == 0) { /* a group of rows: their slots, then their home slots' entries */
            int64_t end = i + PF_GROUP < n ? i + PF_GROUP : n;
            for (int64_t j = i; j < end; j++) __builtin_prefetch(tab + (kh[j] & mask));
            for (int64_t j = i; j < end; j++) {
                uint64_t sw = tab[kh[j] & mask];
                if (sw) __builtin_prefetch(ents + ((int64_t)(sw >> ENTRY_SHIFT) - 1) * ew);
            }
        }
        int64_t r = sel ? sel[i] : i;
        if (r < 0 || r >= nrows) return DBSP_EINVAL;
        const uint64_t u = kv[r], tg = kh[i] & hm;
        int64_t *v = NULL;
        for (uint64_t at = tg & mask;; at = (at + 1) & mask) {
            uint64_t sw = tab[at];
            if (sw == 0) break;
            if ((sw & TAG_MASK) == tg) {
                const uint64_t *ent = ents + ((int64_t)(sw >> ENTRY_SHIFT) - 1) * ew;
                if (ent[0] == u) { v = (int64_t *)(ent + 1); break; }
            }
        }
        if (slots) slots[i] = v;
        int64_t *a = acc + i * nv;
        if (copy) {  /* dbsp_keyindex_read_slots: the sums as they are, zero when absent */
            if (v) for (int32_t j = 0; j < nv; j++) a[j] = v[j];
            else for (int32_t j = 0; j < nv; j++) a[j] = 0;
            continue;
        }
        if (!v) continue; /* absent: all sums zero (invariant 2) */
        for (int32_t j = 0; j < nv; j++)
            if (__builtin_add_overflow(a[j], v[j], &a[j])) return DBSP_EOVERFLOW;
    }
    return DBSP_OK;
}

static int get_into(const DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const int64_t *sel,
                    const uint64_t *kh, int64_t n, int64_t *acc, int64_t **slots, int copy) {
    int st = check_keys(ix, b, keys);
    if (st != DBSP_OK) return st;
    if (ix->nkeys == 1 && !ix->var && !ix->old.slots && !b->cols[keys[0]].validity
        && (ix->types[0] == DBSP_INT64 || ix->types[0] == DBSP_UINT64 || ix->types[0] == DBSP_TIMESTAMP))
        return get_into_int(ix, &b->cols[keys[0]], sel, kh, b->nrows, n, acc, slots, copy);
    uint64_t w[PROBE_WORDS];
    for (int64_t i = 0; i < n; i++) {
        if ((i & (PF_GROUP - 1)) == 0) { /* a group of rows: their slots, then their home slots' entries */
            int64_t end = i + PF_GROUP < n ? i + PF_GROUP : n;
            for (int64_t j = i; j < end; j++) prefetch_key(ix, kh[j]);
            for (int64_t j = i; j < end; j++) prefetch_entry(ix, kh[j]);
        }
        int64_t r = sel ? sel[i] : i;
        if (r < 0 || r >= b->nrows) return DBSP_EINVAL;
        uint64_t tg = tag(kh[i], key_words(ix, b, keys, r, w));
        uint64_t *s = lookup(ix, tg, w);
        int64_t *v = s ? (int64_t *)(entry_of(ix, *s) + ix->nkeys) : NULL;
        if (slots) slots[i] = v;
        int64_t *a = acc + i * ix->nvals;
        if (copy) {  /* dbsp_keyindex_read_slots */
            for (int32_t j = 0; j < ix->nvals; j++) a[j] = v ? v[j] : 0;
            continue;
        }
        if (!v) continue; /* absent: all sums zero (invariant 2) */
        for (int32_t j = 0; j < ix->nvals; j++)
            if (__builtin_add_overflow(a[j], v[j], &a[j])) return DBSP_EOVERFLOW;
    }
    return DBSP_OK;
}

int dbsp_keyindex_get(const DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const int64_t *sel,
                      const uint64_t *kh, int64_t n, int64_t *acc) {
    return get_into(ix, b, keys, sel, kh, n, acc, NULL, 0);
}

int dbsp_keyindex_get_slots(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const int64_t *sel,
                            const uint64_t *kh, int64_t n, int64_t *acc, int64_t **slots) {
    if (ix->broken) return DBSP_EINVAL;
    return get_into(ix, b, keys, sel, kh, n, acc, slots, 0);
}

int dbsp_keyindex_read_slots(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const int64_t *sel,
                             const uint64_t *kh, int64_t n, int64_t *sums, int64_t **slots) {
    if (ix->broken) return DBSP_EINVAL;
    return get_into(ix, b, keys, sel, kh, n, sums, slots, 1);
}

void dbsp_keyindex_set_slot(DbspKeyIndex *ix, int64_t *slot, const int64_t *vals, int64_t vstride) {
    for (int32_t j = 0; j < ix->nvals; j++) slot[j] = vals[j * vstride];
}

int dbsp_keyindex_add(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const uint64_t *kh,
                      const int32_t *cols, int64_t sign) {
    return dbsp_keyindex_add_before(ix, b, keys, kh, cols, sign, NULL);
}

/* A new entry for the key (tag tg, words w) with sums d, past 3/4 starting a growth first (invariants 3, 5); `rows`:
 * the keys of the whole call (grow). Sets *out to its slot and *tab to its table. */
static int insert_new(DbspKeyIndex *ix, uint64_t tg, const uint64_t *w, const int64_t *d, int64_t dstride,
                      int64_t rows, uint64_t **out, Table **tab) {
    if (!ix->old.slots && (ix->count + 1) * 4 > ix->cur.cap * 3) {
        int st = grow(ix, rows);
        if (st != DBSP_OK) return st;
        move_some(ix, MOVE_PER_ROW);
    }
    int64_t e;
    int st = entry_take(ix, &e);
    if (st == DBSP_OK && ix->var && (st = arena_reserve(ix, tg, w)) != DBSP_OK) { /* room for its records first */
        entry_at(ix, e)[0] = (uint64_t)ix->ents.free; /* the entry back: nothing of the key written (invariant 4) */
        ix->ents.free = e;
    }
    if (st != DBSP_OK) {
        ix->broken = 1;
        return st;
    }
    uint64_t *s = new_slot(ix, tg, w, tab);
    *s = tg | (uint64_t)(e + 1) << ENTRY_SHIFT;
    uint64_t *ent = entry_at(ix, e);
    memcpy(ent, w, (size_t)ix->nkeys * 8);
    for (int32_t k = 0; ix->var >> k; k++) /* invariant 8: the bytes into records, their places into the entry */
        if ((ix->var >> k & 1) && !(tg >> (NULL_SHIFT + k) & 1)) {
            int64_t len = (int64_t)w[2 * MK + k], at = ix->arena.used, nw = rec_words(len);
            uint64_t *r = ix->arena.w + at;
            r[0] = (uint64_t)len;
            r[nw - 1] = 0; /* the padding of the last word */
            if (len) memcpy(r + 1, (const void *)(uintptr_t)w[MK + k], (size_t)len);
            ix->arena.used += nw;
            ix->arena_live += nw;
            ent[k] = (uint64_t)at + 1;
        }
    int64_t *v = (int64_t *)(ent + ix->nkeys);
    for (int32_t j = 0; j < ix->nvals; j++) v[j] = d[j * dstride];
    ix->count++;
    *out = s;
    return DBSP_OK;
}

/* Row i's deltas d[v] for dbsp_keyindex_add (the weight times the column's value, or the weight, or the weight where
 * the column is valid), before its sign: an add of sign -1 subtracts them, so that it takes back exactly what an add
 * of sign +1 of the same rows summed (negating the weight first fails on a value of INT64_MIN, which the add could
 * hold: a rollback's undo, trace/keyindex.py invariant 19); returns 0 on an overflow, else 1 with *nonzero whether
 * any is not 0. */
static inline int row_deltas(const DbspKeyIndex *ix, const DbspBatch *b, const int32_t *cols, int64_t i, int64_t *d,
                             int *nonzero, int wrap) {
    int64_t wt = b->weights ? b->weights[i] : 1;
    *nonzero = 0;
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
            if (wrap) d[j] = (int64_t)((uint64_t)x * (uint64_t)wt); /* (mod 2^64: dbsp_keyindex_take_back) */
            else if (__builtin_mul_overflow(x, wt, &d[j])) return 0;
        }
        *nonzero |= d[j] != 0;
    }
    return 1;
}

/* Take back row i of an add of sign `sign` (dbsp_keyindex_take_back, undo_add): its deltas subtracted from its key's
 * sums, mod 2^64 (exact for any state the index held); a key the add emptied made again with 0 - sign * d; a key
 * whose sums come to zero removed (invariant 2). Returns DBSP_OK, or insert_new's error (the index then broken). */
static int take_back_row(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const uint64_t *kh,
                         const int32_t *cols, int64_t sign, int64_t i) {
    uint64_t w[PROBE_WORDS];
    int64_t d[DBSP_KEYINDEX_MAX_VALS];
    int nonzero = 0;
    (void)row_deltas(ix, b, cols, i, d, &nonzero, 1);
    if (!nonzero) return DBSP_OK;
    uint64_t tg = tag(kh[i], key_words(ix, b, keys, i, w));
    if (ix->old.slots) move_some(ix, MOVE_PER_ROW);
    uint64_t *s = lookup(ix, tg, w);
    Table *tab;
    if (!s) { /* a key the add emptied: its sums were minus the add's (0 - sign * d, which they held) */
        for (int32_t j = 0; j < ix->nvals; j++) d[j] = sign > 0 ? (int64_t)(0 - (uint64_t)d[j]) : d[j];
        return insert_new(ix, tg, w, d, 1, 0, &s, &tab);
    }
    tab = ix->old.slots && (uint64_t)(s - ix->old.slots) < (uint64_t)ix->old.cap ? &ix->old : &ix->cur;
    int64_t *v = (int64_t *)(entry_of(ix, *s) + ix->nkeys);
    int zero = 1;
    for (int32_t j = 0; j < ix->nvals; j++) {
        v[j] = sign > 0 ? (int64_t)((uint64_t)v[j] - (uint64_t)d[j]) : (int64_t)((uint64_t)v[j] + (uint64_t)d[j]);
        zero &= v[j] == 0;
    }
    if (zero) remove_slot(ix, tab, s);
    return DBSP_OK;
}

/* Invariant 4: take back rows [0, upto) of an add of sign `sign` that failed for memory or a size limit at row upto
 * (nothing of which was written), newest first, so every state passed through is one the add passed through: the
 * table never needs to grow, a key removed by the add is put back into an entry the add (or this undo) freed. Only a
 * string key put back needs arena room, which may fail: the index then stays broken. Returns DBSP_OK when undone. */
static int undo_add(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const uint64_t *kh,
                    const int32_t *cols, int64_t sign, int64_t upto) {
    ix->broken = 0;
    for (int64_t i = upto - 1; i >= 0; i--)
        if (take_back_row(ix, b, keys, kh, cols, sign, i) != DBSP_OK) return DBSP_ENOMEM; /* broken */
    ix->refusals++;
    return DBSP_OK;
}

/* The arguments of an add: key columns of the index's types, value columns that exist and can be summed. */
static int check_add(const DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const int32_t *cols) {
    int st = check_keys(ix, b, keys);
    if (st != DBSP_OK) return st;
    for (int32_t j = 0; j < ix->nvals; j++) {
        int32_t c = cols[j] <= -2 ? -2 - cols[j] : cols[j];
        if (c >= b->ncols) return DBSP_EINVAL;
        if (cols[j] >= 0 && !summable(b->cols[c].type)) return DBSP_ETYPE;
    }
    return DBSP_OK;
}

int dbsp_keyindex_take_back(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const uint64_t *kh,
                            const int32_t *cols, int64_t sign) {
    if (ix->broken) return DBSP_EINVAL;
    if (sign != 1 && sign != -1) return DBSP_EINVAL;
    int st = check_add(ix, b, keys, cols);
    if (st != DBSP_OK) return st;
    for (int pass = 0; pass < 2; pass++) /* first the rows the add subtracted (put back), then those it added */
        for (int64_t i = 0; i < b->nrows; i++) {
            int64_t wt = b->weights ? b->weights[i] : 1;
            if (wt == 0 || ((wt < 0) == (sign < 0)) == (pass == 0)) continue; /* pass 0: wt * sign < 0 */
            if ((st = take_back_row(ix, b, keys, kh, cols, sign, i)) != DBSP_OK) return st; /* broken */
        }
    return DBSP_OK;
}

int dbsp_keyindex_add_before(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const uint64_t *kh,
                             const int32_t *cols, int64_t sign, int64_t *before) {
    if (ix->broken) return DBSP_EINVAL;
    if (sign != 1 && sign != -1) return DBSP_EINVAL;
    int st = check_add(ix, b, keys, cols);
    if (st != DBSP_OK) return st;
    uint64_t w[PROBE_WORDS], lw[PROBE_WORDS], ltg = 0;
    int64_t d[DBSP_KEYINDEX_MAX_VALS];
    int64_t n = b->nrows;
    uint64_t *last = NULL; /* the slot of the previous row's key: rows of one key are adjacent in index order */
    Table *ltab = NULL;    /* the table it is in */
    for (int64_t i = 0; i < n; i++) {
        prefetch_row(ix, kh, i, n);
        int nonzero = 0;
        if (!row_deltas(ix, b, cols, i, d, &nonzero, 0)) goto overflow;
        if (!nonzero && !before) continue;
        uint64_t tg = tag(kh[i], key_words(ix, b, keys, i, w));
        uint64_t *s;
        Table *tab;
        if (last && ltg == tg && same_probe(ix, lw, w)) {
            s = last, tab = ltab;
        } else {
            if (ix->old.slots) move_some(ix, MOVE_PER_ROW); /* growing: every fresh probe moves a few slots first */
            s = lookup(ix, tg, w);
            tab = s && ix->old.slots && (uint64_t)(s - ix->old.slots) < (uint64_t)ix->old.cap ? &ix->old : &ix->cur;
        }
        last = NULL;
        if (before) { /* the key's sums before this row */
            int64_t *o = before + i * ix->nvals;
            if (s) memcpy(o, entry_of(ix, *s) + ix->nkeys, (size_t)ix->nvals * 8);
            else memset(o, 0, (size_t)ix->nvals * 8);
        }
        if (!nonzero) {
            if (s) last = s, ltab = tab, ltg = tg, keep_probe(ix, lw, w);
            continue;
        }
        if (!s) {
            if (sign < 0) /* a new key's sums: 0 - d */
                for (int32_t j = 0; j < ix->nvals; j++)
                    if (__builtin_sub_overflow((int64_t)0, d[j], &d[j])) goto overflow;
            st = insert_new(ix, tg, w, d, 1, n, &s, &tab);
            if (st != DBSP_OK) {  /* memory or a size limit: nothing of row i written; rows before it taken back */
                (void)undo_add(ix, b, keys, kh, cols, sign, i);
                return st;
            }
            last = s, ltab = tab, ltg = tg, keep_probe(ix, lw, w);
            continue;
        }
        int64_t *v = (int64_t *)(entry_of(ix, *s) + ix->nkeys);
        int zero = 1;
        for (int32_t j = 0; j < ix->nvals; j++) {
            if (sign > 0 ? __builtin_add_overflow(v[j], d[j], &v[j]) : __builtin_sub_overflow(v[j], d[j], &v[j]))
                goto overflow;
            zero &= v[j] == 0;
        }
        if (zero) {
            remove_slot(ix, tab, s); /* invariant 2; slots may have shifted: none is remembered */
        } else {
            last = s, ltab = tab, ltg = tg, keep_probe(ix, lw, w);
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
    uint64_t w[PROBE_WORDS];
    uint64_t tg = tag(h, key_words(ix, b, keys, r, w));
    int zero = 1;
    if (vals)
        for (int32_t j = 0; j < ix->nvals; j++) zero &= vals[j * vstride] == 0;
    if (ix->old.slots) move_some(ix, MOVE_PER_ROW);
    uint64_t *s = lookup(ix, tg, w);
    if (s) {
        Table *tab = ix->old.slots && (uint64_t)(s - ix->old.slots) < (uint64_t)ix->old.cap ? &ix->old : &ix->cur;
        if (zero) {
            remove_slot(ix, tab, s);
        } else {
            int64_t *v = (int64_t *)(entry_of(ix, *s) + ix->nkeys);
            for (int32_t j = 0; j < ix->nvals; j++) v[j] = vals[j * vstride];
        }
        return DBSP_OK;
    }
    if (zero) return DBSP_OK; /* absent already (invariant 2) */
    Table *tab;
    return insert_new(ix, tg, w, vals, vstride, more, &s, &tab);
}

/* DBSP_OK when every slot of table t (old: its part not moved yet) is findable from its home and points to a live
 * entry no other slot points to (marked in `seen`, a byte per entry), else DBSP_EINVAL; counts the slots into *n. */
static int check_table(const DbspKeyIndex *ix, const Table *t, int old, unsigned char *seen, int64_t *n,
                       int64_t *live) {
    uint64_t pw[PROBE_WORDS];
    for (int64_t i = 0; i < t->cap; i++) {
        uint64_t sw = t->slots[i];
        if (sw == 0) continue;
        if (old && old_moved(ix, (uint64_t)i)) return DBSP_EINVAL; /* the moved part is empty */
        (*n)++;
        int64_t e = (int64_t)(sw >> ENTRY_SHIFT) - 1;
        if (e >= ix->ents.used || seen[e]) return DBSP_EINVAL; /* out of range, free, or pointed to twice */
        seen[e] = 1;
        if ((sw >> NULL_SHIFT & 0xff) >> ix->nkeys) return DBSP_EINVAL; /* null bits past the key columns */
        const uint64_t *ent = entry_at(ix, e);
        for (int32_t k = 0; ix->var >> k; k++) { /* invariant 8: a record for each non-null value, in the arena */
            if (!(ix->var >> k & 1)) continue;
            if (sw >> (NULL_SHIFT + k) & 1) {
                if (ent[k] != 0) return DBSP_EINVAL;
                continue;
            }
            if (ent[k] == 0 || (int64_t)ent[k] > ix->arena.used
                || (int64_t)ent[k] - 1 + rec_words((int64_t)ix->arena.w[ent[k] - 1]) > ix->arena.used)
                return DBSP_EINVAL;
            *live += rec_words((int64_t)ix->arena.w[ent[k] - 1]);
        }
        probe_of_entry(ix, ent, pw);
        const uint64_t *key = ix->var ? pw : ent;
        if (find(ix, t, sw & TAG_MASK, key) != t->slots + i) return DBSP_EINVAL;
        if (old && old_moved(ix, sw & ((uint64_t)t->cap - 1))) return DBSP_EINVAL; /* home moved, entry not */
        if (!old && ix->old.slots && !old_moved(ix, sw & ((uint64_t)ix->old.cap - 1))
            && (!ix->spilled || find(ix, &ix->old, sw & TAG_MASK, key)[0] != 0))
            return DBSP_EINVAL; /* in cur though its old home is not moved, with no spill; or in both tables */
        const int64_t *v = (const int64_t *)(ent + ix->nkeys);
        int zero = 1;
        for (int32_t j = 0; j < ix->nvals; j++) zero &= v[j] == 0;
        if (zero) return DBSP_EINVAL;
    }
    return DBSP_OK;
}

int dbsp_keyindex_check(const DbspKeyIndex *ix) {
    int64_t n = 0, nfree = 0, live = 0;
    if (ix->count * 4 > ix->cur.cap * 3 || ix->ents.used > ix->ents.room || ix->arena.used > ix->arena.room)
        return DBSP_EINVAL;
    unsigned char *seen = calloc((size_t)ix->ents.used + 1, 1);
    if (!seen) return DBSP_ENOMEM;
    int st = DBSP_OK;
    for (int64_t e = ix->ents.free; e >= 0 && st == DBSP_OK; e = (int64_t)entry_at(ix, e)[0]) {
        if (e >= ix->ents.used || seen[e]) st = DBSP_EINVAL; /* a free list that leaves the entries or loops */
        else seen[e] = 1, nfree++;
    }
    if (st == DBSP_OK) st = check_table(ix, &ix->cur, 0, seen, &n, &live);
    if (st == DBSP_OK && ix->old.slots) {
        if (ix->moved >= (uint64_t)ix->old.cap || ix->cur.cap != 2 * ix->old.cap || ix->old_added * 8 > ix->old.cap)
            st = DBSP_EINVAL;
        else
            st = check_table(ix, &ix->old, 1, seen, &n, &live);
    }
    free(seen);
    if (st != DBSP_OK) return st;
    return n == ix->count && n + nfree == ix->ents.used && live == ix->arena_live ? DBSP_OK : DBSP_EINVAL;
}
