/* scratch.c: a per-thread cache of large scratch buffers, with transparent huge pages for the largest.
 *
 * Design notes:
 *  1. Kernels allocate scratch proportional to their input (hashes, partition entries, tables). Fresh memory
 *     from the kernel costs a page fault and a page of zeroing per 4 KiB, which measured 10-25% of a 10M-row
 *     consolidate; buffers of CACHED_MIN bytes and more are therefore kept in a small per-thread cache and
 *     reused by the next call of similar size (best fit, at most twice the need).
 *  2. Buffers of BIG_ALIGN (2 MiB) and more are aligned to it and madvise(MADV_HUGEPAGE)d, which cuts the TLB
 *     misses of scattered writes; so are large result buffers (dbsp_alloc_result) and mapped regions, which cuts
 *     the page faults of filling them, and the key index's large anonymous regions (keyindex.c). DBSP_HUGEPAGES=0
 *     (read once) turns the advice off, all of it (dbsp_advise_huge is the one place it is given); the buffers stay
 *     aligned. The cost: with THP defrag = madvise (a common default, this host's), a madvised region's fault
 *     compacts memory directly (a stall) when no free 2 MiB page is at hand. Measured (bench/bench_hugepage.py,
 *     bench/RESULTS.md "Huge-page advice", 2026-11-29, load 3.3-4.8, alternated, caches trimmed after every call
 *     as after a step): with the advice, index_by of 1M rows 121-130 ms CPU per call against 131-137 without,
 *     consolidate of 1M 101-113 against 112-125 (7-10% less), join 1M x 1M, gather 1M and index_by of 92K rows
 *     the same (a 92K-row change has few buffers of 2 MiB, and the cache keeps them); Nexmark q4, q7 (1M
 *     events, W=1 and 2) the same within their spread. In a stall-prone period (memory full of page cache,
 *     host-wide compact_stall +2,100 in minutes) runs with the advice during which the host counted 49-76
 *     stalls still spent 8-9% less CPU, the stalls included (direct compaction runs in the faulting
 *     thread), with no worse tails: the advice stays on by default. DBSP_HUGEPAGES=0 is for a host whose
 *     compaction stalls do cost (compact_stall in /proc/vmstat climbing while steps slow down).
 *  3. The cache holds at most DBSP_SCRATCH_MB MiB per thread (read once; default 512, 0 disables it), evicting
 *     its smallest buffers to make room, and is released when the thread exits. dbsp_scratch_cache_limit lowers
 *     (or raises) that limit for every thread: a memory budget does (dbsp_core/trace/spill.py), since 512 MiB per
 *     thread kept beside a 100 MiB budget is most of a big step's peak; a thread over a lowered limit trims its
 *     cache down to it at its next free.
 *  4. A buffer must be freed with the byte count it was allocated with (it decides malloc vs cache).
 *  5. Regions (dbsp_region_alloc) are results that may turn out shorter than their worst case, such as a
 *     merge whose rows cancel: large ones are mapped pages, so trimming the tail unmaps pages in place and
 *     every pointer into the head stays valid (Arrow buffers over it are never moved).
 *  6. Both caches serve a run of similar calls (the steps of a stream), not the state: after a step the runtime
 *     trims them to a small size (dbsp_scratch_trim, dbsp_region_cache_trim; dbsp_core/runtime/embedded.py), so
 *     the buffers a large step left do not stay resident beside the state it built. Trimming evicts the largest
 *     buffers first: the small ones are cheap to keep and the most often reused.
 */
#include <stdlib.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <string.h>
#include <sys/mman.h>
#include <pthread.h>
#include "scratch.h"

#define BIG_ALIGN ((size_t)2 << 20)   /* huge-page size: buffers this large are aligned and madvised */
#define CACHED_MIN ((size_t)64 << 10) /* buffers from this size on go through the cache (glibc would mmap them) */
#define CACHE_SLOTS 10

typedef struct { void *p; size_t sz; } Slot;
static __thread Slot cache[CACHE_SLOTS];
static __thread size_t cached_bytes;
static pthread_key_t cache_key;
static pthread_once_t cache_once = PTHREAD_ONCE_INIT;
static size_t cache_limit;  /* read and set with __atomic: dbsp_scratch_cache_limit may run on any thread */

static void cache_release(void *unused) {
    for (int i = 0; i < CACHE_SLOTS; i++) { free(cache[i].p); cache[i].p = NULL; cache[i].sz = 0; }
    cached_bytes = 0;
}

static void cache_init(void) {
    const char *e = getenv("DBSP_SCRATCH_MB");
    cache_limit = (size_t)(e ? strtoull(e, NULL, 10) : 512) << 20;
    pthread_key_create(&cache_key, cache_release);
}

/* whether buffers of BIG_ALIGN and more get MADV_HUGEPAGE (design note 2): DBSP_HUGEPAGES, read once */
static int hugepages = 1;
static pthread_once_t huge_once = PTHREAD_ONCE_INIT;

static void huge_init(void) {
    const char *e = getenv("DBSP_HUGEPAGES");  /* "0", blanks around it allowed (dbsp_core/envvars.py checks it) */
    if (!e) return;
    while (*e == ' ' || *e == '\t') e++;
    if (*e++ != '0') return;
    while (*e == ' ' || *e == '\t') e++;
    if (!*e) hugepages = 0;
}

void dbsp_advise_huge(void *p, size_t sz) {
    pthread_once(&huge_once, huge_init);
#ifdef MADV_HUGEPAGE
    if (hugepages) madvise(p, sz, MADV_HUGEPAGE);
#endif
}

int dbsp_hugepages(void) {
    pthread_once(&huge_once, huge_init);
    return hugepages;
}

static size_t cached_size(size_t bytes) {
    size_t unit = bytes >= BIG_ALIGN ? BIG_ALIGN : CACHED_MIN;
    return (bytes + unit - 1) & ~(unit - 1);
}

void *dbsp_scratch_alloc(size_t bytes) {
    if (bytes < CACHED_MIN) return malloc(bytes ? bytes : 1);
    size_t sz = cached_size(bytes);
    pthread_once(&cache_once, cache_init);
    int best = -1;
    for (int i = 0; i < CACHE_SLOTS; i++)  /* best fit among cached buffers no more than twice the need */
        if (cache[i].p && cache[i].sz >= sz && cache[i].sz <= 2 * sz && (best < 0 || cache[i].sz < cache[best].sz)) best = i;
    if (best >= 0) {
        void *p = cache[best].p;
        cached_bytes -= cache[best].sz;
        cache[best].p = NULL; cache[best].sz = 0;
        return p;
    }
    if (sz < BIG_ALIGN) return malloc(sz);
    return dbsp_alloc_result(sz);
}

void *dbsp_alloc_result(size_t bytes) {
    if (bytes < BIG_ALIGN) return malloc(bytes ? bytes : 1);
    size_t sz = cached_size(bytes);
    void *p = NULL;
    if (posix_memalign(&p, BIG_ALIGN, sz)) return NULL;
    dbsp_advise_huge(p, sz);
    return p;
}

size_t dbsp_scratch_cache_limit(size_t bytes) {
    pthread_once(&cache_once, cache_init);
    size_t prev = __atomic_exchange_n(&cache_limit, bytes, __ATOMIC_RELAXED);
    dbsp_scratch_trim(bytes);
    return prev;
}

void dbsp_scratch_free(void *p, size_t bytes) {
    if (!p) return;
    if (bytes < CACHED_MIN) { free(p); return; }
    size_t sz = cached_size(bytes);
    size_t limit = __atomic_load_n(&cache_limit, __ATOMIC_RELAXED);
    if (cached_bytes > limit) dbsp_scratch_trim(limit);  /* a lowered limit (design note 3) */
    if (sz <= limit) {
        /* make room: evict the smallest cached buffers until this one fits in the limit and a slot */
        for (;;) {
            int free_slot = 0, smallest = -1;
            for (int i = 0; i < CACHE_SLOTS; i++) {
                if (!cache[i].p) free_slot = 1;
                else if (smallest < 0 || cache[i].sz < cache[smallest].sz) smallest = i;
            }
            if (free_slot && cached_bytes + sz <= limit) break;
            cached_bytes -= cache[smallest].sz;
            free(cache[smallest].p);
            cache[smallest].p = NULL; cache[smallest].sz = 0;
        }
        for (int i = 0; i < CACHE_SLOTS; i++)
            if (!cache[i].p) {
                cache[i].p = p; cache[i].sz = sz; cached_bytes += sz;
                pthread_setspecific(cache_key, (void *)1);  /* arm the thread-exit release */
                return;
            }
    }
    free(p);
}


#define PAGE ((size_t)4096)
#define REGION_SLOTS 16

/* freed mapped regions kept for reuse (design note 5): fresh pages cost a fault and a page of zeroing each,
 * which measured 14% of a large merge; shared by all threads (a region may die in any thread) */
static struct { void *p; size_t sz; } region_cache[REGION_SLOTS];
static size_t region_cached, region_limit;
static pthread_mutex_t region_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t region_once = PTHREAD_ONCE_INIT;

static void region_init(void) {
    const char *e = getenv("DBSP_REGION_CACHE_MB");
    region_limit = (size_t)(e ? strtoull(e, NULL, 10) : 256) << 20;
}

void *dbsp_region_alloc(size_t bytes, size_t *mapped) {
    *mapped = 0;
    if (bytes < DBSP_REGION_MAP_MIN) return malloc(bytes ? bytes : 1);
    size_t sz = (bytes + PAGE - 1) & ~(PAGE - 1);
    pthread_once(&region_once, region_init);
    pthread_mutex_lock(&region_mu);
    int best = -1;
    for (int i = 0; i < REGION_SLOTS; i++)  /* best fit no more than twice the need (trimming returns the rest) */
        if (region_cache[i].p && region_cache[i].sz >= sz && region_cache[i].sz <= 2 * sz
            && (best < 0 || region_cache[i].sz < region_cache[best].sz)) best = i;
    if (best >= 0) {
        void *p = region_cache[best].p;
        *mapped = region_cache[best].sz;
        region_cached -= region_cache[best].sz;
        region_cache[best].p = NULL; region_cache[best].sz = 0;
        pthread_mutex_unlock(&region_mu);
        return p;
    }
    pthread_mutex_unlock(&region_mu);
    void *p = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    if (sz >= BIG_ALIGN) dbsp_advise_huge(p, sz);
    *mapped = sz;
    return p;
}

size_t dbsp_region_cache_limit(size_t bytes) {
    pthread_once(&region_once, region_init);
    pthread_mutex_lock(&region_mu);
    size_t prev = region_limit;
    region_limit = bytes;
    pthread_mutex_unlock(&region_mu);
    dbsp_region_cache_trim(bytes);
    return prev;
}

size_t dbsp_region_trim(void *p, size_t mapped, size_t keep) {
    if (!p || mapped == 0) return mapped;
    size_t k = (keep + PAGE - 1) & ~(PAGE - 1);
    if (k == 0) k = PAGE;  /* keep one page: the region stays a valid (empty) buffer until freed */
    if (k >= mapped) return mapped;
    if (munmap((char *)p + k, mapped - k) != 0) return mapped;
    return k;
}

void dbsp_region_free(void *p, size_t mapped) {
    if (!p) return;
    if (!mapped) { free(p); return; }
    pthread_once(&region_once, region_init);
    if (mapped >= DBSP_REGION_MAP_MIN && mapped <= region_limit) {
        pthread_mutex_lock(&region_mu);
        for (;;) {  /* make room: evict the smallest cached regions */
            int free_slot = -1, smallest = -1;
            for (int i = 0; i < REGION_SLOTS; i++) {
                if (!region_cache[i].p) free_slot = i;
                else if (smallest < 0 || region_cache[i].sz < region_cache[smallest].sz) smallest = i;
            }
            if (free_slot >= 0 && region_cached + mapped <= region_limit) {
                region_cache[free_slot].p = p; region_cache[free_slot].sz = mapped;
                region_cached += mapped;
                pthread_mutex_unlock(&region_mu);
                return;
            }
            if (smallest < 0) break;
            munmap(region_cache[smallest].p, region_cache[smallest].sz);
            region_cached -= region_cache[smallest].sz;
            region_cache[smallest].p = NULL; region_cache[smallest].sz = 0;
        }
        pthread_mutex_unlock(&region_mu);
    }
    munmap(p, mapped);
}

size_t dbsp_scratch_trim(size_t keep) {
    size_t released = 0;
    while (cached_bytes > keep) {
        int largest = -1;
        for (int i = 0; i < CACHE_SLOTS; i++)
            if (cache[i].p && (largest < 0 || cache[i].sz > cache[largest].sz)) largest = i;
        if (largest < 0) break;
        free(cache[largest].p);
        cached_bytes -= cache[largest].sz;
        released += cache[largest].sz;
        cache[largest].p = NULL; cache[largest].sz = 0;
    }
    return released;
}

size_t dbsp_region_cache_trim(size_t keep) {
    size_t released = 0;
    pthread_mutex_lock(&region_mu);
    while (region_cached > keep) {
        int largest = -1;
        for (int i = 0; i < REGION_SLOTS; i++)
            if (region_cache[i].p && (largest < 0 || region_cache[i].sz > region_cache[largest].sz)) largest = i;
        if (largest < 0) break;
        munmap(region_cache[largest].p, region_cache[largest].sz);
        region_cached -= region_cache[largest].sz;
        released += region_cache[largest].sz;
        region_cache[largest].p = NULL; region_cache[largest].sz = 0;
    }
    pthread_mutex_unlock(&region_mu);
    return released;
}

size_t dbsp_scratch_cached(void) { return cached_bytes; }

size_t dbsp_region_cached(void) {
    pthread_mutex_lock(&region_mu);
    size_t n = region_cached;
    pthread_mutex_unlock(&region_mu);
    return n;
}

int dbsp_malloc_trim(void) {
#ifdef __GLIBC__
    return malloc_trim(0);
#else
    return 0;
#endif
}
