/* scratch.h: large scratch buffers for kernels, reused per thread across calls (see scratch.c). */
#ifndef DBSP_SCRATCH_H
#define DBSP_SCRATCH_H

#include <stddef.h>

/* like malloc(bytes) (never zeroed); NULL when out of memory */
void *dbsp_scratch_alloc(size_t bytes);

/* release a buffer from dbsp_scratch_alloc, given the same byte count (NULL is ignored) */
void dbsp_scratch_free(void *p, size_t bytes);

#endif
