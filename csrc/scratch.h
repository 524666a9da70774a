/* scratch.h: large scratch buffers for kernels, reused per thread across calls (see scratch.c). */
#ifndef DBSP_SCRATCH_H
#define DBSP_SCRATCH_H

#include <stddef.h>

/* like malloc(bytes) (never zeroed); NULL when out of memory */
void *dbsp_scratch_alloc(size_t bytes);

/* release a buffer from dbsp_scratch_alloc, given the same byte count (NULL is ignored) */
void dbsp_scratch_free(void *p, size_t bytes);

/* like malloc(bytes) for a large buffer the caller keeps (a kernel's result; free it with free()): from 2 MiB on,
 * aligned and madvised for transparent huge pages (unless DBSP_HUGEPAGES=0), so filling it faults once per 2 MiB
 * instead of per 4 KiB */
void *dbsp_alloc_result(size_t bytes);

/* Memory for a result that may end up shorter than allocated (a merge's output, merge.h): from
 * DBSP_REGION_MAP_MIN bytes on, anonymous mapped pages (madvised for huge pages from 2 MiB), whose unused tail
 * dbsp_region_trim returns to the system without moving the head; below, plain malloc (*mapped = 0). NULL when
 * out of memory. */
#define DBSP_REGION_MAP_MIN ((size_t)1 << 20)
void *dbsp_region_alloc(size_t bytes, size_t *mapped);

/* Unmap the pages of a region past its first `keep` bytes; returns the new mapped size (a malloc'ed region,
 * mapped == 0, is kept whole). */
size_t dbsp_region_trim(void *p, size_t mapped, size_t keep);

/* Free a region given its current mapped size (0: a malloc'ed region). Mapped regions are kept for reuse by
 * dbsp_region_alloc, up to DBSP_REGION_CACHE_MB MiB in all (read once; default 256, 0 disables it). */
void dbsp_region_free(void *p, size_t mapped);

/* Set the limit of every thread's scratch cache (what DBSP_SCRATCH_MB sets at first use; design note 3),
 * trimming the calling thread's cache down to it (the others trim at their next free); returns the previous
 * limit. A memory budget lowers it (dbsp_core/trace/spill.py). */
size_t dbsp_scratch_cache_limit(size_t bytes);

/* Set the region cache's limit (what DBSP_REGION_CACHE_MB sets at first use), trimming the cache down to it;
 * returns the previous limit. A memory budget lowers it (dbsp_core/trace/spill.py). */
size_t dbsp_region_cache_limit(size_t bytes);

/* Return cached memory to the system (design note 6): this thread's scratch cache down to at most `keep` bytes,
 * the process's region cache down to at most `keep` bytes, largest buffers first; returns the bytes released.
 * What is cached after it still serves the next calls. */
size_t dbsp_scratch_trim(size_t keep);
size_t dbsp_region_cache_trim(size_t keep);
/* Bytes cached now: this thread's scratch cache, the process's region cache. */
size_t dbsp_scratch_cached(void);
size_t dbsp_region_cached(void);
/* glibc's malloc_trim(0): the free memory of every malloc arena returned to the system (1 when some was; 0, and
 * nothing done, without glibc). */
int dbsp_malloc_trim(void);
/* 1 when buffers of 2 MiB and more are madvised for transparent huge pages (DBSP_HUGEPAGES, read once), else 0 */
int dbsp_hugepages(void);
/* madvise(MADV_HUGEPAGE) over [p, p + bytes) unless DBSP_HUGEPAGES=0 (design note 2): the one switch of every such
 * advice of the C core, the key index's regions included (keyindex.c) */
void dbsp_advise_huge(void *p, size_t bytes);

#endif
