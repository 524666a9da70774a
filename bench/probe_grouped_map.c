/* probe_grouped_map.c: what a warm format-2 lookup's reads would cost through a mapping instead of pread(2) (issue 31,
 * bench/history/RESULTS-2026-11-28-to-2026-12-02.md r31-f2): 1,000 random ~3.3 KiB groups a step (a 1k-row step's reads of one file), 300 steps, read
 * by pread, copied from a mapping kept between steps, or from one dropped (MADV_DONTNEED) before each step; process
 * CPU a step. Not the engine's code: a bound on what a mapped read path could save.
 *
 *     cc -O2 -o /tmp/probe_grouped_map bench/probe_grouped_map.c
 *     PYTHONPATH=. python bench/probe_grouped_phases.py --rows 10000000 --steps 1 --dir /tmp/g10m   # a format-2 file
 *     cat /tmp/g10m/two.batch > /dev/null && /tmp/probe_grouped_map /tmp/g10m/two.batch
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
static double cpu(void) { struct rusage r; getrusage(RUSAGE_SELF, &r); return r.ru_utime.tv_sec + r.ru_utime.tv_usec * 1e-6 + r.ru_stime.tv_sec + r.ru_stime.tv_usec * 1e-6; }
static double sys_(void) { struct rusage r; getrusage(RUSAGE_SELF, &r); return r.ru_stime.tv_sec + r.ru_stime.tv_usec * 1e-6; }
int main(int argc, char **argv) {
    int fd = open(argv[1], O_RDONLY);
    struct stat st; fstat(fd, &st);
    int64_t slots = st.st_size / 4096 - 2, len = 3300, steps = 300, K = 1000;
    uint8_t *m = mmap(NULL, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    madvise(m, st.st_size, MADV_RANDOM);
    uint8_t *buf = malloc(K * 4096);
    uint64_t sink = 0;
    srand(1);
    for (int mode = 0; mode < 3; mode++) {
        for (int rep = 0; rep < 2; rep++) {
            double c0 = cpu(), s0 = sys_();
            for (int s = 0; s < steps; s++) {
                if (mode == 2) madvise(m, st.st_size, MADV_DONTNEED);
                for (int k = 0; k < K; k++) {
                    int64_t at = (1 + rand() % slots) * 4096;
                    if (mode == 0) { if (pread(fd, buf + k * 4096, len, at) != len) return 1; sink += buf[k * 4096 + 100]; }
                    else { memcpy(buf + k * 4096, m + at, len); sink += buf[k * 4096 + 100]; }
                }
            }
            printf("%s: %.3f ms CPU a step (sys %.3f)\n", mode == 0 ? "pread" : mode == 1 ? "mapping kept" : "mapping dropped each step",
                   1e3 * (cpu() - c0) / steps, 1e3 * (sys_() - s0) / steps);
        }
    }
    return (int)(sink & 0);
}
