/* pagestore.h: the per-worker two-version Database: a page file with two meta slots and copy-on-write B+trees. */
#ifndef DBSP_PAGESTORE_H
#define DBSP_PAGESTORE_H

#include <stddef.h>
#include <stdint.h>

#include "vfs.h"

typedef struct DbspPageStore DbspPageStore;
typedef struct DbspTxn DbspTxn;
typedef struct DbspCursor DbspCursor;

#define DBSP_PAGESTORE_FORMAT 1u
#define DBSP_PAGESTORE_MAX_KEY 1024u
#define DBSP_PAGESTORE_MAX_TABLE_NAME 255u

/* Opens the page file at `path`, creating it (version 0, empty) if missing; cache_pages bounds the clean page cache.
 * Takes an exclusive lock on the file: DBSP_EBUSY if another open store holds it (pagestore.c invariant 7). */
int dbsp_pagestore_open(const char *path, DbspVfs *vfs, size_t cache_pages, DbspPageStore **out);
/* Opens an existing page file for reading only: a shared lock (pagestore.c invariant 7; DBSP_EBUSY while a writer
 * has it open), versions, stats, check and dbsp_pagestore_read; dbsp_pagestore_begin fails with DBSP_ESTATE. */
int dbsp_pagestore_open_readonly(const char *path, DbspVfs *vfs, size_t cache_pages, DbspPageStore **out);
/* Creates a new page file at `path` whose only version is `version` (empty, step 0) and opens it; DBSP_ESTATE if the
 * file exists. A store joining others at version v (a worker added by a rescale) starts at v. */
int dbsp_pagestore_create(const char *path, DbspVfs *vfs, uint64_t version, size_t cache_pages, DbspPageStore **out);
/* Closes the store; an open transaction is aborted (its version keeps the state it had at begin). */
void dbsp_pagestore_close(DbspPageStore *ps);
/* The openable versions: first .. first+count-1 (count is 1 or 2). */
int dbsp_pagestore_versions(DbspPageStore *ps, uint64_t *first, uint64_t *count);
/* Checks the invariants (1)-(6) of pagestore.c on every openable version; DBSP_ECORRUPT if one fails. */
int dbsp_pagestore_check(DbspPageStore *ps);
/* check_version() of one openable version only; DBSP_ENOTFOUND if it is not openable. */
int dbsp_pagestore_check_version(DbspPageStore *ps, uint64_t version);
/* Page count and free-page count of the newest version, and pages written by the last commit. */
int dbsp_pagestore_stats(DbspPageStore *ps, uint64_t *page_count, uint64_t *free_pages, uint64_t *last_commit_pages,
                         uint64_t *cached_pages, uint64_t *dirty_pages);

/* Starts writing version v+1 as a copy of v and durably discards every other version. One transaction at a time. */
int dbsp_pagestore_begin(DbspPageStore *ps, uint64_t v, DbspTxn **out);
/* Reads version v as it is: discards nothing and refuses put, delete, set_step and commit (DBSP_ESTATE); close it
 * with dbsp_txn_abort. One transaction at a time, like dbsp_pagestore_begin. */
int dbsp_pagestore_read(DbspPageStore *ps, uint64_t v, DbspTxn **out);
/* Makes v and v+1 openable; frees the transaction whatever the outcome. On failure the store must be reopened. */
int dbsp_txn_commit(DbspTxn *t);
/* Drops the transaction; the store keeps v. */
void dbsp_txn_abort(DbspTxn *t);

/* Looks up key; on success *val and *vlen point to a buffer owned by the transaction, valid until its next call.
 * DBSP_ENOTFOUND if the table or key is absent. */
int dbsp_txn_get(DbspTxn *t, const void *table, size_t tlen, const void *key, size_t klen,
                 const void **val, size_t *vlen);
/* Inserts or replaces; creates the table if missing. Values of any size (large ones go to overflow pages). */
int dbsp_txn_put(DbspTxn *t, const void *table, size_t tlen, const void *key, size_t klen,
                 const void *val, size_t vlen);
/* Removes key; *found says whether it existed. */
int dbsp_txn_delete(DbspTxn *t, const void *table, size_t tlen, const void *key, size_t klen, int *found);
int dbsp_txn_get_step(DbspTxn *t, int64_t *step);
int dbsp_txn_set_step(DbspTxn *t, int64_t step);
uint64_t dbsp_txn_version(DbspTxn *t);

/* Ordered scan of keys in [start, end) of a table (end NULL = to the end); table NULL scans the catalog
 * (key = table name, value = 8-byte root). Any put/delete/commit invalidates the cursor (DBSP_ESTATE). */
int dbsp_cursor_open(DbspTxn *t, const void *table, size_t tlen, const void *start, size_t slen,
                     const void *end, size_t elen, DbspCursor **out);
/* Next entry, or DBSP_ENOTFOUND at the end; the pointers are valid until the next call on the cursor. */
int dbsp_cursor_next(DbspCursor *c, const void **key, size_t *klen, const void **val, size_t *vlen);
void dbsp_cursor_close(DbspCursor *c);

#endif
