/* cdata.h: the Arrow C data interface (ABI-stable structs of arrow/c/abi.h) and views of exported record batches as DbspColumns.
 *
 * Invariants:
 *  1. A record batch is exported as a struct array (format "+s") whose children are the columns; the view of
 *     column k reads child k's buffers with child offset + struct offset, so a sliced batch views its rows only.
 *  2. A column maps to a DbspType by its format string alone; dictionary-encoded columns and extension types
 *     (metadata key "ARROW:extension:name") are unsupported, like every format not listed in cdata.c.
 *  3. The view borrows the buffers: the caller keeps the exported structs alive (unreleased) while it is used.
 *  4. A batch this file exports owns its buffers: releasing the root releases every child not moved away, and
 *     each child frees its own buffers, so a consumer may keep some columns and drop the rest.
 *  5. Batches exported from a share (dbsp_cdata_share_*) may hold the same buffers, in one or several batches (a
 *     linear group-by's trace batch and output: their key columns and slot values): the share owns every buffer
 *     given to it and counts a reference per exported column (and one for its maker); each column's release drops
 *     its reference, and the last one frees every buffer, so invariant 4 holds column by column. A buffer that one
 *     column alone shows is that column's own (freed with it), so no batch pins what only another one shows.
 */
#ifndef DBSP_CDATA_H
#define DBSP_CDATA_H

#include <stdint.h>
#include "column.h"

#ifndef ARROW_C_DATA_INTERFACE
#define ARROW_C_DATA_INTERFACE
#define ARROW_FLAG_DICTIONARY_ORDERED 1
#define ARROW_FLAG_NULLABLE 2
#define ARROW_FLAG_MAP_KEYS_SORTED 4

struct ArrowSchema {
    const char *format;
    const char *name;
    const char *metadata;
    int64_t flags;
    int64_t n_children;
    struct ArrowSchema **children;
    struct ArrowSchema *dictionary;
    void (*release)(struct ArrowSchema *);
    void *private_data;
};

struct ArrowArray {
    int64_t length;
    int64_t null_count;
    int64_t offset;
    int64_t n_buffers;
    int64_t n_children;
    const void **buffers;
    struct ArrowArray **children;
    struct ArrowArray *dictionary;
    void (*release)(struct ArrowArray *);
    void *private_data;
};
/* Columns whose buffers are regions (scratch.h: dbsp_region_alloc) exported as a record batch of n rows that owns
 * them: column k has type types[k], null count null_counts[k] and buffers bufs[3k..3k+2] (validity or NULL, values,
 * character data or NULL) with mapped sizes mapped[3k..3k+2]; releasing a column frees its regions. On success
 * the regions belong to *out; on DBSP_ENOMEM nothing is taken. */
int dbsp_cdata_export_regions(int32_t ncols, const int32_t *types, int64_t n, const int64_t *null_counts,
                              void **bufs, const size_t *mapped, struct ArrowArray *out);

#endif

/* The DbspType of an exported column's schema, or 0 when the type is unsupported (invariant 2). */
int32_t dbsp_cdata_type(const struct ArrowSchema *s);

/* 1 if child k of record batch schema t and child col of s have the same type (format strings; no dictionaries or
 * extension types on either side), else 0. */
int dbsp_cdata_same_type(const struct ArrowSchema *t, int64_t k, const struct ArrowSchema *s, int32_t col);

/* Fill cols[0..ncols) and *nrows from an exported record batch (invariant 1). `empty` stands in for absent
 * (NULL) buffers, so every pointer of a view is valid; it must hold at least 8 zero bytes.
 * Returns DBSP_OK, DBSP_EINVAL if the structs are not a record batch of ncols columns with the buffers their
 * types need, or DBSP_ETYPE with *bad = the first unsupported column. */
int dbsp_cdata_view(const struct ArrowSchema *s, const struct ArrowArray *a, int32_t ncols, DbspColumn *cols,
                    int64_t *nrows, const uint8_t *empty, int32_t *bad);

/* The rows idx[0..m) of b (indices already checked: dbsp_gather_check) as a newly exported record batch: *out
 * becomes a struct array ("+s", no nulls) with one child per column of b, in b's types, holding malloc'ed buffers
 * that its release callback frees (invariant 4). Columns are gathered with gather.h. Errors (nothing exported):
 * DBSP_ENOMEM, DBSP_ETOOBIG (a utf8/binary result past 2^31-1 bytes), DBSP_ETYPE. */
int dbsp_cdata_gather(const DbspBatch *b, const int64_t *idx, int64_t m, struct ArrowArray *out);

/* The columns acols[0..na) of a at rows aidx[0..m), then (b not NULL) columns bcols[0..nb) of b at rows
 * bidx[0..m), side by side as one exported record batch (a join's output rows); NULL column lists mean every
 * column in order. Indices already checked; DBSP_EINVAL for a column outside its batch. */
int dbsp_cdata_gather2(const DbspBatch *a, const int32_t *acols, int32_t na, const int64_t *aidx,
                       const DbspBatch *b, const int32_t *bcols, int32_t nb, const int64_t *bidx, int64_t m,
                       struct ArrowArray *out);

/* The columns acols[0..na) of a at rows aidx[0..m) (indices checked, as dbsp_cdata_gather2), then ni int64 columns of
 * m values each: ivals[k] and the validity bitmap ivalid[k] (inulls[k] nulls; both malloc'ed, ivalid[k] may be NULL
 * when inulls[k] is 0), which the export takes over on DBSP_OK (an unused bitmap is freed); on an error they stay
 * the caller's. */
int dbsp_cdata_gather_ints(const DbspBatch *a, const int32_t *acols, int32_t na, const int64_t *aidx, int64_t m,
                           int32_t ni, int64_t *const *ivals, uint8_t *const *ivalid, const int64_t *inulls,
                           struct ArrowArray *out);

/* Invariant 5. A share of up to cap buffers (NULL: no memory), held by its maker until dbsp_cdata_share_drop. */
typedef struct DbspCDataShare DbspCDataShare;
typedef struct DbspCDataCol {  /* a column of a share's export: its buffers (validity or NULL, values, data) */
    int64_t null_count;
    int32_t n_buffers;
    const void *bufs[3];
    void *own[2];  /* buffers of this column alone (malloc'ed, among bufs; or NULL): freed with the column, not shared */
} DbspCDataCol;
DbspCDataShare *dbsp_cdata_share_new(int32_t cap);
/* The share takes buf (malloc'ed; NULL is ignored) and frees it with its last reference: DBSP_ENOMEM when it holds
 * cap buffers already (buf then stays the caller's). */
int dbsp_cdata_share_take(DbspCDataShare *sh, void *buf);
/* Column c of nrows rows at rows idx[0..m) (checked) gathered into buffers the share takes, described in *col. */
int dbsp_cdata_share_gather(DbspCDataShare *sh, const DbspColumn *c, int64_t nrows, const int64_t *idx, int64_t m,
                            DbspCDataCol *col);
/* A record batch of m rows whose columns are cols[0..ncols) (buffers the share holds, and each column's own, which
 * the export takes on DBSP_OK) exported into *out. */
int dbsp_cdata_share_export(DbspCDataShare *sh, int32_t ncols, const DbspCDataCol *cols, int64_t m,
                            struct ArrowArray *out);
/* The maker's reference dropped (the buffers freed unless an exported column holds them). */
void dbsp_cdata_share_drop(DbspCDataShare *sh);

/* Columns whose buffers are regions (scratch.h: dbsp_region_alloc) exported as a record batch of n rows that owns
 * them: column k has type types[k], null count null_counts[k] and buffers bufs[3k..3k+2] (validity or NULL, values,
 * character data or NULL) with mapped sizes mapped[3k..3k+2]; releasing a column frees its regions. On success
 * the regions belong to *out; on DBSP_ENOMEM nothing is taken. */
int dbsp_cdata_export_regions(int32_t ncols, const int32_t *types, int64_t n, const int64_t *null_counts,
                              void **bufs, const size_t *mapped, struct ArrowArray *out);

#endif
