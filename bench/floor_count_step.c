/* floor_count_step.c: the least work a small group-by count (or count+sum) step must do, in C alone, as the floor that
 * the engine's step is judged against (issue 37, bench/history/RESULTS-2026-11-28-to-2026-12-02.md r37-gbk): hash a 1k-row change's keys, probe them
 * with prefetching into a table of 100k groups built from a 1M-row state and add their weights (and prices) there,
 * and emit each changed group's old (-1) and new (+1) totals rows (key, count[, sum] columns and a weight column).
 *
 *     cc -O2 -march=native -I csrc -o /tmp/floor_count_step bench/floor_count_step.c
 *     /tmp/floor_count_step [state_rows groups change_rows steps]         # defaults 1000000 100000 1000 2000
 *     valgrind --tool=callgrind --toggle-collect=step_count --toggle-collect=step_sum /tmp/floor_count_step
 *
 * Not the engine's code and not its state: one open-addressing table of inline entries (key, count, sum, the step that
 * last touched it), linear probing, no key-index sizing, no undo, no rollback log, no Arrow export; the key hash is the
 * engine's (csrc/hash.h, one int64 column), so a probe lands where the engine's would. A group is touched once a step:
 * its first row of the step saves its old totals and lists it; the emit walks that list. Groups that reach a count of
 * 0 stay in the table with a zero count (no removal, no shifting): a floor, not a design. Prints ns a change row (the
 * median over the steps, CLOCK_THREAD_CPUTIME_ID) and, under callgrind, instructions a step = the toggled total /
 * steps.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "hash.h"
#include "floor_util.h"

typedef struct { uint64_t key; int64_t count, sum; uint32_t stamp, pad; } Ent;  /* 32 B: two a cache line */

typedef struct {
    Ent *t;
    uint64_t mask;
    uint32_t stamp;
} Table;

static inline Ent *probe(Table *tb, uint64_t key, uint64_t h) {
    for (uint64_t i = h & tb->mask;; i = (i + 1) & tb->mask) {
        Ent *e = &tb->t[i];
        if (e->stamp == 0 || e->key == key) return e;  /* stamp 0: an empty slot (live entries have stamp >= 1) */
    }
}

#define PF 8  /* rows ahead whose slot is prefetched */

/* One step: per row, its hash, a prefetch PF rows ahead, the probe and the add; then the emit. Returns rows out. */
static int64_t step_any(Table *tb, const uint64_t *key, const int64_t *w, const int64_t *price, int64_t n, int with_sum,
                        uint64_t *h, Ent **touched, int64_t *old_c, int64_t *old_s, uint64_t *out_key,
                        int64_t *out_c, int64_t *out_s, int64_t *out_w) {
    uint32_t st = ++tb->stamp;
    for (int64_t i = 0; i < n; i++) h[i] = dbsp_hash_int_row(key[i]);
    for (int64_t i = 0; i < n && i < PF; i++) __builtin_prefetch(&tb->t[h[i] & tb->mask], 1);
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + PF < n) __builtin_prefetch(&tb->t[h[i + PF] & tb->mask], 1);
        Ent *e = probe(tb, key[i], h[i]);
        if (e->stamp != st) {  /* the group's first row of the step: keep its old totals */
            if (e->stamp == 0) { e->key = key[i]; e->count = 0; e->sum = 0; }
            e->stamp = st;
            touched[m] = e;
            old_c[m] = e->count;
            old_s[m] = e->sum;
            m++;
        }
        e->count += w[i];
        if (with_sum) e->sum += w[i] * price[i];
    }
    int64_t k = 0;
    for (int64_t g = 0; g < m; g++) {
        Ent *e = touched[g];
        if (e->count == old_c[g] && (!with_sum || e->sum == old_s[g])) continue;
        if (old_c[g] != 0) {
            out_key[k] = e->key; out_c[k] = old_c[g]; out_s[k] = old_s[g]; out_w[k] = -1; k++;
        }
        if (e->count != 0) {
            out_key[k] = e->key; out_c[k] = e->count; out_s[k] = e->sum; out_w[k] = 1; k++;
        }
    }
    return k;
}

/* two named entry points, so callgrind can toggle on each */
__attribute__((noinline)) int64_t step_count(Table *tb, const uint64_t *key, const int64_t *w, int64_t n, uint64_t *h,
                                             Ent **touched, int64_t *oc, int64_t *os, uint64_t *ok, int64_t *occ,
                                             int64_t *oss, int64_t *ow) {
    return step_any(tb, key, w, NULL, n, 0, h, touched, oc, os, ok, occ, oss, ow);
}
__attribute__((noinline)) int64_t step_sum(Table *tb, const uint64_t *key, const int64_t *w, const int64_t *price,
                                           int64_t n, uint64_t *h, Ent **touched, int64_t *oc, int64_t *os,
                                           uint64_t *ok, int64_t *occ, int64_t *oss, int64_t *ow) {
    return step_any(tb, key, w, price, n, 1, h, touched, oc, os, ok, occ, oss, ow);
}

__attribute__((noinline)) static void load(Table *tb, const uint64_t *key, const int64_t *w, const int64_t *price,
                                           int64_t n, uint64_t *h, Ent **touched, int64_t *oc, int64_t *os,
                                           uint64_t *ok, int64_t *occ, int64_t *oss, int64_t *ow) {
    (void)step_any(tb, key, w, price, n, 1, h, touched, oc, os, ok, occ, oss, ow);  /* not a measured step */
}

int main(int argc, char **argv) {
    int64_t state = argc > 1 ? atoll(argv[1]) : 1000000, groups = argc > 2 ? atoll(argv[2]) : 100000;
    int64_t n = argc > 3 ? atoll(argv[3]) : 1000, steps = argc > 4 ? atoll(argv[4]) : 2000;
    uint64_t cap = 1;
    while (cap < (uint64_t)groups * 4 / 3 + 1) cap <<= 1;  /* at most 3/4 full, as the engine's key index */
    for (int with_sum = 0; with_sum < 2; with_sum++) {
        Table tb = {calloc(cap, sizeof(Ent)), cap - 1, 0};
        uint64_t *skey = malloc(state * 8);
        int64_t *sprice = malloc(state * 8);
        uint64_t *h = malloc(state * 8);
        Ent **touched = malloc(state * sizeof(Ent *));
        int64_t *oc = malloc(state * 8), *os = malloc(state * 8), *occ = malloc(2 * state * 8);
        int64_t *oss = malloc(2 * state * 8), *ow = malloc(2 * state * 8), *ones = malloc(state * 8);
        uint64_t *ok = malloc(2 * state * 8);
        for (int64_t i = 0; i < state; i++) {
            skey[i] = rnd() % groups; sprice[i] = 1 + rnd() % 9999; ones[i] = 1;
        }
        load(&tb, skey, ones, sprice, state, h, touched, oc, os, ok, occ, oss, ow);
        /* each step: 90% inserts of fresh random rows, 10% deletions of rows of the state (in order, as bench (a)) */
        uint64_t *ckey = malloc(n * 8);
        int64_t *cw = malloc(n * 8), *cprice = malloc(n * 8);
        double *t = malloc(steps * sizeof(double));
        int64_t outrows = 0, del = 0;
        for (int64_t s = 0; s < steps; s++) {
            int64_t nd = n / 10;
            for (int64_t i = 0; i < n - nd; i++) { ckey[i] = rnd() % groups; cprice[i] = 1 + rnd() % 9999; cw[i] = 1; }
            for (int64_t i = n - nd; i < n; i++, del++) {
                ckey[i] = skey[del % state]; cprice[i] = sprice[del % state]; cw[i] = -1;
            }
            double t0 = now();
            outrows += with_sum ? step_sum(&tb, ckey, cw, cprice, n, h, touched, oc, os, ok, occ, oss, ow)
                                : step_count(&tb, ckey, cw, n, h, touched, oc, os, ok, occ, oss, ow);
            t[s] = now() - t0;
        }
        double mean = sort_times(t, steps);
        printf("%s: %lld-row state, %lld groups, %lld-row steps x %lld: median %.1f ns a change row (%.2f us a step), "
               "mean %.2f us, p99 %.2f us; %.0f rows out a step\n", with_sum ? "count+sum" : "count", (long long)state,
               (long long)groups, (long long)n, (long long)steps, t[steps / 2] / n * 1e9, t[steps / 2] * 1e6,
               mean * 1e6, t[steps * 99 / 100] * 1e6, (double)outrows / steps);
        free(tb.t); free(skey); free(sprice); free(h); free(touched); free(oc); free(os); free(occ); free(oss);
        free(ow); free(ones); free(ok); free(ckey); free(cw); free(cprice); free(t);
    }
    return 0;
}
