/* floor_join_step.c: the least work a small inner-join step must do, in C alone, as the floor that the engine's join
 * step is judged against (issue 37, bench/history/RESULTS-2026-11-28-to-2026-12-02.md r37-joinf): hash a 1k-row change of bids' join keys, probe them
 * with prefetching into a table of the 100k auctions, emit one output row per match (the bid's columns auction, bidder,
 * price, then the auction's id and category, and the weight) and append the change to the bids side's rows.
 *
 *     cc -O2 -march=native -I csrc -o /tmp/floor_join_step bench/floor_join_step.c
 *     /tmp/floor_join_step [state_rows auctions change_rows steps]          # defaults 1000000 100000 1000 2000
 *     valgrind --tool=callgrind --toggle-collect=step_join /tmp/floor_join_step 1000000 100000 1000 200
 *
 * Not the engine's code and not its state: the auctions side is one open-addressing table of inline entries (id,
 * category), linear probing, built once; the bids side is three growing column arrays and a weight array to which
 * each step appends its change (no index, no consolidation of the change, no canonical order, no trace levels, no
 * merges, no undo, no Arrow export; the appended rows' pages are faulted in before the steps). The key hash is the
 * engine's (csrc/hash.h, one int64 column), so a probe lands where the engine's would. Prints ns a change row (the
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

typedef struct { int64_t id, category; } Ent;  /* 16 B: four a cache line; id -1: an empty slot */

typedef struct {
    Ent *t;
    uint64_t mask;
} Table;

typedef struct {  /* the bids side: its rows so far, column by column */
    int64_t *auction, *bidder, *price, *w;
    int64_t n;
} Side;

typedef struct {  /* a step's output rows, column by column */
    int64_t *auction, *bidder, *price, *id, *category, *w;
} Out;

static inline const Ent *probe(const Table *tb, int64_t key, uint64_t h) {
    for (uint64_t i = h & tb->mask;; i = (i + 1) & tb->mask) {
        const Ent *e = &tb->t[i];
        if (e->id == key || e->id < 0) return e;
    }
}

#define PF 8  /* rows ahead whose slot is prefetched */

/* One step: the keys' hashes, then per row a prefetch PF rows ahead, the probe and the emit of a match; then the
 * change appended to the bids side. Returns rows out. */
__attribute__((noinline)) int64_t step_join(const Table *tb, Side *bids, const int64_t *auction, const int64_t *bidder,
                                            const int64_t *price, const int64_t *w, int64_t n, uint64_t *h, Out *o) {
    for (int64_t i = 0; i < n; i++) h[i] = dbsp_hash_int_row((uint64_t)auction[i]);
    for (int64_t i = 0; i < n && i < PF; i++) __builtin_prefetch(&tb->t[h[i] & tb->mask]);
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + PF < n) __builtin_prefetch(&tb->t[h[i + PF] & tb->mask]);
        const Ent *e = probe(tb, auction[i], h[i]);
        if (e->id < 0) continue;
        o->auction[m] = auction[i]; o->bidder[m] = bidder[i]; o->price[m] = price[i];
        o->id[m] = e->id; o->category[m] = e->category; o->w[m] = w[i];
        m++;
    }
    int64_t at = bids->n;
    memcpy(bids->auction + at, auction, (size_t)n * 8);
    memcpy(bids->bidder + at, bidder, (size_t)n * 8);
    memcpy(bids->price + at, price, (size_t)n * 8);
    memcpy(bids->w + at, w, (size_t)n * 8);
    bids->n += n;
    return m;
}

int main(int argc, char **argv) {
    int64_t state = argc > 1 ? atoll(argv[1]) : 1000000, groups = argc > 2 ? atoll(argv[2]) : 100000;
    int64_t n = argc > 3 ? atoll(argv[3]) : 1000, steps = argc > 4 ? atoll(argv[4]) : 2000;
    uint64_t cap = 1;
    while (cap < (uint64_t)groups * 4 / 3 + 1) cap <<= 1;  /* at most 3/4 full */
    Table tb = {malloc(cap * sizeof(Ent)), cap - 1};
    for (uint64_t i = 0; i < cap; i++) tb.t[i].id = -1;
    for (int64_t a = 0; a < groups; a++) {
        Ent *e = (Ent *)probe(&tb, a, dbsp_hash_int_row((uint64_t)a));
        e->id = a; e->category = a % 1000;
    }
    int64_t rows = state + n * steps;
    Side bids = {malloc(rows * 8), malloc(rows * 8), malloc(rows * 8), malloc(rows * 8), 0};
    for (int64_t i = 0; i < state; i++) {
        bids.auction[i] = (int64_t)(rnd() % groups); bids.bidder[i] = (int64_t)(rnd() % 1000);
        bids.price[i] = 1 + (int64_t)(rnd() % 9999); bids.w[i] = 1;
    }
    bids.n = state;
    for (int64_t i = state; i < rows; i++) bids.auction[i] = bids.bidder[i] = bids.price[i] = bids.w[i] = 0;  /* faulted in */
    Out o = {malloc(n * 8), malloc(n * 8), malloc(n * 8), malloc(n * 8), malloc(n * 8), malloc(n * 8)};
    int64_t *ca = malloc(n * 8), *cb = malloc(n * 8), *cp = malloc(n * 8), *cw = malloc(n * 8);
    uint64_t *h = malloc(n * 8);
    double *t = malloc(steps * sizeof(double));
    int64_t outrows = 0, del = 0;
    /* each step: 90% inserts of fresh random bids, 10% deletions of bids of the state (in order, as bench (a)) */
    for (int64_t s = 0; s < steps; s++) {
        int64_t nd = n / 10;
        for (int64_t i = 0; i < n - nd; i++) {
            ca[i] = (int64_t)(rnd() % groups); cb[i] = (int64_t)(rnd() % 1000); cp[i] = 1 + (int64_t)(rnd() % 9999);
            cw[i] = 1;
        }
        for (int64_t i = n - nd; i < n; i++, del++) {
            ca[i] = bids.auction[del]; cb[i] = bids.bidder[del]; cp[i] = bids.price[del]; cw[i] = -1;
        }
        double t0 = now();
        outrows += step_join(&tb, &bids, ca, cb, cp, cw, n, h, &o);
        t[s] = now() - t0;
    }
    double mean = sort_times(t, steps);
    printf("join: %lld-row bids, %lld auctions, %lld-row steps x %lld: median %.1f ns a change row (%.2f us a step), "
           "mean %.2f us, p99 %.2f us; %.0f rows out a step\n", (long long)state, (long long)groups, (long long)n,
           (long long)steps, t[steps / 2] / n * 1e9, t[steps / 2] * 1e6, mean * 1e6, t[steps * 99 / 100] * 1e6,
           (double)outrows / steps);
    free(tb.t); free(bids.auction); free(bids.bidder); free(bids.price); free(bids.w);
    free(o.auction); free(o.bidder); free(o.price); free(o.id); free(o.category); free(o.w);
    free(ca); free(cb); free(cp); free(cw); free(h); free(t);
    return 0;
}
