/* steplog.h: the durable step log: segmented, CRC32C-framed records (step, handle, producer, seq, payload) with group commit. */
#ifndef DBSP_STEPLOG_H
#define DBSP_STEPLOG_H

#include <stddef.h>
#include <stdint.h>

#include "vfs.h"

typedef struct DbspStepLog DbspStepLog;

#define DBSP_STEPLOG_FORMAT 2u     /* the format this build writes */
#define DBSP_STEPLOG_FORMAT_MIN 1u /* the oldest format it reads (and appends to, in a new segment) */
#define DBSP_STEPLOG_MAX_PAYLOAD (1u << 30)
#define DBSP_STEPLOG_BODY_HEADER 24u

/* Open flags. */
enum {
    DBSP_STEPLOG_READONLY = 1,   /* never create, write, truncate or remove a file; see records as the writer adds them */
    DBSP_STEPLOG_NO_LOG_FILE = 2 /* the directory has no LOG header file (the segment headers carry the format) */
};

/* One part of a gathered payload. */
typedef struct {
    const void *data;
    size_t len;
} DbspSlice;

/* What dbsp_steplog_segments reports of one segment. */
typedef struct {
    uint64_t num;
    uint32_t format;
    uint64_t bytes;                /* header and valid records */
    uint64_t records;
    uint64_t steps;                /* distinct steps */
    int64_t first_step, last_step; /* meaningful when records > 0 */
} DbspStepLogSegment;

/* Opens the log directory. A writer takes an exclusive flock(2) on the directory first (DBSP_EBUSY if another
 * writer has the log open, steplog.c invariant 9), creates it if missing and recovers: it scans every segment, fails with
 * DBSP_ECORRUPT (changing nothing) on damage, cuts a torn tail of the last segment, and fsyncs that segment.
 * A reader (DBSP_STEPLOG_READONLY) needs the directory to exist and never changes a file: it shows the valid
 * records and ignores a torn or half-written tail. segment_bytes is the size after which a new segment starts
 * (0 = 64 MiB). */
int dbsp_steplog_open(const char *dir, DbspVfs *vfs, uint64_t segment_bytes, int flags, DbspStepLog **out);
/* Closes the log without syncing what was enqueued; no call may be running. */
void dbsp_steplog_close(DbspStepLog *log);

/* A reader: shows records and segments the writer added since the last scan and forgets segments its
 * truncation removed. A writer: does nothing (its view is always current). */
int dbsp_steplog_refresh(DbspStepLog *log);

/* Appends one record and returns once it is durable (fsynced); concurrent callers share fsyncs (group commit).
 * Steps must not decrease. After a failed write or fsync the log refuses appends until reopened. */
int dbsp_steplog_append(DbspStepLog *log, int64_t step, const void *handle, size_t hlen, const void *producer,
                        size_t plen, uint64_t seq, const void *payload, size_t len);

/* Copies one record into the group-commit buffer (in log order) without writing it; *ticket names it for
 * dbsp_steplog_write and dbsp_steplog_sync. */
int dbsp_steplog_enqueue(DbspStepLog *log, int64_t step, const void *handle, size_t hlen, const void *producer,
                         size_t plen, uint64_t seq, const void *payload, size_t len, uint64_t *ticket);
/* dbsp_steplog_enqueue of a payload given as `nparts` slices (gathered into the buffer, never joined first). */
int dbsp_steplog_enqueuev(DbspStepLog *log, int64_t step, const void *handle, size_t hlen, const void *producer,
                          size_t plen, uint64_t seq, const DbspSlice *parts, size_t nparts, uint64_t *ticket);
/* Returns once every record up to `ticket` is written to its segment (visible to readers, here and in other
 * processes) without waiting for an fsync: a crash may still lose it. */
int dbsp_steplog_write(DbspStepLog *log, uint64_t ticket);
/* Returns once every record up to `ticket` is durable (writing and fsyncing if no other caller is); concurrent
 * callers share fsyncs. Fails (and the log refuses appends) after a failed write or fsync. */
int dbsp_steplog_sync(DbspStepLog *log, uint64_t ticket);

/* Reads visible records with from_step <= step <= to_step, as concatenated frames "u32 body length, body" into
 * a malloc'd *out (free it with free()). Stops after about max_bytes (never before one record); *resume_seg and
 * *resume_off (0, 0 to start) say where to continue; *resume_seg is 0 when done. */
int dbsp_steplog_read(DbspStepLog *log, int64_t from_step, int64_t to_step, size_t max_bytes, uint64_t *resume_seg,
                      uint64_t *resume_off, unsigned char **out, size_t *outlen);

/* Makes every enqueued record durable, then drops every whole segment (other than the active one and the one
 * holding the newest record) whose records all have step < step. */
int dbsp_steplog_truncate_below(DbspStepLog *log, int64_t step, uint64_t *segments_dropped);

/* Smallest and largest step held (*has = 0 if the log is empty), number of records and segments, fsyncs. */
int dbsp_steplog_info(DbspStepLog *log, int *has, int64_t *first_step, int64_t *last_step, uint64_t *records,
                      uint64_t *segments, uint64_t *fsyncs);

/* Describes up to `cap` segments, oldest first; *count is the number of segments. */
int dbsp_steplog_segments(DbspStepLog *log, DbspStepLogSegment *out, size_t cap, size_t *count);

#endif
