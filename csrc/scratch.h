/* scratch.h: large scratch buffers for kernels, reused per thread across calls (see scratch.c). */
#ifndef DBSP_SCRATCH_H
#define DBSP_SCRATCH_H

#include <stddef.h>

/* like malloc(bytes) (never zeroed); NULL when out of memory */
void *dbsp_scratch_alloc(size_t bytes);

/* release a buffer from dbsp_scratch_alloc, given the same byte count (NULL is ignored) */
void dbsp_scratch_free(void *p, size_t bytes);

/* like malloc(bytes) for a large buffer the caller keeps (a kernel's result; free it with free()): from 2 MiB on,
 * aligned and madvised for transparent huge pages, so filling it faults once per 2 MiB instead of per 4 KiB */
void *dbsp_alloc_result(size_t bytes);

#endif
