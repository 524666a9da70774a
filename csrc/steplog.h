/* steplog.h: the durable input log: segmented, CRC32C-framed records (step, handle, producer, seq, payload) with group commit. */
#ifndef DBSP_STEPLOG_H
#define DBSP_STEPLOG_H

#include <stddef.h>
#include <stdint.h>

#include "vfs.h"

typedef struct DbspStepLog DbspStepLog;

#define DBSP_STEPLOG_FORMAT 1u
#define DBSP_STEPLOG_MAX_PAYLOAD (1u << 30)
#define DBSP_STEPLOG_BODY_HEADER 24u

/* Opens (creating if missing) the log directory; recovers by scanning every segment and truncating a torn tail
 * of the last one. segment_bytes is the size after which a new segment starts (0 = 64 MiB). */
int dbsp_steplog_open(const char *dir, DbspVfs *vfs, uint64_t segment_bytes, DbspStepLog **out);
/* Closes the log; no append may be running. */
void dbsp_steplog_close(DbspStepLog *log);

/* Appends one record and returns once it is durable (fsynced); concurrent callers share fsyncs (group commit).
 * Steps must not decrease. After a failed write or fsync the log refuses appends until reopened. */
int dbsp_steplog_append(DbspStepLog *log, int64_t step, const void *handle, size_t hlen, const void *producer,
                        size_t plen, uint64_t seq, const void *payload, size_t len);

/* Copies one record into the group-commit buffer (in log order) without writing it; *ticket names it for
 * dbsp_steplog_sync. The record is durable only once a sync covering its ticket returned DBSP_OK. */
int dbsp_steplog_enqueue(DbspStepLog *log, int64_t step, const void *handle, size_t hlen, const void *producer,
                         size_t plen, uint64_t seq, const void *payload, size_t len, uint64_t *ticket);
/* Returns once every record up to `ticket` is durable (writing and fsyncing the buffer if no other caller is);
 * concurrent callers share fsyncs. Fails (and the log refuses appends) after a failed write or fsync. */
int dbsp_steplog_sync(DbspStepLog *log, uint64_t ticket);

/* Reads durable records with from_step <= step <= to_step, as concatenated frames "u32 body length, body" into a
 * malloc'd *out (free it with free()). Stops after about max_bytes (never before one record); *resume_seg and
 * *resume_off (0, 0 to start) say where to continue; *resume_seg is 0 when done. */
int dbsp_steplog_read(DbspStepLog *log, int64_t from_step, int64_t to_step, size_t max_bytes, uint64_t *resume_seg,
                      uint64_t *resume_off, unsigned char **out, size_t *outlen);

/* Drops every whole segment (other than the active one) whose records all have step < step. */
int dbsp_steplog_truncate_below(DbspStepLog *log, int64_t step, uint64_t *segments_dropped);

/* Smallest and largest step held (INT64_MIN/-1 style: *has = 0 if the log is empty), number of records and segments. */
int dbsp_steplog_info(DbspStepLog *log, int *has, int64_t *first_step, int64_t *last_step, uint64_t *records,
                      uint64_t *segments, uint64_t *fsyncs);

#endif
