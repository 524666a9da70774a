/* lingroup.h: a linear group-by's change grouped in one hashing pass into a table sized by the change (csrc/linrun.h
 * invariant 7), the common case's stand-in for dbsp_group_reduce_all.
 *
 * Invariants:
 *  1. dbsp_lingroup serves a change whose key columns (1 to DBSP_KEYINDEX_MAX_KEYS) are fixed-width without nulls
 *     and whose slots are COUNT, COUNT_COL of a column without nulls, SUM of a signed (or uint8-32) integer column
 *     without nulls, or a limb (DBSP_LINRUN_SUM_HI / _LO) of an int64 column without nulls; for any other call it
 *     returns DBSP_LINGROUP_NO having changed nothing, and so it does when a weight, a product or a partial sum
 *     leaves int64 (the general engine, whose sums carry, then decides). What it returns otherwise is what
 *     dbsp_group_reduce_all returns over the limb columns: the same groups (row identity of the key columns: their
 *     canonical words, keyindex.h invariant 1), first rows, key hashes (hash.h) and slot sums, every group kept
 *     (also those whose weights cancel), in ascending key hash; groups sharing a key hash (never for one integer
 *     key, whose hash is a bijection) come in the order of their first rows, which dbsp_linear_fold reports as not
 *     ordered (its caller sorts).
 *  2. Each row's key is hashed once; the row probes a table of 2^k >= 2 * rows group numbers (open addressing,
 *     linear probing: the key hash, then the key words compared) for its group (qrow), and a group's first row
 *     carries its key. Then each slot sums over the rows in a loop of its own (weights, or weight times a value or
 *     a limb), a count of a column without nulls being the row count's slot. The groups are then put in key-hash order by a counting pass
 *     on the hash's top bits (about one group a bucket) and an insertion pass: no sort of the rows, no second hash.
 *  3. Scratch lives in a DbspLinGroup kept by the caller across steps (inside DbspLinRun), grown to the largest
 *     change and freed by its owner past DBSP_LINRUN_KEEP rows (linrun.h invariant 3); only the table slots a step
 *     filled are cleared after it (by the groups' recorded places), so a step costs its change, not the table.
 */
#ifndef DBSP_LINGROUP_H
#define DBSP_LINGROUP_H

#include <stdint.h>
#include "agg.h"
#include "column.h"

#define DBSP_LINGROUP_NO (-1)

typedef struct DbspLinGroup {
    int64_t rows;       /* rows the scratch has room for */
    int64_t tcap;       /* table slots: a power of two >= 2 * rows */
    int32_t ns, nkeys;
    uint32_t *tab;      /* tcap: 1 + group number, 0 empty */
    uint64_t *gh;       /* rows: key hash per group (first-seen order) */
    uint64_t *gw;       /* rows * nkeys: the key's canonical words */
    uint32_t *gpos;     /* rows: the group's table slot */
    uint32_t *gfirst;   /* rows: the group's first row */
    uint32_t *qrow;     /* rows: each row's group */
    uint32_t *ord, *cnt;  /* rows: groups in key-hash order; tcap + 1: bucket counts */
    int64_t *gs;        /* ns * rows: the groups' sums, slot-major */
    int64_t *group_row; /* rows, in key-hash order (the outputs) */
    uint64_t *khash;    /* rows */
    int64_t *ivals;     /* rows * ns */
} DbspLinGroup;

void dbsp_lingroup_free(DbspLinGroup *g);
/* Calls served (DBSP_OK), ever, in the process: for tests (the hashing pass ran). */
int64_t dbsp_lingroup_served(void);

/* Group the rows of b by keys[0..nkeys) summing specs[0..ns) (invariant 1): on DBSP_OK, *ng groups whose first rows,
 * key hashes and sums (row-major, ns a group) are g->group_row, g->khash and g->ivals, valid until the next call.
 * DBSP_LINGROUP_NO: not served (nothing changed); DBSP_ENOMEM. */
int dbsp_lingroup(DbspLinGroup *g, const DbspBatch *b, const int32_t *keys, int32_t nkeys, const DbspAggSpec *specs,
                  int32_t ns, int64_t *ng);

#endif
