/* groupdecode.h: a format-2 batch file's lookup read and decoded in C (dbsp_core/trace/groupedfile.py, invariants
 * G1-G4; bindings/storage.pyx grouped_gather).
 *
 * Given the file descriptor, the groups to read (their slots and Arrow record-batch message lengths, from the group
 * index and the Arrow footer) and the batch's flat schema (a kind per column), dbsp_gdec_scan reads each run of
 * adjacent groups' slots by one pread(2) into one buffer, checks the CRC-32C of every slot not checked before (and
 * marks it), parses each slot's Arrow IPC record-batch message (the flatbuffer Message and RecordBatch tables: field
 * nodes and buffers, every offset and length checked against the message and the slot), checks each group holds the
 * rows and first key hash its index entry names (G1) and picks the rows whose key hash is one of the probed ones (or
 * every row). dbsp_gdec_fill then gathers those rows of every column into one set of output buffers (Arrow layout:
 * validity bitmap, fixed-width values or bits, 32- or 64-bit offsets and values). Neither touches Python; the
 * binding releases the GIL around both.
 *
 * Mapped (d->map set: the file mapped whole, dbsp_core/trace/groupedfile.py ``GroupedFile.mapping``): no pread, no
 * copy; each group's bytes are read in place from the mapping (its slots' CRC from there on a first read, then the
 * message's header, key hashes and the picked rows only), every access bounds-checked against the mapping's length
 * first (a group past it is DBSP_GDEC_SHORT, never a fault past the file's end), and each 2 MiB unit of address space
 * a read touched is flagged in d->units (the batch store counts and drops them: spill.py invariant 12, "mapped").
 *
 * Damage never crashes nor yields wrong rows: every read of the buffer is bounds-checked first, and a failure is
 * DBSP_GDEC_DAMAGED with the group (its position in the call's list) and a sentence naming what is wrong; a message
 * this decoder does not handle (compressed bodies, a header not a record batch) is DBSP_GDEC_UNSUPPORTED, for the
 * caller's Arrow path. */
#ifndef DBSP_GROUPDECODE_H
#define DBSP_GROUPDECODE_H

#include <stddef.h>
#include <stdint.h>

#define DBSP_GDEC_UNIT_SHIFT 21 /* a unit flagged in DbspGDec.units: 2 MiB (spill.py MAP_UNIT) */

enum { DBSP_GCOL_FIXED = 0, DBSP_GCOL_BOOL = 1, DBSP_GCOL_VAR32 = 2, DBSP_GCOL_VAR64 = 3 };
enum { DBSP_GDEC_OK = 0, DBSP_GDEC_DAMAGED = 1, DBSP_GDEC_SHORT = 2, DBSP_GDEC_IOERR = 3, DBSP_GDEC_NOMEM = 4,
       DBSP_GDEC_UNSUPPORTED = 5, DBSP_GDEC_CRC = 6 };

typedef struct {
    const uint8_t *valid; /* validity bitmap, NULL: every row valid */
    const uint8_t *data;  /* values (fixed: rows * width bytes; bool: bits; var: the value bytes) */
    const uint8_t *offs;  /* var columns: rows + 1 offsets */
    int64_t data_len;
} DbspGBuf;

typedef struct {
    /* in */
    int fd;
    int64_t slot;      /* G */
    int64_t arrow_end; /* 64 + the Arrow section's length: the last CRC page ends there */
    const uint32_t *page_crcs;
    uint8_t *checked;  /* a flag per CRC page, set here */
    int64_t npages;
    int ncols;
    const int32_t *kind;  /* per column DBSP_GCOL_* */
    const int32_t *width; /* per fixed column its bytes a value */
    int khcol;            /* the key hash column (fixed, 8 bytes) */
    /* out of scan */
    int64_t nrows;        /* rows picked */
    int64_t *var_bytes;   /* per column: value bytes of the picked rows (var columns) */
    int64_t *nulls;       /* per column: nulls among the picked rows */
    int64_t bad_group;    /* the failing group (position in the list), -1 */
    int64_t bad_page;     /* the failing CRC page (DBSP_GDEC_CRC) */
    int err;              /* errno (DBSP_GDEC_IOERR) */
    char what[160];
    int64_t pages_checked; /* CRC pages checked by this call */
    int64_t groups_read;   /* dbsp_gdec_lookup: the groups its probes lie in (read) */
    int advise;           /* set by the caller: posix_fadvise(WILLNEED) every run of groups before the first read, so
                           * a cold lookup's reads from the disk overlap instead of waiting one after another */
    uint8_t *verified;    /* set by the caller, or NULL: a flag per group of the file, set once a read of the group
                           * checked its key hashes ascending (G1); a flagged group's order is not checked again. A
                           * lookup finds each probed hash in its group by binary search either way */
    const uint8_t *map;   /* set by the caller, or NULL (pread): the file's mapping from offset 0, map_len bytes */
    int64_t map_len;
    uint8_t *units;       /* with map: a flag per 2 MiB unit of the mapping's address space (unit 0 holds its first
                           * byte; nunits of them), set for each unit a group read lies in */
    int64_t nunits;
    const int64_t *gid;   /* set by dbsp_gdec_lookup: the file's group number of each entry of the scan's list
                           * (NULL: the list's positions are the file's groups) */
    /* scratch */
    uint8_t *buf;         /* the reads (the thread's scratch unless buf_own) */
    int buf_own;
    DbspGBuf *bufs;       /* groups x columns */
    int32_t *sel_g, *sel_r; /* picked rows: group, row in it */
    int64_t sel_cap;
} DbspGDec;

/* Reads and decodes groups [0, ng): group i's message at file offset slot_of[i] * slot, msg_len[i] bytes, in
 * nslots[i] slots, expected to hold rows[i] rows starting at key hash first_hash[i]; picks the rows whose key hash is
 * in hashes[0..nh) (ascending), or every row when nh < 0. Returns DBSP_GDEC_*; on any return the caller calls
 * dbsp_gdec_free. */
int dbsp_gdec_scan(DbspGDec *d, int64_t ng, const int64_t *slot_of, const int64_t *nslots, const int64_t *msg_len,
                   const int64_t *rows, const uint64_t *first_hash, const uint64_t *hashes, int64_t nh);

/* Gathers the picked rows: per column c, valid[c] ((nrows + 7) / 8 bytes, zeroed, or NULL when nulls[c] == 0),
 * data[c] (fixed: nrows * width; bool: (nrows + 7) / 8 zeroed; var: (nrows + 1) offsets of 4 or 8 bytes) and for
 * var columns vals[c] (var_bytes[c] bytes). */
void dbsp_gdec_fill(DbspGDec *d, uint8_t **valid, uint8_t **data, uint8_t **vals);

/* A whole lookup in one call: the probed key hashes hashes[0..m) (any order, repeats allowed) tested against the
 * batch's blocked Bloom filter bloom[0..nwords) (k bits a hash; spillread.h's dbsp_bloom_probe), those it may hold
 * sorted and made unique, each one's group found (the last of the ngroups whose first_hash is not above it:
 * invariant G3; a hash below the first group's is in none), and those groups (ascending, each once) read, checked
 * and scanned as dbsp_gdec_scan does, for those hashes. The group arrays are the file's, one entry a group (rows:
 * the group's row count). d->groups_read is the groups read; on a failure d->bad_group is the FILE's group number
 * (not a position). Returns DBSP_GDEC_*; the caller calls dbsp_gdec_fill on OK and dbsp_gdec_free always. */
int dbsp_gdec_lookup(DbspGDec *d, const uint64_t *bloom, int64_t nwords, int k, int64_t ngroups,
                     const uint64_t *first_hash, const int64_t *slot_of, const int64_t *nslots,
                     const int64_t *msg_len, const int64_t *rows, const uint64_t *hashes, int64_t m);

void dbsp_gdec_free(DbspGDec *d);

/* The most bytes a thread keeps of its reads' buffer between calls (32 MiB at first; a memory budget lowers it:
 * dbsp_core/trace/spill.py); returns the previous limit. A thread's buffer above it is freed at its next call. */
size_t dbsp_gdec_keep_limit(size_t limit);

#endif
