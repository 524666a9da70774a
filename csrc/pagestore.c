/* pagestore.c: the two-version page store (the committed version and the one being written): copy-on-write B+trees over a page file.
 *
 * DESIGN NOTES
 * ============
 * Versions. The file keeps at most two committed versions, v and v+1. Version N lives in meta slot N % 2
 * (LMDB's rule). begin(v) first durably zeroes the other slot (so v is the only version from then on, even
 * after a crash), then builds v+1 in memory (but for big values, whose pages go to the file as they are put:
 * overflow_write_through); commit writes the new pages, fsyncs, writes meta slot
 * (v+1) % 2, fsyncs. A crash before the meta write is durable leaves v; after, v and v+1.
 *
 * Invariants (checked by check_version() on every openable version: after each commit and at open when
 * DBSP_CHECK_INVARIANTS is set, and on demand by dbsp_pagestore_check):
 *  (1) every valid meta slot passes its validity rule, and two valid slots hold consecutive versions N, N+1
 *      in slots N % 2 and (N+1) % 2;
 *  (2) every page reachable from a version (catalog tree, table trees, overflow chains, free-list chain) has
 *      a number in [2, page_count), a valid checksum and its own number in its header, and is reached once;
 *  (3) a version's free list holds exactly the pages of [2, page_count) it does not reach, each once;
 *  (4) in every B+tree node keys are strictly increasing; every key under child i of a branch is >= key i-1
 *      and < key i of that branch; all leaves are at the same depth and hold >= 1 key; a root branch holds
 *      >= 1 key, other branches may hold 0 (one child: deletes free whole nodes and never merge);
 *  (5) a transaction based on v only writes pages that are on v's free list or >= v's page_count, so v's
 *      pages are never overwritten while v is openable (the other version was discarded at begin);
 *  (6) data pages are fsynced before the meta slot that makes them reachable;
 *  (7) one open store writes a file at a time: an open takes flock(2) on it, exclusive for a writer and shared
 *      for a read-only open (which never writes), without waiting; a conflicting open fails with DBSP_EBUSY
 *      and changes nothing, so two Database objects on one path (in one process or two) never both write,
 *      and a reader never sees pages a writer is rewriting. Invariants (1)-(6) are not checked for it.
 *
 * On-disk format (all integers little-endian, page size 4096)
 * ------------------------------------------------------------
 * Page 0 and page 1 are meta slots; only their first 128 bytes are used (the rest is zero):
 *   0  8  magic "DBSPMETA"
 *   8  4  format version (1)
 *  12  4  page size (4096)
 *  16  8  version number N (slot = N % 2)
 *  24  8  catalog root page (0 = no tables)
 *  32  8  free-list head page (0 = empty free list)
 *  40  8  number of free pages
 *  48  8  page count (pages 0 .. page count-1 exist for this version)
 *  56  8  step (signed; set_step/get_step)
 *  64 60  zero
 * 124  4  CRC32C of bytes 0..123
 * Validity rule: magic matches, CRC matches, page size is 4096, page count >= 2, roots < page count, slot ==
 * N % 2. A slot failing the CRC is ignored (a torn or discarded commit); a slot with a good CRC but another
 * format version raises FormatVersionError; if no slot is valid the file is corrupt.
 *
 * Every other page starts with a 32-byte header:
 *   0  4  CRC32C of bytes 4..4095
 *   4  1  type: 1 leaf, 2 branch, 3 overflow, 4 free list
 *   5  1  zero
 *   6  2  number of keys (leaf, branch)
 *   8  8  the page's own number (catches misdirected writes)
 *  16  8  version that wrote it
 *  24  2  cell_top: cells occupy [cell_top, 4096)  (leaf, branch)
 *  26  2  fragmented bytes inside the cell area  (leaf, branch)
 *  28  4  zero (leaf, branch) | overflow: bytes of data in this page | free list: entries in this page
 * Leaf:     slot array of u16 cell offsets at 32 (in key order). Cell: u16 klen, u8 flags (1 = value in
 *           overflow pages), u8 zero, u32 value length, key bytes, then the value (inline) or the u64 first
 *           overflow page.
 * Branch:   u64 leftmost child at 32, slot array at 40. Cell: u16 klen, u64 right child, key bytes.
 *           Child 0 is the leftmost; child i (i >= 1) is the child of cell i-1.
 * Overflow: u64 next page (0 = last) at 32, data at 40.
 * Free list: u64 next page at 32, u64 page numbers at 40.
 * The catalog is a B+tree whose keys are table names and whose values are 8-byte table root pages.
 * Keys are ordered by memcmp, then length. Sharded state uses keys that start with the 4-byte big-endian
 * shard number (dbsp_core.storage.shard_key), so one shard of a table is one contiguous key range that a
 * cursor exports and puts import as a unit.
 *
 * Free pages. Each version's free list holds every page of [2, page_count) that version does not reach.
 * A transaction based on v allocates from v's free list (then from the end of the file); the pages of v it
 * replaces (copy-on-write) or frees, and v's own free-list pages, join the new version's free list but are
 * not reused until v is discarded by a later begin. Commit work is O(dirty pages + free-list length).
 *
 * Not covered: nodes are never merged after deletes; a lock needs flock(2) to work on the file system.
 */
#include "pagestore.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "crc32c.h"
#include "le.h"

#define PS 4096u
#define HDR 32u
#define META_USED 128u
#define MAX_INLINE 1024u
#define OV_DATA (PS - 40u)
#define FL_CAP ((PS - 40u) / 8u)
#define MAX_DEPTH 40

enum { T_LEAF = 1, T_BRANCH = 2, T_OVERFLOW = 3, T_FREELIST = 4 };

/* ---------- growable u64 vector ---------- */
typedef struct { uint64_t *a; size_t n, cap; } Vec;
static int vec_push(Vec *v, uint64_t x) {
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 64;
        uint64_t *a = realloc(v->a, cap * sizeof *a);
        if (!a) return dbsp_storage_fail(DBSP_ENOMEM, ENOMEM, "pagestore: out of memory");
        v->a = a;
        v->cap = cap;
    }
    v->a[v->n++] = x;
    return DBSP_OK;
}
static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}
static int cmp_u64_desc(const void *a, const void *b) { return -cmp_u64(a, b); }

/* ---------- structures ---------- */
typedef struct {
    uint64_t version, catalog, freelist, nfree, page_count;
    int64_t step;
} Meta;

typedef struct { uint64_t pgno; unsigned char *buf; uint8_t dirty, ref; } Ent;

typedef struct { unsigned char *name; size_t len; uint64_t root; int dirty; } Table;

struct DbspPageStore {
    DbspVfs *vfs;
    DbspFile *f;
    char *path;
    Meta meta[2];
    int valid[2];
    Ent *slots;          /* page cache: open addressing, linear probing, backward-shift deletion */
    size_t cap, count, nclean, clean_limit, hand;
    DbspTxn *txn;
    int failed;
    int readonly;        /* dbsp_pagestore_open_readonly: a shared lock, reads only */
    uint64_t last_commit_pages; /* pages written by the last commit (for benchmarks) */
};

struct DbspTxn {
    DbspPageStore *ps;
    Meta m;              /* the version being built: m.version = v + 1 */
    Vec pool;            /* pages free now: not reachable from v and not in use by this transaction */
    Vec pending;         /* pages of v this transaction stopped using: free in v+1, not reusable now */
    Vec dirty;           /* pages allocated by this transaction (may hold duplicates and freed pages) */
    Table *tables;
    size_t ntables, tcap;
    unsigned char *scratch;
    size_t scratch_cap;
    uint64_t mods;
    uint64_t through;    /* pages written as they were put (overflow_write_through), not by the commit */
    int failed;
    int readonly;        /* from dbsp_pagestore_read: reads v in place, writes nothing */
};

struct DbspCursor {
    DbspTxn *t;
    uint64_t mods;
    int depth, done;
    uint64_t pg[MAX_DEPTH];
    int idx[MAX_DEPTH];
    unsigned char *end;
    size_t elen;
    int has_end;
    unsigned char *kbuf, *vbuf;
    size_t kcap, vcap;
};

static int ps_corrupt(DbspPageStore *ps, uint64_t pgno, const char *why) {
    return dbsp_storage_fail(DBSP_ECORRUPT, 0, "pagestore %s: page %llu: %s", ps->path, (unsigned long long)pgno, why);
}
static int oom(void) { return dbsp_storage_fail(DBSP_ENOMEM, ENOMEM, "pagestore: out of memory"); }

/* ---------- page cache ---------- */
static inline size_t hslot(uint64_t pgno, size_t cap) { return (size_t)((pgno * 0x9E3779B97F4A7C15ull) >> 20) & (cap - 1); }

static Ent *cache_find(DbspPageStore *ps, uint64_t pgno) {
    for (size_t i = hslot(pgno, ps->cap);; i = (i + 1) & (ps->cap - 1)) {
        if (!ps->slots[i].buf) return NULL;
        if (ps->slots[i].pgno == pgno) return &ps->slots[i];
    }
}

static void cache_remove_at(DbspPageStore *ps, size_t i) {
    Ent *e = &ps->slots[i];
    if (!e->dirty) ps->nclean--;
    free(e->buf);
    e->buf = NULL;
    ps->count--;
    size_t j = i;
    for (;;) { /* backward shift */
        j = (j + 1) & (ps->cap - 1);
        if (!ps->slots[j].buf) break;
        size_t home = hslot(ps->slots[j].pgno, ps->cap);
        if (((j - home) & (ps->cap - 1)) >= ((j - i) & (ps->cap - 1))) {
            ps->slots[i] = ps->slots[j];
            ps->slots[j].buf = NULL;
            i = j;
        }
    }
}

static void cache_drop(DbspPageStore *ps, uint64_t pgno) {
    Ent *e = cache_find(ps, pgno);
    if (e) cache_remove_at(ps, (size_t)(e - ps->slots));
}

static int cache_grow(DbspPageStore *ps) {
    size_t ncap = ps->cap * 2;
    Ent *ns = calloc(ncap, sizeof *ns);
    if (!ns) return oom();
    for (size_t i = 0; i < ps->cap; i++) {
        if (!ps->slots[i].buf) continue;
        size_t j = hslot(ps->slots[i].pgno, ncap);
        while (ns[j].buf) j = (j + 1) & (ncap - 1);
        ns[j] = ps->slots[i];
    }
    free(ps->slots);
    ps->slots = ns;
    ps->cap = ncap;
    ps->hand = 0;
    return DBSP_OK;
}

static void cache_evict_clean(DbspPageStore *ps) {
    size_t scanned = 0;
    while (ps->nclean >= ps->clean_limit && scanned < 3 * ps->cap) {
        size_t i = ps->hand;
        ps->hand = (ps->hand + 1) & (ps->cap - 1);
        scanned++;
        Ent *e = &ps->slots[i];
        if (!e->buf || e->dirty) continue;
        if (e->ref) { e->ref = 0; continue; }
        cache_remove_at(ps, i);
    }
}

/* Inserts a new entry (pgno must be absent) owning buf. */
static int cache_insert(DbspPageStore *ps, uint64_t pgno, unsigned char *buf, int dirty, Ent **out) {
    if (!dirty && ps->nclean >= ps->clean_limit) cache_evict_clean(ps);
    if ((ps->count + 1) * 4 > ps->cap * 3) {
        int rc = cache_grow(ps);
        if (rc) return rc;
    }
    size_t i = hslot(pgno, ps->cap);
    while (ps->slots[i].buf) i = (i + 1) & (ps->cap - 1);
    ps->slots[i] = (Ent){pgno, buf, (uint8_t)dirty, 1};
    ps->count++;
    if (!dirty) ps->nclean++;
    *out = &ps->slots[i];
    return DBSP_OK;
}

static uint32_t page_crc(const unsigned char *p) { return dbsp_crc32c(0, p + 4, PS - 4); }

/* Reads page pgno from the file into buf (PS bytes) and verifies it: checksum, number, type. */
static int page_read_checked(DbspPageStore *ps, uint64_t pgno, unsigned char *buf) {
    if (pgno < 2) return ps_corrupt(ps, pgno, "reference to a meta page");
    int rc = dbsp_vfs_read_exact(ps->f, buf, PS, pgno * PS, "page");
    if (rc) return rc;
    if (rd32(buf) != page_crc(buf)) return ps_corrupt(ps, pgno, "checksum mismatch");
    if (rd64(buf + 8) != pgno) return ps_corrupt(ps, pgno, "header names another page");
    if (buf[4] < T_LEAF || buf[4] > T_FREELIST) return ps_corrupt(ps, pgno, "unknown page type");
    return DBSP_OK;
}

/* Returns the page (verified when read from disk). Clean page pointers stay valid until the next page load. */
static int page_get(DbspPageStore *ps, uint64_t pgno, unsigned char **out) {
    Ent *e = cache_find(ps, pgno);
    if (e) {
        e->ref = 1;
        *out = e->buf;
        return DBSP_OK;
    }
    if (pgno < 2) return ps_corrupt(ps, pgno, "reference to a meta page");
    unsigned char *buf = malloc(PS);
    if (!buf) return oom();
    int rc = page_read_checked(ps, pgno, buf);
    if (rc) { free(buf); return rc; }
    if ((rc = cache_insert(ps, pgno, buf, 0, &e))) { free(buf); return rc; }
    *out = buf;
    return DBSP_OK;
}

static int page_get_typed(DbspPageStore *ps, uint64_t pgno, int type, unsigned char **out) {
    int rc = page_get(ps, pgno, out);
    if (rc) return rc;
    if ((*out)[4] != type) return ps_corrupt(ps, pgno, "unexpected page type");
    return DBSP_OK;
}

/* ---------- allocation (transaction) ---------- */
static int page_alloc(DbspTxn *t, int type, unsigned char **out, uint64_t *pgno_out) {
    DbspPageStore *ps = t->ps;
    uint64_t pgno = t->pool.n ? t->pool.a[--t->pool.n] : t->m.page_count++;
    int rc = vec_push(&t->dirty, pgno);
    if (rc) return rc;
    Ent *e = cache_find(ps, pgno);
    unsigned char *buf;
    if (e) { /* a stale clean copy of a page from a discarded version */
        if (!e->dirty) ps->nclean--;
        e->dirty = 1;
        buf = e->buf;
    } else {
        if (!(buf = malloc(PS))) return oom();
        if ((rc = cache_insert(ps, pgno, buf, 1, &e))) { free(buf); return rc; }
    }
    memset(buf, 0, PS);
    buf[4] = (unsigned char)type;
    wr64(buf + 8, pgno);
    wr64(buf + 16, t->m.version);
    wr16(buf + 24, PS);
    *out = buf;
    *pgno_out = pgno;
    return DBSP_OK;
}

static int is_dirty(DbspTxn *t, uint64_t pgno) {
    Ent *e = cache_find(t->ps, pgno);
    return e && e->dirty;
}

static int page_free(DbspTxn *t, uint64_t pgno) {
    if (is_dirty(t, pgno)) {
        cache_drop(t->ps, pgno);
        return vec_push(&t->pool, pgno);
    }
    return vec_push(&t->pending, pgno);
}

/* Returns a writable copy of pgno (itself if already dirty), with its new number. */
static int page_writable(DbspTxn *t, uint64_t pgno, unsigned char **out, uint64_t *newpg) {
    unsigned char *src;
    int rc = page_get(t->ps, pgno, &src);
    if (rc) return rc;
    if (is_dirty(t, pgno)) {
        *out = src;
        *newpg = pgno;
        return DBSP_OK;
    }
    unsigned char *dst;
    uint64_t np;
    int type = src[4];
    /* page_alloc never loads pages, so src stays valid */
    if ((rc = page_alloc(t, type, &dst, &np))) return rc;
    memcpy(dst, src, PS);
    wr64(dst + 8, np);
    wr64(dst + 16, t->m.version);
    if ((rc = vec_push(&t->pending, pgno))) return rc;
    *out = dst;
    *newpg = np;
    return DBSP_OK;
}

/* ---------- node layout ---------- */
static inline unsigned hdr_size(const unsigned char *p) { return p[4] == T_BRANCH ? 40u : 32u; }
static inline unsigned nkeys(const unsigned char *p) { return rd16(p + 6); }
static inline unsigned char *cell_at(unsigned char *p, unsigned i) { return p + rd16(p + hdr_size(p) + 2 * i); }
static inline unsigned leaf_cell_len(const unsigned char *c) {
    return 8u + rd16(c) + ((c[2] & 1) ? 8u : rd32(c + 4));
}
static inline unsigned branch_cell_len(const unsigned char *c) { return 10u + rd16(c); }
static inline unsigned cell_len(const unsigned char *p, const unsigned char *c) {
    return p[4] == T_BRANCH ? branch_cell_len(c) : leaf_cell_len(c);
}
static inline const unsigned char *cell_key(const unsigned char *p, const unsigned char *c, size_t *klen) {
    *klen = rd16(c);
    return c + (p[4] == T_BRANCH ? 10 : 8);
}
static inline uint64_t branch_child(unsigned char *p, unsigned i) {
    return i == 0 ? rd64(p + 32) : rd64(cell_at(p, i - 1) + 2);
}
static inline void branch_set_child(unsigned char *p, unsigned i, uint64_t c) {
    if (i == 0) wr64(p + 32, c); else wr64(cell_at(p, i - 1) + 2, c);
}
static inline unsigned node_free(const unsigned char *p) {
    return rd16(p + 24) - (hdr_size(p) + 2 * nkeys(p));
}

static int keycmp(const void *a, size_t al, const void *b, size_t bl) {
    int c = memcmp(a, b, al < bl ? al : bl);
    if (c) return c;
    return al < bl ? -1 : al > bl;
}

/* Leaf: index of the first key >= k; *eq set if equal. Branch: number of keys <= k (= child index). */
static unsigned node_search(unsigned char *p, const void *k, size_t kl, int *eq) {
    unsigned lo = 0, hi = nkeys(p);
    int branch = p[4] == T_BRANCH;
    *eq = 0;
    while (lo < hi) {
        unsigned mid = (lo + hi) / 2;
        size_t ml;
        const unsigned char *mk = cell_key(p, cell_at(p, mid), &ml);
        int c = keycmp(mk, ml, k, kl);
        if (c < 0 || (branch && c == 0)) lo = mid + 1;
        else { if (c == 0) *eq = 1; hi = mid; }
    }
    return lo;
}

/* Rewrites the cell area without gaps. */
static void node_compact(unsigned char *p) {
    unsigned char tmp[PS];
    unsigned n = nkeys(p), hs = hdr_size(p), top = PS;
    memcpy(tmp, p, PS);
    for (unsigned i = 0; i < n; i++) {
        unsigned char *c = tmp + rd16(tmp + hs + 2 * i);
        unsigned len = cell_len(tmp, c);
        top -= len;
        memcpy(p + top, c, len);
        wr16(p + hs + 2 * i, (uint16_t)top);
    }
    memset(p + hs + 2 * n, 0, top - (hs + 2 * n));
    wr16(p + 24, (uint16_t)top);
    wr16(p + 26, 0);
}

/* Inserts cell at index i if it fits (compacting if needed); returns 1 if it does not fit. */
static int node_insert(unsigned char *p, unsigned i, const unsigned char *cell, unsigned len) {
    unsigned n = nkeys(p), hs = hdr_size(p);
    if (node_free(p) < len + 2) {
        if (node_free(p) + rd16(p + 26) < len + 2) return 1;
        node_compact(p);
    }
    unsigned top = rd16(p + 24) - len;
    memcpy(p + top, cell, len);
    memmove(p + hs + 2 * (i + 1), p + hs + 2 * i, 2 * (n - i));
    wr16(p + hs + 2 * i, (uint16_t)top);
    wr16(p + 24, (uint16_t)top);
    wr16(p + 6, (uint16_t)(n + 1));
    return 0;
}

static void node_remove(unsigned char *p, unsigned i) {
    unsigned n = nkeys(p), hs = hdr_size(p);
    unsigned len = cell_len(p, cell_at(p, i));
    memmove(p + hs + 2 * i, p + hs + 2 * (i + 1), 2 * (n - i - 1));
    wr16(p + hs + 2 * (n - 1), 0);
    wr16(p + 6, (uint16_t)(n - 1));
    wr16(p + 26, (uint16_t)(rd16(p + 26) + len));
}

/* ---------- overflow values ---------- */
static int scratch_reserve(unsigned char **buf, size_t *cap, size_t need) {
    if (*cap >= need) return DBSP_OK;
    size_t n = *cap ? *cap : 4096;
    while (n < need) n *= 2;
    unsigned char *b = realloc(*buf, n);
    if (!b) return oom();
    *buf = b;
    *cap = n;
    return DBSP_OK;
}

/* A value of THROUGH_PAGES overflow pages or more is written to the file as it is put, in runs of adjacent pages,
 * and is never held in the page cache: a transaction's pages otherwise stay in memory until its commit, so a commit
 * of N bytes of big values held N bytes at once (a stage task committing a job's new batches, runtime/stage_task.py
 * invariant 7). Crash-safe as the commit's own page writes are: the pages come from the pool (not reachable from the
 * base version, which is the only one kept) or the end of the file, and are written as the commit would write them;
 * the commit's fsync still precedes its meta write, and a transaction that fails or aborts leaves them unreachable.
 * Overflow pages are never modified once written, only freed (a freed one joins the free list of the new version). */
#define THROUGH_PAGES 16u

static int overflow_write_through(DbspTxn *t, const unsigned char *val, size_t vlen, size_t npages,
                                  uint64_t *first) {
    DbspPageStore *ps = t->ps;
    enum { RUN = 64 };
    Vec pgs = {0};
    int rc = DBSP_OK;
    for (size_t i = 0; i < npages && !rc; i++) {
        uint64_t pg = t->pool.n ? t->pool.a[--t->pool.n] : t->m.page_count++;
        cache_drop(ps, pg); /* a stale clean copy of a page from a discarded version */
        rc = vec_push(&pgs, pg);
    }
    unsigned char *stage = rc ? NULL : malloc((size_t)RUN * PS);
    if (!rc && !stage) rc = oom();
    size_t run = 0;
    for (size_t i = 0; i < npages && !rc; i++) {
        unsigned char *p = stage + run * PS;
        size_t chunk = vlen - i * OV_DATA < OV_DATA ? vlen - i * OV_DATA : OV_DATA;
        memset(p, 0, PS);
        p[4] = T_OVERFLOW;
        wr64(p + 8, pgs.a[i]);
        wr64(p + 16, t->m.version);
        wr16(p + 24, PS);
        wr32(p + 28, (uint32_t)chunk);
        wr64(p + 32, i + 1 < npages ? pgs.a[i + 1] : 0);
        memcpy(p + 40, val + i * OV_DATA, chunk);
        wr32(p, page_crc(p));
        run++;
        if (i + 1 == npages || run == RUN || pgs.a[i + 1] != pgs.a[i] + 1) {
            rc = ps->vfs->pwrite(ps->f, stage, run * PS, (pgs.a[i] + 1 - run) * PS);
            t->through += run;
            run = 0;
        }
    }
    *first = rc ? 0 : pgs.a[0];
    free(stage);
    free(pgs.a);
    return rc;
}

static int overflow_write(DbspTxn *t, const unsigned char *val, size_t vlen, uint64_t *first) {
    size_t npages = (vlen + OV_DATA - 1) / OV_DATA;
    if (npages >= THROUGH_PAGES) return overflow_write_through(t, val, vlen, npages, first);
    uint64_t prev_pg = 0;
    *first = 0;
    for (size_t i = 0; i < npages; i++) {
        unsigned char *p;
        uint64_t pg;
        int rc = page_alloc(t, T_OVERFLOW, &p, &pg);
        if (rc) return rc;
        size_t chunk = vlen - i * OV_DATA < OV_DATA ? vlen - i * OV_DATA : OV_DATA;
        wr32(p + 28, (uint32_t)chunk);
        memcpy(p + 40, val + i * OV_DATA, chunk);
        if (prev_pg) {
            unsigned char *pp = cache_find(t->ps, prev_pg)->buf; /* dirty, so cached */
            wr64(pp + 32, pg);
        } else {
            *first = pg;
        }
        prev_pg = pg;
    }
    return DBSP_OK;
}

static int overflow_read(DbspPageStore *ps, uint64_t pg, size_t vlen, unsigned char **buf, size_t *cap) {
    int rc = scratch_reserve(buf, cap, vlen ? vlen : 1);
    if (rc) return rc;
    size_t done = 0;
    while (done < vlen) {
        if (!pg) return ps_corrupt(ps, pg, "overflow chain ends early");
        unsigned char *p;
        if ((rc = page_get_typed(ps, pg, T_OVERFLOW, &p))) return rc;
        size_t chunk = rd32(p + 28);
        if (chunk == 0 || chunk > OV_DATA || chunk > vlen - done) return ps_corrupt(ps, pg, "bad overflow length");
        memcpy(*buf + done, p + 40, chunk);
        done += chunk;
        pg = rd64(p + 32);
    }
    if (pg) return ps_corrupt(ps, pg, "overflow chain longer than its value");
    return DBSP_OK;
}

/* Frees a value's overflow chain. A page not in the cache is read into one buffer and verified as page_get
 * verifies it, but not cached: it is freed at once, and caching it would evict pages still in use (a checkpoint
 * deletes as many bytes of merged-away batches as it writes). */
static int overflow_free(DbspTxn *t, uint64_t pg) {
    unsigned char *scratch = NULL;
    int rc = DBSP_OK;
    while (pg) {
        const unsigned char *p;
        Ent *e = cache_find(t->ps, pg);
        if (e) {
            p = e->buf;
        } else {
            if (!scratch && !(scratch = malloc(PS))) return oom();
            if ((rc = page_read_checked(t->ps, pg, scratch))) break;
            p = scratch;
        }
        if (p[4] != T_OVERFLOW) { rc = ps_corrupt(t->ps, pg, "unexpected page type"); break; }
        uint64_t next = rd64(p + 32);
        if ((rc = page_free(t, pg))) break;
        pg = next;
    }
    free(scratch);
    return rc;
}

/* ---------- B+tree ---------- */
static int tree_get(DbspPageStore *ps, uint64_t root, const void *k, size_t kl, unsigned char **cell_page,
                    unsigned *cell_idx) {
    uint64_t pg = root;
    for (int depth = 0; pg; depth++) {
        if (depth >= MAX_DEPTH) return ps_corrupt(ps, pg, "tree too deep");
        unsigned char *p;
        int rc = page_get(ps, pg, &p);
        if (rc) return rc;
        int eq;
        unsigned i = node_search(p, k, kl, &eq);
        if (p[4] == T_LEAF) {
            if (!eq) return DBSP_ENOTFOUND;
            *cell_page = p;
            *cell_idx = i;
            return DBSP_OK;
        }
        if (p[4] != T_BRANCH) return ps_corrupt(ps, pg, "expected a tree node");
        pg = branch_child(p, i);
    }
    return DBSP_ENOTFOUND;
}

/* Splits node p (dirty) while inserting cell at index i; returns the new right sibling and the separator. */
static int node_split(DbspTxn *t, unsigned char *p, unsigned i, const unsigned char *cell, unsigned clen,
                      uint64_t *right_pg, unsigned char *sep, size_t *seplen) {
    unsigned char tmp[PS];
    memcpy(tmp, p, PS);
    unsigned n = nkeys(tmp), hs = hdr_size(tmp);
    int branch = tmp[4] == T_BRANCH;
    const unsigned char *cells[PS / 8 + 2];
    unsigned lens[PS / 8 + 2];
    unsigned total = 0;
    for (unsigned j = 0, s = 0; j <= n; j++) {
        if (j == i) { cells[j] = cell; lens[j] = clen; }
        else { cells[j] = tmp + rd16(tmp + hs + 2 * s); lens[j] = cell_len(tmp, cells[j]); s++; }
        total += lens[j] + 2;
    }
    unsigned m = n + 1, half = 0, cut = 0;
    while (cut < m - 1 && half + lens[cut] + 2 <= total / 2) half += lens[cut++] + 2;
    if (cut == 0) cut = 1;
    if (branch && cut >= m - 1) cut = m - 2; /* the separator moves up; right needs at least one key */
    unsigned char *r;
    uint64_t rpg;
    int rc = page_alloc(t, tmp[4], &r, &rpg);
    if (rc) return rc;
    /* left: cells [0, cut) */
    memset(p + 24, 0, PS - 24);
    wr16(p + 6, 0);
    wr16(p + 24, PS);
    if (branch) wr64(p + 32, rd64(tmp + 32));
    for (unsigned j = 0; j < cut; j++) node_insert(p, j, cells[j], lens[j]);
    unsigned from = cut;
    if (branch) { /* cell `cut` moves up: its child becomes right's leftmost */
        *seplen = rd16(cells[cut]);
        memcpy(sep, cells[cut] + 10, *seplen);
        wr64(r + 32, rd64(cells[cut] + 2));
        from = cut + 1;
    } else {
        *seplen = rd16(cells[cut]);
        memcpy(sep, cells[cut] + 8, *seplen);
    }
    for (unsigned j = from; j < m; j++) node_insert(r, j - from, cells[j], lens[j]);
    *right_pg = rpg;
    return DBSP_OK;
}

typedef struct { unsigned char *p; uint64_t pg; unsigned idx; } PathEl;

/* Makes the path to k writable; path[0] is the root, path[depth-1] the leaf. */
static int tree_path(DbspTxn *t, uint64_t *root, const void *k, size_t kl, PathEl *path, int *depth, int *eq) {
    unsigned char *p;
    uint64_t pg;
    int rc = page_writable(t, *root, &p, &pg);
    if (rc) return rc;
    *root = pg;
    int d = 0;
    for (;;) {
        if (d >= MAX_DEPTH) return ps_corrupt(t->ps, pg, "tree too deep");
        unsigned i = node_search(p, k, kl, eq);
        path[d++] = (PathEl){p, pg, i};
        if (p[4] == T_LEAF) break;
        if (p[4] != T_BRANCH) return ps_corrupt(t->ps, pg, "expected a tree node");
        unsigned char *c;
        uint64_t cpg;
        if ((rc = page_writable(t, branch_child(p, i), &c, &cpg))) return rc;
        branch_set_child(p, i, cpg);
        p = c;
        pg = cpg;
    }
    *depth = d;
    return DBSP_OK;
}

static int tree_put(DbspTxn *t, uint64_t *root, const void *k, size_t kl, const void *v, size_t vl) {
    unsigned char cell[8 + DBSP_PAGESTORE_MAX_KEY + MAX_INLINE];
    unsigned clen;
    int rc;
    if (vl > UINT32_MAX) return dbsp_storage_fail(DBSP_ETOOBIG, 0, "pagestore: value of %zu bytes exceeds 4 GiB", vl);
    wr16(cell, (uint16_t)kl);
    cell[3] = 0;
    wr32(cell + 4, (uint32_t)vl);
    memcpy(cell + 8, k, kl);
    if (8 + kl + vl > MAX_INLINE) {
        uint64_t first;
        if ((rc = overflow_write(t, v, vl, &first))) return rc;
        cell[2] = 1;
        wr64(cell + 8 + kl, first);
        clen = 8 + (unsigned)kl + 8;
    } else {
        cell[2] = 0;
        if (vl) memcpy(cell + 8 + kl, v, vl); /* (an empty value may come as NULL) */
        clen = 8 + (unsigned)(kl + vl);
    }
    if (*root == 0) {
        unsigned char *p;
        if ((rc = page_alloc(t, T_LEAF, &p, root))) return rc;
        node_insert(p, 0, cell, clen);
        return DBSP_OK;
    }
    PathEl path[MAX_DEPTH];
    int depth, eq;
    if ((rc = tree_path(t, root, k, kl, path, &depth, &eq))) return rc;
    unsigned char *leaf = path[depth - 1].p;
    unsigned i = path[depth - 1].idx;
    if (eq) {
        unsigned char *old = cell_at(leaf, i);
        if ((old[2] & 1) && (rc = overflow_free(t, rd64(old + 8 + rd16(old))))) return rc;
        node_remove(leaf, i);
    }
    if (!node_insert(leaf, i, cell, clen)) return DBSP_OK;
    /* split upwards */
    unsigned char sep[DBSP_PAGESTORE_MAX_KEY];
    size_t seplen;
    uint64_t right;
    if ((rc = node_split(t, leaf, i, cell, clen, &right, sep, &seplen))) return rc;
    for (int d = depth - 2; d >= 0; d--) {
        unsigned char bcell[10 + DBSP_PAGESTORE_MAX_KEY];
        wr16(bcell, (uint16_t)seplen);
        wr64(bcell + 2, right);
        memcpy(bcell + 10, sep, seplen);
        unsigned at = path[d].idx;
        if (!node_insert(path[d].p, at, bcell, 10 + (unsigned)seplen)) return DBSP_OK;
        unsigned char sep2[DBSP_PAGESTORE_MAX_KEY];
        size_t seplen2;
        if ((rc = node_split(t, path[d].p, at, bcell, 10 + (unsigned)seplen, &right, sep2, &seplen2))) return rc;
        memcpy(sep, sep2, seplen2);
        seplen = seplen2;
    }
    /* the root split: a new root */
    unsigned char *nr;
    uint64_t nrpg;
    if ((rc = page_alloc(t, T_BRANCH, &nr, &nrpg))) return rc;
    wr64(nr + 32, *root);
    unsigned char bcell[10 + DBSP_PAGESTORE_MAX_KEY];
    wr16(bcell, (uint16_t)seplen);
    wr64(bcell + 2, right);
    memcpy(bcell + 10, sep, seplen);
    node_insert(nr, 0, bcell, 10 + (unsigned)seplen);
    *root = nrpg;
    return DBSP_OK;
}

static int tree_delete(DbspTxn *t, uint64_t *root, const void *k, size_t kl, int *found) {
    unsigned char *cp;
    unsigned ci;
    int rc = tree_get(t->ps, *root, k, kl, &cp, &ci);
    *found = 0;
    if (rc == DBSP_ENOTFOUND) return DBSP_OK;
    if (rc) return rc;
    PathEl path[MAX_DEPTH];
    int depth, eq;
    if ((rc = tree_path(t, root, k, kl, path, &depth, &eq))) return rc;
    if (!eq) return ps_corrupt(t->ps, path[depth - 1].pg, "key vanished between lookup and delete");
    *found = 1;
    unsigned char *leaf = path[depth - 1].p;
    unsigned char *old = cell_at(leaf, path[depth - 1].idx);
    if ((old[2] & 1) && (rc = overflow_free(t, rd64(old + 8 + rd16(old))))) return rc;
    node_remove(leaf, path[depth - 1].idx);
    if (nkeys(leaf) > 0) return DBSP_OK;
    /* the leaf is empty: free it, and every ancestor whose only child it was; then unlink it from the first
     * ancestor with another child. No merging: depth stays uniform because nodes are only ever removed whole. */
    int d = depth - 1;
    if ((rc = page_free(t, path[d].pg))) return rc;
    for (;;) {
        if (d == 0) { *root = 0; return DBSP_OK; }
        PathEl *par = &path[d - 1];
        if (nkeys(par->p) == 0) {
            if ((rc = page_free(t, par->pg))) return rc;
            d--;
            continue;
        }
        if (par->idx == 0) { wr64(par->p + 32, rd64(cell_at(par->p, 0) + 2)); node_remove(par->p, 0); }
        else node_remove(par->p, par->idx - 1);
        break;
    }
    /* a root branch with a single child is replaced by that child (the whole tree gets one level shorter) */
    for (;;) {
        unsigned char *p;
        if ((rc = page_get(t->ps, *root, &p))) return rc;
        if (p[4] != T_BRANCH || nkeys(p) > 0) break;
        uint64_t only = rd64(p + 32);
        if ((rc = page_free(t, *root))) return rc;
        *root = only;
    }
    return DBSP_OK;
}

/* ---------- meta ---------- */
static void meta_encode(const Meta *m, unsigned char *b) {
    memset(b, 0, META_USED);
    memcpy(b, "DBSPMETA", 8);
    wr32(b + 8, DBSP_PAGESTORE_FORMAT);
    wr32(b + 12, PS);
    wr64(b + 16, m->version);
    wr64(b + 24, m->catalog);
    wr64(b + 32, m->freelist);
    wr64(b + 40, m->nfree);
    wr64(b + 48, m->page_count);
    wr64(b + 56, (uint64_t)m->step);
    wr32(b + 124, dbsp_crc32c(0, b, 124));
}

/* 1 valid, 0 invalid (ignored), or a negative-free error status via *err for a format mismatch. */
static int meta_decode(const unsigned char *b, int slot, Meta *m, int *format_err) {
    *format_err = 0;
    if (memcmp(b, "DBSPMETA", 8) != 0) return 0;
    if (rd32(b + 124) != dbsp_crc32c(0, b, 124)) return 0;
    if (rd32(b + 8) != DBSP_PAGESTORE_FORMAT) { *format_err = (int)rd32(b + 8); return 0; }
    m->version = rd64(b + 16);
    m->catalog = rd64(b + 24);
    m->freelist = rd64(b + 32);
    m->nfree = rd64(b + 40);
    m->page_count = rd64(b + 48);
    m->step = (int64_t)rd64(b + 56);
    if (rd32(b + 12) != PS || m->page_count < 2 || m->catalog >= m->page_count || m->freelist >= m->page_count ||
        (int)(m->version % 2) != slot)
        return 0;
    return 1;
}

static int read_metas(DbspPageStore *ps) {
    unsigned char b[2][META_USED];
    int rc;
    uint64_t size;
    if ((rc = ps->vfs->size(ps->f, &size))) return rc;
    int fmt_err = 0;
    for (int s = 0; s < 2; s++) {
        ps->valid[s] = 0;
        if (size < (uint64_t)s * PS + META_USED) continue;
        if ((rc = dbsp_vfs_read_exact(ps->f, b[s], META_USED, (uint64_t)s * PS, "meta slot"))) return rc;
        int fe;
        ps->valid[s] = meta_decode(b[s], s, &ps->meta[s], &fe);
        if (fe) fmt_err = fe;
    }
    if (ps->valid[0] && ps->valid[1]) { /* keep the newer, and the older only if consecutive */
        int hi = ps->meta[1].version > ps->meta[0].version;
        if (ps->meta[hi].version != ps->meta[!hi].version + 1) ps->valid[!hi] = 0;
    }
    if (!ps->valid[0] && !ps->valid[1]) {
        if (fmt_err)
            return dbsp_storage_fail(DBSP_EFORMAT, 0, "pagestore %s: format version %d, this build reads %u", ps->path,
                                     fmt_err, DBSP_PAGESTORE_FORMAT);
        return dbsp_storage_fail(DBSP_ECORRUPT, 0, "pagestore %s: no valid meta slot (not a page store, or both slots damaged)",
                                 ps->path);
    }
    return DBSP_OK;
}

static int newest_slot(DbspPageStore *ps) {
    if (ps->valid[0] && ps->valid[1]) return ps->meta[1].version > ps->meta[0].version;
    return ps->valid[1];
}

/* ---------- invariant checker ---------- */
typedef struct { DbspPageStore *ps; unsigned char *seen; uint64_t npages; uint64_t reached; } Check;

static int check_mark(Check *c, uint64_t pg) {
    if (pg < 2 || pg >= c->npages) return ps_corrupt(c->ps, pg, "reference outside [2, page_count)");
    if (c->seen[pg]) return ps_corrupt(c->ps, pg, "page reached twice");
    c->seen[pg] = 1;
    c->reached++;
    return DBSP_OK;
}

static int check_tree(Check *c, uint64_t pg, int depth, int *leaf_depth, const unsigned char *lo, size_t lol,
                      int has_lo, const unsigned char *hi, size_t hil, int has_hi, int catalog, Check *tables);

static int check_node_keys(Check *c, uint64_t pg, unsigned char *p, const unsigned char *lo, size_t lol, int has_lo,
                           const unsigned char *hi, size_t hil, int has_hi) {
    unsigned n = nkeys(p);
    const unsigned char *prev = NULL;
    size_t prevl = 0;
    for (unsigned i = 0; i < n; i++) {
        if (rd16(p + hdr_size(p) + 2 * i) < hdr_size(p) + 2 * n || rd16(p + hdr_size(p) + 2 * i) >= PS)
            return ps_corrupt(c->ps, pg, "cell offset out of range");
        size_t kl;
        const unsigned char *k = cell_key(p, cell_at(p, i), &kl);
        if (kl > DBSP_PAGESTORE_MAX_KEY) return ps_corrupt(c->ps, pg, "key too long");
        if (prev && keycmp(prev, prevl, k, kl) >= 0) return ps_corrupt(c->ps, pg, "keys not increasing");
        if (has_lo && keycmp(k, kl, lo, lol) < 0) return ps_corrupt(c->ps, pg, "key below its subtree bound");
        if (has_hi && keycmp(k, kl, hi, hil) >= 0) return ps_corrupt(c->ps, pg, "key above its subtree bound");
        prev = k;
        prevl = kl;
    }
    return DBSP_OK;
}

static int check_tree(Check *c, uint64_t pg, int depth, int *leaf_depth, const unsigned char *lo, size_t lol,
                      int has_lo, const unsigned char *hi, size_t hil, int has_hi, int catalog, Check *unused) {
    int rc;
    if (depth >= MAX_DEPTH) return ps_corrupt(c->ps, pg, "tree too deep");
    if ((rc = check_mark(c, pg))) return rc;
    unsigned char copy[PS], *p;
    if ((rc = page_get(c->ps, pg, &p))) return rc;
    memcpy(copy, p, PS); /* page_get of children may evict p */
    p = copy;
    if ((rc = check_node_keys(c, pg, p, lo, lol, has_lo, hi, hil, has_hi))) return rc;
    unsigned n = nkeys(p);
    if (p[4] == T_LEAF) {
        if (n == 0) return ps_corrupt(c->ps, pg, "empty leaf");
        if (*leaf_depth < 0) *leaf_depth = depth;
        else if (*leaf_depth != depth) return ps_corrupt(c->ps, pg, "leaves at different depths");
        for (unsigned i = 0; i < n; i++) {
            unsigned char *cell = cell_at(p, i);
            size_t kl = rd16(cell);
            if (catalog) {
                if ((cell[2] & 1) || rd32(cell + 4) != 8) return ps_corrupt(c->ps, pg, "bad catalog entry");
                uint64_t troot = rd64(cell + 8 + kl);
                int ld = -1;
                if (troot && (rc = check_tree(c, troot, 0, &ld, NULL, 0, 0, NULL, 0, 0, 0, NULL))) return rc;
            } else if (cell[2] & 1) {
                uint64_t ov = rd64(cell + 8 + kl);
                size_t vlen = rd32(cell + 4), got = 0;
                while (ov) {
                    if ((rc = check_mark(c, ov))) return rc;
                    unsigned char *o;
                    if ((rc = page_get_typed(c->ps, ov, T_OVERFLOW, &o))) return rc;
                    got += rd32(o + 28);
                    ov = rd64(o + 32);
                }
                if (got != vlen) return ps_corrupt(c->ps, pg, "overflow chain length differs from value length");
            }
        }
        return DBSP_OK;
    }
    if (p[4] != T_BRANCH) return ps_corrupt(c->ps, pg, "expected a tree node");
    if (n == 0 && depth == 0) return ps_corrupt(c->ps, pg, "root branch without keys");
    for (unsigned i = 0; i <= n; i++) {
        size_t cl = 0, ch = 0;
        const unsigned char *clo = lo, *chi = hi;
        int hlo = has_lo, hhi = has_hi;
        cl = lol;
        ch = hil;
        if (i > 0) { clo = cell_key(p, cell_at(p, i - 1), &cl); hlo = 1; }
        if (i < n) { chi = cell_key(p, cell_at(p, i), &ch); hhi = 1; }
        if ((rc = check_tree(c, branch_child(p, i), depth + 1, leaf_depth, clo, cl, hlo, chi, ch, hhi, catalog, NULL)))
            return rc;
    }
    return DBSP_OK;
}

static int check_version(DbspPageStore *ps, const Meta *m) {
    Check c = {ps, calloc(m->page_count ? m->page_count : 1, 1), m->page_count, 0};
    if (!c.seen) return oom();
    int rc = DBSP_OK, ld = -1;
    if (m->catalog && (rc = check_tree(&c, m->catalog, 0, &ld, NULL, 0, 0, NULL, 0, 0, 1, NULL))) goto out;
    uint64_t listed = 0;
    for (uint64_t fl = m->freelist; fl;) {
        unsigned char copy[PS], *p;
        if ((rc = check_mark(&c, fl)) || (rc = page_get_typed(ps, fl, T_FREELIST, &p))) goto out;
        memcpy(copy, p, PS);
        uint32_t n = rd32(copy + 28);
        if (n > FL_CAP) { rc = ps_corrupt(ps, fl, "free-list page overfull"); goto out; }
        for (uint32_t i = 0; i < n; i++) {
            uint64_t f = rd64(copy + 40 + 8 * i);
            if (f < 2 || f >= c.npages || c.seen[f] == 2) { rc = ps_corrupt(ps, f, "bad or repeated free-list entry"); goto out; }
            if (c.seen[f] == 0) c.seen[f] = 2; /* reached pages are checked below */
            else { rc = ps_corrupt(ps, f, "page both reachable and free"); goto out; }
            listed++;
        }
        fl = rd64(copy + 32);
    }
    if (listed != m->nfree) { rc = ps_corrupt(ps, 0, "free count in meta differs from the free list"); goto out; }
    for (uint64_t pg = 2; pg < c.npages; pg++)
        if (!c.seen[pg]) { rc = ps_corrupt(ps, pg, "page neither reachable nor free (leaked)"); goto out; }
out:
    free(c.seen);
    return rc;
}

int dbsp_pagestore_check(DbspPageStore *ps) {
    if (ps->txn) return dbsp_storage_fail(DBSP_ESTATE, 0, "pagestore %s: check during a transaction", ps->path);
    for (int s = 0; s < 2; s++) {
        if (!ps->valid[s]) continue;
        int rc = check_version(ps, &ps->meta[s]);
        if (rc) return rc;
    }
    return DBSP_OK;
}

int dbsp_pagestore_check_version(DbspPageStore *ps, uint64_t version) {
    if (ps->txn) return dbsp_storage_fail(DBSP_ESTATE, 0, "pagestore %s: check during a transaction", ps->path);
    for (int s = 0; s < 2; s++)
        if (ps->valid[s] && ps->meta[s].version == version) return check_version(ps, &ps->meta[s]);
    return dbsp_storage_fail(DBSP_ENOTFOUND, 0, "pagestore %s: version %llu is not openable", ps->path,
                             (unsigned long long)version);
}

/* ---------- open / close ---------- */
static int create_file(DbspPageStore *ps, uint64_t version) {
    char *tmp = malloc(strlen(ps->path) + 8);
    char *dir = dbsp_path_dirname(ps->path);
    int rc = DBSP_OK;
    DbspFile *f = NULL;
    if (!tmp || !dir) { rc = oom(); goto out; }
    sprintf(tmp, "%s.create", ps->path);
    if ((rc = ps->vfs->open(ps->vfs, tmp, DBSP_VFS_CREATE, &f))) goto out;
    if ((rc = ps->vfs->truncate(f, 0))) goto out;
    unsigned char page[2 * PS];
    memset(page, 0, sizeof page);
    Meta m = {version, 0, 0, 0, 2, 0};
    meta_encode(&m, page + (version % 2) * PS); /* version N lives in slot N % 2 */
    if ((rc = ps->vfs->pwrite(f, page, sizeof page, 0)) || (rc = ps->vfs->fsync(f))) goto out;
    if ((rc = ps->vfs->rename(ps->vfs, tmp, ps->path))) goto out;
    rc = ps->vfs->fsync_dir(ps->vfs, dir);
out:
    if (f) ps->vfs->close(f);
    free(tmp);
    free(dir);
    return rc;
}

static int pagestore_open(const char *path, DbspVfs *vfs, size_t cache_pages, int create, uint64_t version,
                          int readonly, DbspPageStore **out) {
    DbspPageStore *ps = calloc(1, sizeof *ps);
    if (!ps) return oom();
    ps->vfs = vfs ? vfs : dbsp_vfs_posix();
    ps->path = strdup(path);
    ps->cap = 1024;
    ps->slots = calloc(ps->cap, sizeof *ps->slots);
    ps->clean_limit = cache_pages ? cache_pages : 65536;
    int rc = DBSP_OK;
    if (!ps->path || !ps->slots) { rc = oom(); goto fail; }
    ps->readonly = readonly;
    rc = ps->vfs->open(ps->vfs, path, readonly ? DBSP_VFS_READONLY : 0, &ps->f);
    if (rc == DBSP_OK && create == 2) {
        rc = dbsp_storage_fail(DBSP_ESTATE, EEXIST, "pagestore %s: exists; cannot create it at version %llu", path,
                               (unsigned long long)version);
        goto fail;
    }
    if (rc == DBSP_ENOTFOUND && create) {
        if ((rc = create_file(ps, version))) goto fail;
        rc = ps->vfs->open(ps->vfs, path, 0, &ps->f);
    }
    if (rc) goto fail;
    if ((rc = dbsp_vfs_lock(ps->f, !readonly, "pagestore"))) goto fail; /* invariant (7) */
    if ((rc = read_metas(ps))) goto fail;
#ifdef DBSP_CHECK_INVARIANTS
    if ((rc = dbsp_pagestore_check(ps))) goto fail;
#endif
    *out = ps;
    return DBSP_OK;
fail:
    dbsp_pagestore_close(ps);
    return rc;
}

int dbsp_pagestore_open(const char *path, DbspVfs *vfs, size_t cache_pages, DbspPageStore **out) {
    return pagestore_open(path, vfs, cache_pages, 1, 0, 0, out);
}

int dbsp_pagestore_open_readonly(const char *path, DbspVfs *vfs, size_t cache_pages, DbspPageStore **out) {
    return pagestore_open(path, vfs, cache_pages, 0, 0, 1, out);
}

int dbsp_pagestore_create(const char *path, DbspVfs *vfs, uint64_t version, size_t cache_pages, DbspPageStore **out) {
    return pagestore_open(path, vfs, cache_pages, 2, version, 0, out);
}

static void cache_clear(DbspPageStore *ps, int dirty_only) {
    for (size_t i = 0; i < ps->cap;) {
        if (ps->slots[i].buf && (!dirty_only || ps->slots[i].dirty)) cache_remove_at(ps, i); /* re-examine slot i */
        else i++;
    }
}

void dbsp_pagestore_close(DbspPageStore *ps) {
    if (!ps) return;
    if (ps->txn) dbsp_txn_abort(ps->txn);
    if (ps->slots) cache_clear(ps, 0);
    free(ps->slots);
    if (ps->f) ps->vfs->close(ps->f);
    free(ps->path);
    free(ps);
}

int dbsp_pagestore_versions(DbspPageStore *ps, uint64_t *first, uint64_t *count) {
    if (ps->failed) return dbsp_storage_fail(DBSP_ESTATE, 0, "pagestore %s: an earlier write failed; reopen it", ps->path);
    int s = newest_slot(ps);
    *count = (ps->valid[0] && ps->valid[1]) ? 2 : 1;
    *first = ps->meta[s].version + 1 - *count;
    return DBSP_OK;
}

int dbsp_pagestore_stats(DbspPageStore *ps, uint64_t *page_count, uint64_t *free_pages, uint64_t *last_commit_pages,
                         uint64_t *cached_pages, uint64_t *dirty_pages) {
    int s = newest_slot(ps);
    *cached_pages = ps->count;
    *dirty_pages = ps->count - ps->nclean;
    *last_commit_pages = ps->last_commit_pages;
    *page_count = ps->meta[s].page_count;
    *free_pages = ps->meta[s].nfree;
    return DBSP_OK;
}

/* ---------- transactions ---------- */
static void txn_free(DbspTxn *t) {
    for (size_t i = 0; i < t->ntables; i++) free(t->tables[i].name);
    free(t->tables);
    free(t->pool.a);
    free(t->pending.a);
    free(t->dirty.a);
    free(t->scratch);
    free(t);
}

static int txn_new(DbspPageStore *ps, uint64_t v, DbspTxn **out) {
    if (ps->failed) return dbsp_storage_fail(DBSP_ESTATE, 0, "pagestore %s: an earlier write failed; reopen it", ps->path);
    if (ps->txn) return dbsp_storage_fail(DBSP_ESTATE, 0, "pagestore %s: a transaction is already open", ps->path);
    int s = (int)(v % 2);
    if (!ps->valid[s] || ps->meta[s].version != v)
        return dbsp_storage_fail(DBSP_ENOTFOUND, 0, "pagestore %s: version %llu is not openable", ps->path,
                                 (unsigned long long)v);
    DbspTxn *t = calloc(1, sizeof *t);
    if (!t) return oom();
    t->ps = ps;
    t->m = ps->meta[s];
    *out = t;
    return DBSP_OK;
}

int dbsp_pagestore_read(DbspPageStore *ps, uint64_t v, DbspTxn **out) {
    DbspTxn *t;
    int rc = txn_new(ps, v, &t);
    if (rc) return rc;
    t->readonly = 1;  /* m.version stays v; no free list is loaded and no version is discarded */
    ps->txn = t;
    *out = t;
    return DBSP_OK;
}

int dbsp_pagestore_begin(DbspPageStore *ps, uint64_t v, DbspTxn **out) {
    if (ps->readonly)
        return dbsp_storage_fail(DBSP_ESTATE, 0, "pagestore %s: opened read-only; open(v) writes (use read(v))", ps->path);
    DbspTxn *t;
    int rc = txn_new(ps, v, &t);
    if (rc) return rc;
    int s = (int)(v % 2);
    t->m.version = v + 1;
    for (uint64_t fl = ps->meta[s].freelist; fl;) {
        unsigned char *p;
        if ((rc = page_get_typed(ps, fl, T_FREELIST, &p))) goto fail;
        uint32_t n = rd32(p + 28);
        if (n > FL_CAP) { rc = ps_corrupt(ps, fl, "free-list page overfull"); goto fail; }
        uint64_t next = rd64(p + 32);
        for (uint32_t i = 0; i < n; i++) {
            uint64_t f = rd64(p + 40 + 8 * i);
            if (f < 2 || f >= t->m.page_count) { rc = ps_corrupt(ps, fl, "free-list entry out of range"); goto fail; }
            if ((rc = vec_push(&t->pool, f))) goto fail;
        }
        if ((rc = vec_push(&t->pending, fl))) goto fail;
        fl = next;
    }
    if (t->pool.n != ps->meta[s].nfree) { rc = ps_corrupt(ps, ps->meta[s].freelist, "free count differs from meta"); goto fail; }
    if (t->pool.n) /* (an empty pool's array is NULL: qsort's pointer must not be, even for 0 items) */
        qsort(t->pool.a, t->pool.n, sizeof *t->pool.a, cmp_u64_desc); /* pop the lowest page first */
    /* only now that v's free list checked out: discard the other version durably before reusing its pages */
    if (ps->valid[!s]) {
        unsigned char zero[META_USED] = {0};
        ps->valid[!s] = 0;
        if ((rc = ps->vfs->pwrite(ps->f, zero, sizeof zero, (uint64_t)(!s) * PS)) || (rc = ps->vfs->fsync(ps->f))) {
            ps->failed = 1;
            goto fail;
        }
    }
    ps->txn = t;
    *out = t;
    return DBSP_OK;
fail:
    txn_free(t);
    return rc;
}

uint64_t dbsp_txn_version(DbspTxn *t) { return t->m.version; }

void dbsp_txn_abort(DbspTxn *t) {
    if (!t) return;
    cache_clear(t->ps, 1);
    t->ps->txn = NULL;
    txn_free(t);
}

static int check_key(const void *table, size_t tlen, size_t klen) {
    if (tlen == 0 || tlen > DBSP_PAGESTORE_MAX_TABLE_NAME)
        return dbsp_storage_fail(DBSP_EINVAL, 0, "pagestore: table name must be 1..%u bytes, got %zu",
                                 DBSP_PAGESTORE_MAX_TABLE_NAME, tlen);
    if (klen > DBSP_PAGESTORE_MAX_KEY)
        return dbsp_storage_fail(DBSP_ETOOBIG, 0, "pagestore: key of %zu bytes exceeds %u", klen, DBSP_PAGESTORE_MAX_KEY);
    return DBSP_OK;
}

static int txn_usable(DbspTxn *t) {
    if (t->failed) return dbsp_storage_fail(DBSP_ESTATE, 0, "pagestore %s: transaction failed earlier", t->ps->path);
    return DBSP_OK;
}

/* Finds a table; creates an empty one if `create`. DBSP_ENOTFOUND if absent and not created. */
static int table_find(DbspTxn *t, const void *name, size_t len, int create, Table **out) {
    for (size_t i = 0; i < t->ntables; i++)
        if (t->tables[i].len == len && memcmp(t->tables[i].name, name, len) == 0) { *out = &t->tables[i]; return DBSP_OK; }
    unsigned char *cp;
    unsigned ci;
    uint64_t root = 0;
    int rc = tree_get(t->ps, t->m.catalog, name, len, &cp, &ci);
    if (rc == DBSP_OK) root = rd64(cell_at(cp, ci) + 8 + len);
    else if (rc != DBSP_ENOTFOUND) return rc;
    else if (!create) return DBSP_ENOTFOUND;
    if (t->ntables == t->tcap) {
        size_t cap = t->tcap ? t->tcap * 2 : 8;
        Table *tb = realloc(t->tables, cap * sizeof *tb);
        if (!tb) return oom();
        t->tables = tb;
        t->tcap = cap;
    }
    Table *tb = &t->tables[t->ntables];
    if (!(tb->name = malloc(len))) return oom();
    memcpy(tb->name, name, len);
    tb->len = len;
    tb->root = root;
    tb->dirty = rc == DBSP_ENOTFOUND;
    t->ntables++;
    *out = tb;
    return DBSP_OK;
}

static int cell_value(DbspTxn *t, unsigned char *cell, unsigned char **buf, size_t *cap, const void **val, size_t *vlen) {
    size_t kl = rd16(cell), vl = rd32(cell + 4);
    *vlen = vl;
    if (!(cell[2] & 1)) {
        int rc = scratch_reserve(buf, cap, vl ? vl : 1);
        if (rc) return rc;
        memcpy(*buf, cell + 8 + kl, vl);
        *val = *buf;
        return DBSP_OK;
    }
    int rc = overflow_read(t->ps, rd64(cell + 8 + kl), vl, buf, cap);
    *val = *buf;
    return rc;
}

int dbsp_txn_get(DbspTxn *t, const void *table, size_t tlen, const void *key, size_t klen, const void **val,
                 size_t *vlen) {
    int rc = txn_usable(t);
    if (rc || (rc = check_key(table, tlen, klen))) return rc;
    Table *tb;
    if ((rc = table_find(t, table, tlen, 0, &tb))) return rc;
    unsigned char *p;
    unsigned i;
    if ((rc = tree_get(t->ps, tb->root, key, klen, &p, &i))) return rc;
    return cell_value(t, cell_at(p, i), &t->scratch, &t->scratch_cap, val, vlen);
}

static int txn_writable(DbspTxn *t) {
    int rc = txn_usable(t);
    if (!rc && t->readonly)
        rc = dbsp_storage_fail(DBSP_ESTATE, 0, "pagestore %s: a read-only handle cannot write", t->ps->path);
    return rc;
}

int dbsp_txn_put(DbspTxn *t, const void *table, size_t tlen, const void *key, size_t klen, const void *val,
                 size_t vlen) {
    int rc = txn_writable(t);
    if (rc || (rc = check_key(table, tlen, klen))) return rc;
    Table *tb;
    if ((rc = table_find(t, table, tlen, 1, &tb))) return rc;
    t->mods++;
    uint64_t root = tb->root;
    rc = tree_put(t, &root, key, klen, val, vlen);
    if (rc) { t->failed = 1; return rc; }
    if (root != tb->root) { tb->root = root; tb->dirty = 1; }
    return DBSP_OK;
}

int dbsp_txn_delete(DbspTxn *t, const void *table, size_t tlen, const void *key, size_t klen, int *found) {
    int rc = txn_writable(t);
    *found = 0;
    if (rc || (rc = check_key(table, tlen, klen))) return rc;
    Table *tb;
    rc = table_find(t, table, tlen, 0, &tb);
    if (rc == DBSP_ENOTFOUND) return DBSP_OK;
    if (rc) return rc;
    t->mods++;
    uint64_t root = tb->root;
    rc = tree_delete(t, &root, key, klen, found);
    if (rc) { t->failed = 1; return rc; }
    if (root != tb->root) { tb->root = root; tb->dirty = 1; }
    return DBSP_OK;
}

int dbsp_txn_get_step(DbspTxn *t, int64_t *step) { *step = t->m.step; return DBSP_OK; }
int dbsp_txn_set_step(DbspTxn *t, int64_t step) {
    int rc = txn_writable(t);
    if (!rc) t->m.step = step;
    return rc;
}

/* Writes every dirty table root into the catalog tree. */
static int catalog_sync(DbspTxn *t) {
    for (size_t i = 0; i < t->ntables; i++) {
        Table *tb = &t->tables[i];
        if (!tb->dirty) continue;
        unsigned char v[8];
        wr64(v, tb->root);
        t->mods++;
        int rc = tree_put(t, &t->m.catalog, tb->name, tb->len, v, 8);
        if (rc) { t->failed = 1; return rc; }
        tb->dirty = 0;
    }
    return DBSP_OK;
}

/* Writes the free list of the new version: every page of [2, page_count) the new version does not reach. */
static int freelist_build(DbspTxn *t) {
    int rc;
    size_t k = 0; /* free-list pages needed; taking a pool page for the list shrinks the list by one */
    Vec fl_pages = {0};
    for (;;) {
        size_t entries = t->pool.n + t->pending.n;
        size_t need = (entries + FL_CAP - 1) / FL_CAP;
        if (k >= need) break;
        unsigned char *p;
        uint64_t pg;
        if ((rc = page_alloc(t, T_FREELIST, &p, &pg)) || (rc = vec_push(&fl_pages, pg))) { free(fl_pages.a); return rc; }
        k++;
    }
    size_t total = t->pool.n + t->pending.n, at = 0;
    t->m.nfree = total;
    t->m.freelist = k ? fl_pages.a[0] : 0;
    for (size_t j = 0; j < k; j++) {
        unsigned char *p = cache_find(t->ps, fl_pages.a[j])->buf;
        uint32_t n = 0;
        while (n < FL_CAP && at < total) {
            uint64_t f = at < t->pool.n ? t->pool.a[at] : t->pending.a[at - t->pool.n];
            wr64(p + 40 + 8 * n, f);
            n++;
            at++;
        }
        wr32(p + 28, n);
        wr64(p + 32, j + 1 < k ? fl_pages.a[j + 1] : 0);
    }
    free(fl_pages.a);
    return DBSP_OK;
}

static int write_dirty(DbspTxn *t) {
    DbspPageStore *ps = t->ps;
    Vec *d = &t->dirty;
    ps->last_commit_pages = t->through;
    if (d->n) qsort(d->a, d->n, sizeof *d->a, cmp_u64);
    enum { RUN = 256 };
    unsigned char *stage = malloc((size_t)RUN * PS);
    if (!stage) return oom();
    int rc = DBSP_OK;
    uint64_t run_start = 0;
    size_t run_len = 0;
    for (size_t i = 0; i <= d->n; i++) {
        Ent *e = NULL;
        if (i < d->n) {
            if (i > 0 && d->a[i] == d->a[i - 1]) continue;
            e = cache_find(ps, d->a[i]);
            if (!e || !e->dirty) continue; /* freed again within the transaction */
        }
        if (e) ps->last_commit_pages++;
        if (run_len && (!e || d->a[i] != run_start + run_len || run_len == RUN)) {
            if ((rc = ps->vfs->pwrite(ps->f, stage, run_len * PS, run_start * PS))) break;
            run_len = 0;
        }
        if (!e) break;
        if (!run_len) run_start = d->a[i];
        wr32(e->buf, page_crc(e->buf));
        memcpy(stage + run_len * PS, e->buf, PS);
        run_len++;
    }
    free(stage);
    return rc;
}

int dbsp_txn_commit(DbspTxn *t) {
    DbspPageStore *ps = t->ps;
    int rc = txn_writable(t);
    if (rc) { dbsp_txn_abort(t); return rc; }
    if ((rc = catalog_sync(t)) || (rc = freelist_build(t))) { dbsp_txn_abort(t); return rc; }
    if ((rc = write_dirty(t)) || (rc = ps->vfs->fsync(ps->f))) goto io_fail;
    unsigned char mb[META_USED];
    meta_encode(&t->m, mb);
    int s = (int)(t->m.version % 2);
    if ((rc = ps->vfs->pwrite(ps->f, mb, META_USED, (uint64_t)s * PS)) || (rc = ps->vfs->fsync(ps->f))) goto io_fail;
    ps->meta[s] = t->m;
    ps->valid[s] = 1;
    for (size_t i = 0; i < t->dirty.n; i++) { /* the written pages are now clean copies of disk */
        Ent *e = cache_find(ps, t->dirty.a[i]);
        if (e && e->dirty) { e->dirty = 0; ps->nclean++; }
    }
    ps->txn = NULL;
    txn_free(t);
    cache_evict_clean(ps);
#ifdef DBSP_CHECK_INVARIANTS
    if ((rc = dbsp_pagestore_check(ps))) { ps->failed = 1; return rc; }
#endif
    return DBSP_OK;
io_fail:
    ps->failed = 1; /* what reached the disk is unknown until the file is reopened */
    dbsp_txn_abort(t);
    return rc;
}

/* ---------- cursors ---------- */
int dbsp_cursor_open(DbspTxn *t, const void *table, size_t tlen, const void *start, size_t slen, const void *end,
                     size_t elen, DbspCursor **out) {
    int rc = txn_usable(t);
    if (rc) return rc;
    uint64_t root;
    if (table) {
        if ((rc = check_key(table, tlen, 0))) return rc;
        Table *tb;
        rc = table_find(t, table, tlen, 0, &tb);
        if (rc && rc != DBSP_ENOTFOUND) return rc;
        root = rc ? 0 : tb->root;
        rc = DBSP_OK;
    } else {
        if ((rc = catalog_sync(t))) return rc;
        root = t->m.catalog;
    }
    DbspCursor *c = calloc(1, sizeof *c);
    if (!c) return oom();
    c->t = t;
    c->mods = t->mods;
    if (end) {
        c->has_end = 1;
        c->elen = elen;
        if (!(c->end = malloc(elen ? elen : 1))) { free(c); return oom(); }
        memcpy(c->end, end, elen);
    }
    if (!root) c->done = 1;
    for (uint64_t pg = root; pg;) {
        unsigned char *p;
        if (c->depth >= MAX_DEPTH) { rc = ps_corrupt(t->ps, pg, "tree too deep"); break; }
        if ((rc = page_get(t->ps, pg, &p))) break;
        int eq;
        unsigned i = node_search(p, start ? start : "", start ? slen : 0, &eq);
        c->pg[c->depth] = pg;
        c->idx[c->depth++] = (int)i;
        if (p[4] == T_LEAF) break;
        if (p[4] != T_BRANCH) { rc = ps_corrupt(t->ps, pg, "expected a tree node"); break; }
        pg = branch_child(p, i);
    }
    if (rc) { dbsp_cursor_close(c); return rc; }
    *out = c;
    return DBSP_OK;
}

int dbsp_cursor_next(DbspCursor *c, const void **key, size_t *klen, const void **val, size_t *vlen) {
    if (c->done) return DBSP_ENOTFOUND;
    if (c->mods != c->t->mods)
        return dbsp_storage_fail(DBSP_ESTATE, 0, "pagestore: the table changed during a scan");
    DbspPageStore *ps = c->t->ps;
    int rc;
    for (;;) {
        unsigned char *p;
        int d = c->depth - 1;
        if ((rc = page_get(ps, c->pg[d], &p))) return rc;
        if ((unsigned)c->idx[d] < nkeys(p)) {
            unsigned char *cell = cell_at(p, (unsigned)c->idx[d]++);
            size_t kl = rd16(cell);
            if (c->has_end && keycmp(cell + 8, kl, c->end, c->elen) >= 0) { c->done = 1; return DBSP_ENOTFOUND; }
            if ((rc = scratch_reserve(&c->kbuf, &c->kcap, kl ? kl : 1))) return rc;
            memcpy(c->kbuf, cell + 8, kl);
            *key = c->kbuf;
            *klen = kl;
            unsigned char cellcopy[8 + DBSP_PAGESTORE_MAX_KEY + MAX_INLINE];
            memcpy(cellcopy, cell, leaf_cell_len(cell));
            return cell_value(c->t, cellcopy, &c->vbuf, &c->vcap, val, vlen);
        }
        /* climb to the first ancestor with a next child, then descend to its leftmost leaf */
        for (;;) {
            if (--c->depth == 0) { c->done = 1; return DBSP_ENOTFOUND; }
            d = c->depth - 1;
            if ((rc = page_get(ps, c->pg[d], &p))) return rc;
            if ((unsigned)c->idx[d] < nkeys(p)) break;
        }
        c->idx[d]++;
        uint64_t pg = branch_child(p, (unsigned)c->idx[d]);
        for (;;) {
            if (c->depth >= MAX_DEPTH) return ps_corrupt(ps, pg, "tree too deep");
            if ((rc = page_get(ps, pg, &p))) return rc;
            c->pg[c->depth] = pg;
            c->idx[c->depth++] = 0;
            if (p[4] == T_LEAF) break;
            if (p[4] != T_BRANCH) return ps_corrupt(ps, pg, "expected a tree node");
            pg = branch_child(p, 0);
        }
    }
}

void dbsp_cursor_close(DbspCursor *c) {
    if (!c) return;
    free(c->end);
    free(c->kbuf);
    free(c->vbuf);
    free(c);
}
