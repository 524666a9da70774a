/* cdata.h: the Arrow C data interface (ABI-stable structs of arrow/c/abi.h) and views of exported record batches as DbspColumns.
 *
 * Invariants:
 *  1. A record batch is exported as a struct array (format "+s") whose children are the columns; the view of
 *     column k reads child k's buffers with child offset + struct offset, so a sliced batch views its rows only.
 *  2. A column maps to a DbspType by its format string alone; dictionary-encoded columns and extension types
 *     (metadata key "ARROW:extension:name") are unsupported, like every format not listed in cdata.c.
 *  3. The view borrows the buffers: the caller keeps the exported structs alive (unreleased) while it is used.
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
#endif

/* The DbspType of an exported column's schema, or 0 when the type is unsupported (invariant 2). */
int32_t dbsp_cdata_type(const struct ArrowSchema *s);

/* Fill cols[0..ncols) and *nrows from an exported record batch (invariant 1). `empty` stands in for absent
 * (NULL) buffers, so every pointer of a view is valid; it must hold at least 8 zero bytes.
 * Returns DBSP_OK, DBSP_EINVAL if the structs are not a record batch of ncols columns with the buffers their
 * types need, or DBSP_ETYPE with *bad = the first unsupported column. */
int dbsp_cdata_view(const struct ArrowSchema *s, const struct ArrowArray *a, int32_t ncols, DbspColumn *cols,
                    int64_t *nrows, const uint8_t *empty, int32_t *bad);

#endif
