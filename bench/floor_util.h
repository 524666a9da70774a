/* floor_util.h: what the floor benches (bench/floor_*_step.c) share: their random numbers, thread CPU clock and the
 * sort of the step times (for the median and p99) with their mean. */
#ifndef FLOOR_UTIL_H
#define FLOOR_UTIL_H

#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include "hash.h"

static uint64_t rng_state = 7;
static inline uint64_t rnd(void) {  /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ULL);
    return dbsp_mix(z);
}

static inline double now(void) {  /* this thread's CPU time, in seconds */
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static inline int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* t[0..steps) sorted; its mean */
static inline double sort_times(double *t, int64_t steps) {
    qsort(t, (size_t)steps, sizeof(double), cmp_d);
    double mean = 0;
    for (int64_t s = 0; s < steps; s++) mean += t[s];
    return mean / (double)steps;
}

#endif
