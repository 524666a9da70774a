/* steplog.c: the append-only, segmented step log with group commit: the durable record of input (pushes and step divisions) and of output (dbsp_core/storage/outputlog.py).
 *
 * DESIGN NOTES
 * ============
 * Invariants:
 *  (1) every record covered by a sync that returned DBSP_OK was fsynced before that sync returned;
 *  (2) steps never decrease along the log (across records and segments);
 *  (3) only the last segment is ever written; a segment is sealed (never written again) once a later one exists,
 *      and every byte of a sealed segment was fsynced before the next segment was created;
 *  (4) segment numbers are consecutive; truncation first makes every enqueued record durable (so it never
 *      removes a durable record while the later records that replace it could still be lost), then removes
 *      segments from the front only, never the last segment nor the one holding the newest record (so a log
 *      that held a record always knows its last step);
 *  (5) every format-2 record carries a mark M: a length of its segment that had been fsynced when the write
 *      carrying the record was issued (32 <= M <= the record's offset; records of one write share M, and marks
 *      never decrease along a segment). A writer fsyncs the last segment when it opens the log, so the length
 *      it recovers counts as fsynced. An unsynced write therefore never vouches for another unsynced write,
 *      whatever order a crash persists them in;
 *  (6) recovery accepts a prefix of valid records per segment. An invalid record at offset B is DAMAGE when it
 *      lies in a sealed segment, or when a valid format-2 record after it has a mark M > B (B's bytes had been
 *      fsynced before that record was written): open fails with DBSP_ECORRUPT naming the file and B and changes
 *      no file. Otherwise B starts a TORN TAIL (unsynced writes a crash dropped, tore or reordered), which a
 *      writer cuts off (and fsyncs) and a reader ignores. A segment header that fails its check is damage when
 *      a valid record follows it, else (last segment only) a crash while the segment was created.
 *      Limits: a record damaged in the newest write has no later write to vouch for it and is cut like a torn
 *      tail; format-1 segments carry no marks, so in the last one every invalid record starts a torn tail;
 *  (7) a reader (DBSP_STEPLOG_READONLY) never creates, writes, truncates or removes a file; it shows a record
 *      only once the record is complete and valid; refresh adds what the writer appended and forgets segments
 *      its truncation removed (a file it already opened stays readable until then). An invalid record in the
 *      last segment may be one the writer is writing: the reader stops before it and reads on at the next
 *      refresh; it reads a file once more before it reports damage (or a gap in the segment numbers, which
 *      truncation can show while it runs);
 *  (8) the log writes format 2 and reads formats 1 and 2. It appends to a format-1 directory by starting a new
 *      segment of format 2, after rewriting LOG to say 2 (so a format-1 build refuses the directory instead of
 *      misreading it); a format-1 segment never follows a format-2 one;
 *  (9) one writer at a time: a writer takes an exclusive flock(2) on the log's directory (creating no file)
 *      before it reads or repairs anything, without waiting; a second writer (in this process or another)
 *      fails with DBSP_EBUSY and changes nothing. Readers take no lock (invariant 7 lets them run beside it);
 * (10) a clean close marks the log's end: a writer whose every record is durable writes LOG again with a close
 *      mark, the newest segment's number and length. Nothing vouches for the newest write otherwise (invariant
 *      6), so a cut of a log closed cleanly is damage, not a torn tail: that segment shorter than the marked
 *      length, an invalid record before it, or that segment missing fails the open with DBSP_ECORRUPT and
 *      changes nothing. A writer removes the mark (rewriting LOG, durably) once its open succeeded, before it
 *      writes anything, so a later crash's torn tail is cut as before. A log whose newest segment is past the
 *      marked one was appended to by a build that does not know close marks; the mark is then ignored;
 * (11) a log holds at most OPEN_SEALED + 1 segment files open, whatever its number of segments: the last segment
 *      stays open (the writer appends to it; a reader reads it as it grows) and sealed segments are opened when
 *      read, in a small cache (least recently used closed first; a file a read is using is pinned and never
 *      closed under it). So a log of any length opens under any descriptor limit. A reader opens a sealed
 *      segment read-only when it first reads it; if the writer's truncation removed it since the reader's last
 *      refresh, that read fails with ENOENT (never a silent skip), and a refresh forgets the segment.
 *
 * On-disk format (little-endian)
 * ------------------------------
 * <dir>/LOG (32 bytes; absent with DBSP_STEPLOG_NO_LOG_FILE): "DBSPSLOG" | u32 format (1 or 2: the newest
 *   segment format the directory may hold) | 16 zero bytes | u32 reserved | u32 CRC32C of bytes 0..27; after a
 *   clean close 32 more bytes, the close mark (invariant 10): "DBSPCLSD" | u64 segment | u64 length | u32 zero |
 *   u32 CRC32C of the mark's bytes 0..27.
 * <dir>/<20-digit segment number>.seg: a 32-byte header "DBSPSSEG" | u32 format (1 or 2) | u32 header length
 *   (32) | u64 segment number | u32 zero | u32 CRC32C of bytes 0..27, then records of that format back to back.
 * Format-2 record: a 24-byte frame header "DSLR" | u32 body length L | u64 mark M (invariant 5) | u32 CRC32C of
 *   the body | u32 CRC32C of frame header bytes 0..19, then the body.
 * Format-1 record: u32 body length L | u32 CRC32C over the 4 length bytes and the body | body.
 * Body (both formats; 24 <= L <= 24 + 2*65535 + 1 GiB): i64 step | u64 seq | u16 handle length | u16 producer
 *   length | u32 zero | handle | producer | payload.
 * Validity rule of a record: the whole frame lies inside the file, L is in range, the checksums match, handle
 * and producer lengths fit in L, the step is >= the previous record's, and (format 2) the magic matches and
 * 32 <= M <= the record's offset.
 *
 * Group commit: appenders copy their frame into a shared buffer under `mu` and take a ticket; the first waiter
 * without a write in flight becomes the leader, takes the whole buffer, stamps every frame's mark, writes it
 * with one pwrite, fsyncs once (for a sync) and wakes every caller whose records it covered. `append` is
 * `enqueue` then `sync(ticket)`; `write(ticket)` is a sync without the fsync (write-behind: the records become
 * visible to readers now and durable at a later sync). A record is visible to readers (dbsp_steplog_read, and
 * readers in other processes) once a write or sync covering it returned.
 */
#include "steplog.h"

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "crc32c.h"
#include "le.h"

#define SEG_HDR 32u
#define LOG_HDR 32u
#define BODY_HDR DBSP_STEPLOG_BODY_HEADER
#define MAX_BODY (BODY_HDR + 2u * 65535u + DBSP_STEPLOG_MAX_PAYLOAD)
#define F1_HDR 8u  /* format-1 frame header */
#define F2_HDR 24u /* format-2 frame header */
#define OPEN_SEALED 16 /* sealed segments' files a log keeps open at most (invariant 11) */

static const unsigned char REC_MAGIC[4] = {'D', 'S', 'L', 'R'};

typedef struct {
    int64_t step;
    uint64_t off;
} StepStart; /* where the first record of a step starts in its segment */

typedef struct {
    uint64_t num;
    DbspFile *f;      /* the last segment's is always open; a sealed one's only while cached (invariant 11) */
    uint32_t pins;    /* reads using f now (guarded by fd_mu) */
    uint64_t used;    /* fd_mu's clock at the last pin: the cache closes the least recently used */
    uint32_t format;  /* 0: a reader has not seen a valid header yet (the writer is creating the segment) */
    uint64_t size;    /* end of the valid records: what readers see (0 until the header was read) */
    uint64_t synced;  /* writer: bytes known to be fsynced (<= size) */
    int64_t min_step, max_step;
    uint64_t records;
    StepStart *idx;   /* one entry per distinct step, in log order: reads seek by step */
    size_t nidx, idxcap;
} Seg;

struct DbspStepLog {
    DbspVfs *vfs;
    char *dir;
    uint64_t seg_bytes;
    int flags;
    uint32_t log_format;       /* the format LOG names (0 if there is none) */
    uint64_t closed_seg, closed_size; /* LOG's close mark (invariant 10): the newest segment and its length at a
                                         clean close; closed_seg 0 = no mark */
    pthread_rwlock_t seg_lock; /* guards segs (readers: read, info; writers: leader updates, truncate, refresh) */
    Seg *segs;
    size_t nsegs, segcap;
    pthread_mutex_t mu;        /* guards everything below */
    pthread_cond_t cv;
    unsigned char *buf, *spare;
    size_t blen, bcap, spare_cap;
    uint64_t next_ticket, written_ticket, durable_ticket, fsyncs;
    int syncing, failed, fail_status, fail_errno;
    char fail_msg[400];
    int has_last;
    int64_t last_step;
    int lockfd;                /* a writer's flock(2) on the directory (invariant 9), -1 for a reader */
    pthread_mutex_t fd_mu;     /* guards the cache of sealed segments' files (invariant 11) and Seg.f, pins, used of
                                  sealed segments; taken inside seg_lock */
    uint64_t *open_nums;       /* the sealed segments whose file is open: OPEN_SEALED at most but while every one
                                  of them is pinned */
    size_t nopen, opencap;
    uint64_t fd_clock;
    int opened;                /* the open succeeded (a failed open's cleanup writes no close mark) */
};

static int oom(void) { return dbsp_storage_fail(DBSP_ENOMEM, ENOMEM, "steplog: out of memory"); }

static int readonly(const DbspStepLog *log) { return (log->flags & DBSP_STEPLOG_READONLY) != 0; }

static int refuse_readonly(const DbspStepLog *log, const char *what) {
    return dbsp_storage_fail(DBSP_EINVAL, 0, "steplog %s: opened read-only, cannot %s", log->dir, what);
}

static char *seg_path(const DbspStepLog *log, uint64_t num) {
    char name[32];
    snprintf(name, sizeof name, "%020llu.seg", (unsigned long long)num);
    return dbsp_path_join(log->dir, name);
}

static void encode_header(unsigned char *h, const char *magic, uint32_t format, uint64_t num) {
    memset(h, 0, 32);
    memcpy(h, magic, 8);
    wr32(h + 8, format);
    wr32(h + 12, 32);
    wr64(h + 16, num);
    wr32(h + 28, dbsp_crc32c(0, h, 28));
}

/* 0 valid (*format set), else a status (ECORRUPT / EFORMAT) with the message set. */
static int check_header(const unsigned char *h, const char *magic, uint64_t num, const char *path, uint32_t *format) {
    if (memcmp(h, magic, 8) != 0 || rd32(h + 28) != dbsp_crc32c(0, h, 28))
        return dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: header magic or checksum is wrong", path);
    uint32_t v = rd32(h + 8);
    if (v < DBSP_STEPLOG_FORMAT_MIN || v > DBSP_STEPLOG_FORMAT)
        return dbsp_storage_fail(DBSP_EFORMAT, 0, "steplog %s: format version %u, this build reads %u..%u", path, v,
                                 DBSP_STEPLOG_FORMAT_MIN, DBSP_STEPLOG_FORMAT);
    if (rd32(h + 12) != 32 || rd64(h + 16) != num)
        return dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: header names segment %llu", path,
                                 (unsigned long long)rd64(h + 16));
    *format = v;
    return DBSP_OK;
}

static void seg_forget(Seg *s) {
    free(s->idx);
    s->idx = NULL;
    s->nidx = s->idxcap = 0;
    s->size = s->synced = 0;
    s->records = 0;
    s->min_step = 0;
    s->max_step = -1;
    s->format = 0;
}

/* ---------- segment files (invariant 11) ---------- */

/* Drops segment `num` from the cache's list if it is there. Caller holds fd_mu (or owns the log). */
static void cache_remove(DbspStepLog *log, uint64_t num) {
    for (size_t k = 0; k < log->nopen; k++)
        if (log->open_nums[k] == num) {
            log->open_nums[k] = log->open_nums[--log->nopen];
            return;
        }
}

static Seg *seg_of(DbspStepLog *log, uint64_t num) { /* invariant 4: numbers are consecutive */
    if (!log->nsegs || num < log->segs[0].num || num > log->segs[log->nsegs - 1].num) return NULL;
    return &log->segs[num - log->segs[0].num];
}

/* Makes room for one more sealed file in the cache's list: closes the least recently used unpinned file while
 * OPEN_SEALED are open (if every one is pinned by a read, the list runs over until a read ends). Caller holds fd_mu
 * and a seg_lock. */
static int cache_make_room(DbspStepLog *log) {
    while (log->nopen >= OPEN_SEALED) {
        size_t victim = SIZE_MAX;
        uint64_t oldest = UINT64_MAX;
        for (size_t k = 0; k < log->nopen; k++) {
            Seg *s = seg_of(log, log->open_nums[k]);
            if (s && !s->pins && s->used < oldest) { oldest = s->used; victim = k; }
        }
        if (victim == SIZE_MAX) break;
        Seg *s = seg_of(log, log->open_nums[victim]);
        log->vfs->close(s->f);
        s->f = NULL;
        log->open_nums[victim] = log->open_nums[--log->nopen];
    }
    if (log->nopen == log->opencap) {
        size_t cap = log->opencap ? log->opencap * 2 : OPEN_SEALED;
        uint64_t *n = realloc(log->open_nums, cap * sizeof *n);
        if (!n) return oom();
        log->open_nums = n;
        log->opencap = cap;
    }
    return DBSP_OK;
}

/* The segment before the last one was just sealed (a new last segment was pushed): its open file joins the cache
 * (or is closed if the list cannot grow). Caller holds seg_lock for writing (or owns the log). */
static void seal_previous(DbspStepLog *log) {
    if (log->nsegs < 2) return;
    Seg *s = &log->segs[log->nsegs - 2];
    if (!s->f) return;
    pthread_mutex_lock(&log->fd_mu);
    if (cache_make_room(log)) {
        log->vfs->close(s->f); /* out of memory: it is opened again when read */
        s->f = NULL;
    } else {
        log->open_nums[log->nopen++] = s->num;
        s->used = ++log->fd_clock;
    }
    pthread_mutex_unlock(&log->fd_mu);
}

/* The open file of segment s for a read, pinned until seg_unpin (the last segment's file is always open and is
 * not pinned). Opens a sealed segment's file read-only if it is not cached. Caller holds seg_lock. */
static int seg_pin(DbspStepLog *log, Seg *s, DbspFile **f) {
    if (s == &log->segs[log->nsegs - 1]) { *f = s->f; return DBSP_OK; }
    int rc = DBSP_OK;
    pthread_mutex_lock(&log->fd_mu);
    if (!s->f) {
        char *path = seg_path(log, s->num);
        if (!path) { rc = oom(); goto out; }
        rc = log->vfs->open(log->vfs, path, DBSP_VFS_READONLY, &s->f);
        if (rc == DBSP_ENOTFOUND)
            rc = readonly(log) ? dbsp_storage_fail(DBSP_EIO, ENOENT, "steplog %s: segment %llu was removed by the "
                                                   "writer's truncation after this reader's last refresh; refresh and "
                                                   "read from the log's first step", log->dir,
                                                   (unsigned long long)s->num)
                               : dbsp_storage_fail(DBSP_ECORRUPT, ENOENT, "steplog %s: sealed segment %llu is missing",
                                                   path, (unsigned long long)s->num);
        free(path);
        if (!rc && (rc = cache_make_room(log))) log->vfs->close(s->f);
        if (rc) { s->f = NULL; goto out; }
        log->open_nums[log->nopen++] = s->num;
    }
    s->pins++;
    s->used = ++log->fd_clock;
    *f = s->f;
out:
    pthread_mutex_unlock(&log->fd_mu);
    return rc;
}

static void seg_unpin(DbspStepLog *log, Seg *s) {
    if (s == &log->segs[log->nsegs - 1]) return;
    pthread_mutex_lock(&log->fd_mu);
    s->pins--;
    pthread_mutex_unlock(&log->fd_mu);
}

/* Closes s's file (if open) and forgets what was read of it. Caller holds seg_lock for writing (or owns the log). */
static void seg_free(DbspStepLog *log, Seg *s) {
    if (s->f) {
        pthread_mutex_lock(&log->fd_mu);
        cache_remove(log, s->num);
        pthread_mutex_unlock(&log->fd_mu);
        log->vfs->close(s->f);
    }
    s->f = NULL;
    seg_forget(s);
}

/* Adds the record of `step` starting at `off` to the segment's counts and step index. */
static int seg_add(Seg *s, int64_t step, uint64_t off) {
    if (!s->records || step != s->max_step) {
        if (s->nidx == s->idxcap) {
            size_t cap = s->idxcap ? s->idxcap * 2 : 64;
            StepStart *n = realloc(s->idx, cap * sizeof *n);
            if (!n) return oom();
            s->idx = n;
            s->idxcap = cap;
        }
        s->idx[s->nidx++] = (StepStart){step, off};
    }
    if (!s->records) s->min_step = step;
    s->max_step = step;
    s->records++;
    return DBSP_OK;
}

static int segs_push(DbspStepLog *log, Seg s) {
    if (log->nsegs == log->segcap) {
        size_t cap = log->segcap ? log->segcap * 2 : 8;
        Seg *n = realloc(log->segs, cap * sizeof *n);
        if (!n) return oom();
        log->segs = n;
        log->segcap = cap;
    }
    log->segs[log->nsegs++] = s;
    return DBSP_OK;
}

#ifdef DBSP_CHECK_INVARIANTS
#include <assert.h>
/* Debug checker of invariants 2, 3 (formats, sizes), 4 (numbering) and the step index; caller holds seg_lock. */
static int check_invariants(const DbspStepLog *log) {
    int64_t prev = INT64_MIN;
    uint32_t fmt = 0;
    for (size_t i = 0; i < log->nsegs; i++) {
        const Seg *s = &log->segs[i];
        if (i && s->num != log->segs[i - 1].num + 1) return 0;
        if (s->format) {
            if (s->format < fmt || s->size < SEG_HDR) return 0;
            fmt = s->format;
        } else if (!readonly(log) || s->size || s->records || i + 1 != log->nsegs) {
            return 0;
        }
        if (!readonly(log) && s->synced > s->size) return 0;
        if ((s->records == 0) != (s->nidx == 0)) return 0;
        for (size_t k = 0; k < s->nidx; k++) {
            if (s->idx[k].step < prev || (k && s->idx[k].step == prev) || s->idx[k].off < SEG_HDR ||
                s->idx[k].off >= s->size)
                return 0;
            prev = s->idx[k].step;
        }
        if (s->records && (s->idx[0].step != s->min_step || s->idx[s->nidx - 1].step != s->max_step)) return 0;
    }
    size_t open = 0; /* invariant 11: the last segment's file is open, the open sealed ones are the cache's list */
    for (size_t i = 0; i + 1 < log->nsegs; i++) open += log->segs[i].f != NULL;
    if (open != log->nopen || (log->nsegs && !log->segs[log->nsegs - 1].f)) return 0;
    for (size_t k = 0; k < log->nopen; k++)
        if (log->open_nums[k] < log->segs[0].num || log->open_nums[k] >= log->segs[log->nsegs - 1].num ||
            !log->segs[log->open_nums[k] - log->segs[0].num].f)
            return 0;
    return 1;
}
#define CHECK_INVARIANTS(log) assert(check_invariants(log))
#else
#define CHECK_INVARIANTS(log) ((void)0)
#endif

/* ---------- record frames ---------- */

/* A format-2 frame header at b (offset `off` of its segment, `avail` bytes readable): 1 and the body length and
 * mark if magic, header checksum and ranges are right. */
static int f2_head_ok(const unsigned char *b, uint64_t avail, uint64_t off, uint32_t *blen, uint64_t *mark) {
    if (avail < F2_HDR || memcmp(b, REC_MAGIC, 4) != 0 || dbsp_crc32c(0, b, 20) != rd32(b + 20)) return 0;
    uint32_t len = rd32(b + 4);
    uint64_t m = rd64(b + 8);
    if (len < BODY_HDR || len > MAX_BODY || m < SEG_HDR || m > off) return 0;
    *blen = len;
    *mark = m;
    return 1;
}

/* Validates the record at b (offset `off`, `avail` bytes readable) but for the step order; returns its frame
 * length (and its step and mark, 0 for format 1), or 0 if it is not a valid record. */
static uint64_t frame_check(uint32_t format, const unsigned char *b, uint64_t avail, uint64_t off, int64_t *step,
                            uint64_t *mark) {
    const unsigned char *body;
    uint32_t len;
    uint64_t hdr;
    if (format == 1) {
        if (avail < F1_HDR) return 0;
        len = rd32(b);
        if (len < BODY_HDR || len > MAX_BODY || (uint64_t)len + F1_HDR > avail) return 0;
        if (dbsp_crc32c(dbsp_crc32c(0, b, 4), b + F1_HDR, len) != rd32(b + 4)) return 0;
        hdr = F1_HDR;
        *mark = 0;
    } else {
        if (!f2_head_ok(b, avail, off, &len, mark) || (uint64_t)len + F2_HDR > avail) return 0;
        if (dbsp_crc32c(0, b + F2_HDR, len) != rd32(b + 16)) return 0;
        hdr = F2_HDR;
    }
    body = b + hdr;
    if ((size_t)rd16(body + 16) + rd16(body + 18) > len - BODY_HDR) return 0;
    *step = (int64_t)rd64(body);
    return hdr + len;
}

/* The offset of the first valid format-2 record at or after `from` whose mark exceeds `above` (0 if none);
 * data holds the segment's bytes [base, end). Follows valid records and skips bytes to the next magic between. */
static uint64_t find_marked(const unsigned char *data, uint64_t base, uint64_t from, uint64_t end, uint64_t above) {
    uint64_t off = from;
    while (off + F2_HDR <= end) {
        const unsigned char *b = data + (off - base);
        int64_t step;
        uint64_t m, n = frame_check(2, b, end - off, off, &step, &m);
        if (n) {
            if (m > above) return off;
            off += n;
            continue;
        }
        const unsigned char *next = memchr(b + 1, REC_MAGIC[0], (size_t)(end - off - 1));
        if (!next) break;
        off += (uint64_t)(next - b);
    }
    return 0;
}

/* Invariant 6: the offset of a record proving that the invalid record at `bad` had been fsynced, or 0. */
static uint64_t find_proof(const unsigned char *data, uint64_t base, uint64_t bad, uint64_t end) {
    uint32_t len;
    uint64_t m, from = bad + 1;
    if (f2_head_ok(data + (bad - base), end - bad, bad, &len, &m)) { /* its length is trustworthy: skip it */
        if (bad + F2_HDR + len > end) return 0; /* it runs past the end of the file: nothing follows it */
        from = bad + F2_HDR + len;
    }
    return find_marked(data, base, from, end, bad);
}

/* Sets every frame's mark in a batch of format-2 frames and seals its header checksum. */
static void stamp_marks(unsigned char *data, size_t len, uint64_t mark) {
    for (size_t off = 0; off < len; off += F2_HDR + rd32(data + off + 4)) {
        wr64(data + off + 8, mark);
        wr32(data + off + 20, dbsp_crc32c(0, data + off, 20));
    }
}

/* ---------- files ---------- */

/* The close mark (invariant 10), 32 bytes after LOG's header: "DBSPCLSD" | u64 segment | u64 length | u32 zero |
 * u32 CRC32C of bytes 0..27. */
static void encode_close_mark(unsigned char *h, uint64_t seg, uint64_t size) {
    memset(h, 0, 32);
    memcpy(h, "DBSPCLSD", 8);
    wr64(h + 8, seg);
    wr64(h + 16, size);
    wr32(h + 28, dbsp_crc32c(0, h, 28));
}

/* Replaces LOG (durably): its header, and with mark_seg != 0 the close mark of invariant 10. */
static int write_log_file(DbspStepLog *log, uint32_t format, uint64_t mark_seg, uint64_t mark_size) {
    char *path = dbsp_path_join(log->dir, "LOG"), *tmp = dbsp_path_join(log->dir, "LOG.create");
    DbspFile *f = NULL;
    unsigned char h[2 * LOG_HDR];
    int rc;
    if (!path || !tmp) { rc = oom(); goto out; }
    encode_header(h, "DBSPSLOG", format, 0);
    if (mark_seg) encode_close_mark(h + LOG_HDR, mark_seg, mark_size);
    if ((rc = log->vfs->open(log->vfs, tmp, DBSP_VFS_CREATE, &f)) || (rc = log->vfs->truncate(f, 0)) ||
        (rc = log->vfs->pwrite(f, h, mark_seg ? 2 * LOG_HDR : LOG_HDR, 0)) || (rc = log->vfs->fsync(f)))
        goto out;
    log->vfs->close(f);
    f = NULL;
    if ((rc = log->vfs->rename(log->vfs, tmp, path)) || (rc = log->vfs->fsync_dir(log->vfs, log->dir))) goto out;
    log->log_format = format;
    log->closed_seg = mark_seg;
    log->closed_size = mark_size;
out:
    if (f) log->vfs->close(f);
    free(path);
    free(tmp);
    return rc;
}

/* Reads and checks LOG (a writer creates it when missing; a reader notes that there is none). */
static int open_log_file(DbspStepLog *log) {
    char *path = dbsp_path_join(log->dir, "LOG");
    DbspFile *f = NULL;
    unsigned char h[LOG_HDR];
    int rc;
    if (!path) return oom();
    rc = log->vfs->open(log->vfs, path, readonly(log) ? DBSP_VFS_READONLY : 0, &f);
    if (rc == DBSP_ENOTFOUND) {
        free(path);
        if (readonly(log)) { log->log_format = 0; return DBSP_OK; }
        return write_log_file(log, DBSP_STEPLOG_FORMAT, 0, 0);
    }
    if (!rc) rc = dbsp_vfs_read_exact(f, h, LOG_HDR, 0, "log header");
    if (!rc) rc = check_header(h, "DBSPSLOG", 0, path, &log->log_format);
    uint64_t fsize = 0;
    unsigned char mark[LOG_HDR];
    if (!rc && !(rc = log->vfs->size(f, &fsize)) && fsize >= 2 * LOG_HDR &&
        !(rc = dbsp_vfs_read_exact(f, mark, LOG_HDR, LOG_HDR, "log close mark"))) {
        if (memcmp(mark, "DBSPCLSD", 8) != 0 || rd32(mark + 28) != dbsp_crc32c(0, mark, 28) || !rd64(mark + 8))
            rc = dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: the close mark after the header is damaged", path);
        else { log->closed_seg = rd64(mark + 8); log->closed_size = rd64(mark + 16); }
    }
    if (f) log->vfs->close(f);
    free(path);
    return rc;
}

/* Creates segment `num` (format 2) with its header, durably (file and directory). */
static int seg_create(DbspStepLog *log, uint64_t num, Seg *out) {
    char *path = seg_path(log, num);
    if (!path) return oom();
    DbspFile *f = NULL;
    unsigned char h[SEG_HDR];
    encode_header(h, "DBSPSSEG", DBSP_STEPLOG_FORMAT, num);
    int rc = log->vfs->open(log->vfs, path, DBSP_VFS_CREATE, &f);
    if (!rc) rc = log->vfs->truncate(f, 0);
    if (!rc) rc = log->vfs->pwrite(f, h, SEG_HDR, 0);
    if (!rc) rc = log->vfs->fsync(f);
    if (!rc) rc = log->vfs->fsync_dir(log->vfs, log->dir);
    free(path);
    if (rc) { if (f) log->vfs->close(f); return rc; }
    *out = (Seg){.num = num, .f = f, .format = DBSP_STEPLOG_FORMAT, .size = SEG_HDR, .synced = SEG_HDR,
                 .min_step = 0, .max_step = -1};
    return DBSP_OK;
}

/* Brings segment s up to date with its file (invariant 6): checks the header if it was not read yet, then adds the
 * valid records after s->size. `floor` is the previous segment's last step (INT64_MIN if none). At an invalid
 * record: damage is an error; a writer cuts a torn tail of the last segment, a reader stops before it. */
/* A window [lo, hi) of a segment's bytes held in buf, so an open reads a segment in SCAN_CHUNK pieces into one
 * reused buffer instead of the whole file into fresh memory (a 64 MiB segment's page faults cost more than
 * reading and checking it). */
#define SCAN_CHUNK ((uint64_t)4 << 20)
typedef struct {
    unsigned char *buf;
    uint64_t cap, lo, hi;
} Window;

/* Makes the window hold [off, off + need) clipped to the file's `fsize` bytes. */
static int win_cover(Window *w, DbspFile *f, uint64_t off, uint64_t need, uint64_t fsize) {
    uint64_t end = need > fsize - off ? fsize : off + need;
    if (off >= w->lo && end <= w->hi) return DBSP_OK;
    uint64_t want = end - off < SCAN_CHUNK ? SCAN_CHUNK : end - off;
    if (want > fsize - off) want = fsize - off;
    if (want > w->cap) {
        unsigned char *nb = realloc(w->buf, (size_t)want + 1);
        if (!nb) return oom();
        w->buf = nb;
        w->cap = want;
    }
    w->lo = w->hi = 0;
    int rc = want ? dbsp_vfs_read_exact(f, w->buf, (size_t)want, off, "segment") : DBSP_OK;
    if (rc) return rc;
    w->lo = off;
    w->hi = off + want;
    return DBSP_OK;
}

/* The bytes [from, fsize) of a segment in fresh memory (the rare paths that look past a bad header or record). */
static int read_rest(DbspFile *f, uint64_t from, uint64_t fsize, unsigned char **out) {
    unsigned char *d = malloc((size_t)(fsize - from) + 1);
    if (!d) return oom();
    int rc = fsize > from ? dbsp_vfs_read_exact(f, d, (size_t)(fsize - from), from, "segment") : DBSP_OK;
    if (rc) { free(d); return rc; }
    *out = d;
    return DBSP_OK;
}

static int seg_load(DbspStepLog *log, Seg *s, int is_last, int64_t floor) {
    char *path = seg_path(log, s->num);
    unsigned char *data = NULL;
    Window w = {0};
    int rc = DBSP_OK, ro = readonly(log);
    if (!path) return oom();
    for (int attempt = 0;; attempt++) { /* a reader reads again once before it calls anything damage */
        uint64_t fsize;
        free(data);
        data = NULL;
        w.lo = w.hi = 0;
        if ((rc = log->vfs->size(s->f, &fsize))) goto out;
        if (s->num == log->closed_seg && fsize < log->closed_size) { /* invariant 10: a log closed cleanly was cut */
            rc = dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: %llu bytes, but the log was closed cleanly with "
                                   "%llu bytes in it: its end was cut (nothing was changed)", path,
                                   (unsigned long long)fsize, (unsigned long long)log->closed_size);
            goto out;
        }
        if (fsize < s->size) seg_forget(s); /* a reader: a writer rewrote the file after a crash; read it afresh */
        uint64_t base = s->size;
        if (base && fsize == base) goto out; /* nothing new (a file without a header still needs the check below) */
        if (base == 0) {
            uint32_t format = 0;
            int hrc;
            if (fsize >= SEG_HDR) {
                if ((rc = win_cover(&w, s->f, 0, SEG_HDR, fsize))) goto out;
                hrc = check_header(w.buf, "DBSPSSEG", s->num, path, &format);
            } else {
                hrc = dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: shorter than its header", path);
            }
            if (hrc == DBSP_EFORMAT) { rc = hrc; goto out; }
            if (hrc) {
                int64_t step;
                uint64_t m;
                if ((rc = read_rest(s->f, 0, fsize, &data))) goto out;
                int follows = fsize > SEG_HDR && (frame_check(1, data + SEG_HDR, fsize - SEG_HDR, SEG_HDR, &step, &m) ||
                                                  find_marked(data, 0, SEG_HDR, fsize, 0));
                if (follows || !is_last) {
                    if (ro && !attempt) continue;
                    rc = dbsp_storage_fail(DBSP_ECORRUPT, 0, follows ? "steplog %s: damaged segment header at offset 0 "
                                           "with valid records after it" : "steplog %s: invalid header at offset 0 of a "
                                           "sealed segment", path);
                    goto out;
                }
                if (ro) goto out; /* being created: empty for now */
                unsigned char h[SEG_HDR]; /* a crash while creating it: write the header again */
                encode_header(h, "DBSPSSEG", DBSP_STEPLOG_FORMAT, s->num);
                if ((rc = log->vfs->truncate(s->f, 0)) || (rc = log->vfs->pwrite(s->f, h, SEG_HDR, 0)) ||
                    (rc = log->vfs->fsync(s->f)))
                    goto out;
                s->format = DBSP_STEPLOG_FORMAT;
                s->size = s->synced = SEG_HDR;
                goto out;
            }
            s->format = format;
            s->size = SEG_HDR;
        }
        uint64_t off = s->size, hdr = s->format == 1 ? F1_HDR : F2_HDR;
        int64_t fl = s->records ? s->max_step : floor;
        while (off < fsize) {
            int64_t step;
            uint64_t m, need = hdr;
            if ((rc = win_cover(&w, s->f, off, hdr, fsize))) goto out;
            if (w.hi - off >= hdr) { /* the frame's claimed length, checked by frame_check below */
                uint32_t len = rd32(w.buf + (off - w.lo) + (s->format == 1 ? 0 : 4));
                if (len <= MAX_BODY) need += len;
            }
            if ((rc = win_cover(&w, s->f, off, need, fsize))) goto out;
            /* the window holds the whole claimed frame, or the file up to its end: the same check as on all of it */
            uint64_t n = frame_check(s->format, w.buf + (off - w.lo), w.hi - off, off, &step, &m);
            if (!n || step < fl) break;
            if ((rc = seg_add(s, step, off))) goto out;
            fl = step;
            off += n;
        }
        s->size = off;
        if (off == fsize) goto out;
        uint64_t proof = 0;
        if (is_last && s->format == 2) {
            if ((rc = read_rest(s->f, off, fsize, &data))) goto out;
            proof = find_proof(data, off, off, fsize);
        }
        int closed = !proof && s->num == log->closed_seg && off < log->closed_size; /* invariant 10 */
        if (proof || closed || !is_last) {
            if (ro && !attempt) continue;
            if (closed)
                rc = dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: damaged record at offset %llu, before the end "
                                       "the log had at its clean close (%llu bytes), so this is not a torn write "
                                       "(nothing was changed)", path, (unsigned long long)off,
                                       (unsigned long long)log->closed_size);
            else if (!is_last)
                rc = dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: invalid record at offset %llu of a sealed segment "
                                       "(nothing was changed)", path, (unsigned long long)off);
            else
                rc = dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: damaged record at offset %llu: the valid record at "
                                       "offset %llu was written after offset %llu had been fsynced, so this is not a "
                                       "torn write (nothing was changed)", path, (unsigned long long)off,
                                       (unsigned long long)proof, (unsigned long long)off);
            goto out;
        }
        if (!ro && ((rc = log->vfs->truncate(s->f, off)) || (rc = log->vfs->fsync(s->f)))) goto out; /* torn tail */
        goto out;
    }
out:
    free(data);
    free(w.buf);
    free(path);
    return rc;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* The segment numbers in the directory (names of exactly 20 digits and ".seg"), sorted. */
static int list_segments(DbspStepLog *log, uint64_t **out, size_t *count) {
    DIR *d = opendir(log->dir);
    if (!d) {
        if (errno == ENOENT) return dbsp_storage_fail(DBSP_ENOTFOUND, ENOENT, "steplog %s: no such directory", log->dir);
        return dbsp_storage_fail(DBSP_EIO, errno, "steplog opendir %s: %s", log->dir, strerror(errno));
    }
    uint64_t *nums = NULL;
    size_t n = 0, cap = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        const char *name = de->d_name;
        if (strlen(name) != 24 || strcmp(name + 20, ".seg") != 0 || strspn(name, "0123456789") != 20) continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 16;
            uint64_t *n2 = realloc(nums, cap * sizeof *n2);
            if (!n2) { closedir(d); free(nums); return oom(); }
            nums = n2;
        }
        nums[n++] = strtoull(name, NULL, 10);
    }
    closedir(d);
    if (n) qsort(nums, n, sizeof *nums, cmp_u64);
    *out = nums;
    *count = n;
    return DBSP_OK;
}

/* Brings segs up to date with the directory (open; a reader's refresh): forgets segments truncation removed from
 * the front, reads on from the valid end of the last known segment, opens and reads new ones. Caller holds
 * seg_lock for writing (or owns the log). */
static int rescan(DbspStepLog *log) {
    int rc = DBSP_OK, ro = readonly(log);
    uint64_t *nums = NULL;
    size_t nn = 0;
    for (int attempt = 0;; attempt++) {
        free(nums);
        nums = NULL;
        if ((rc = list_segments(log, &nums, &nn))) return rc;
        size_t gap = 0;
        for (size_t i = 1; i < nn && !gap; i++)
            if (nums[i] != nums[i - 1] + 1) gap = i;
        if (gap && ro && attempt < 20) { /* a reader may list while the writer drops segments: look again */
            nanosleep(&(struct timespec){0, 1000000}, NULL);
            continue;
        }
        if (gap) {
            rc = dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: segment %llu is missing", log->dir,
                                   (unsigned long long)(nums[gap - 1] + 1));
            goto out;
        }
        /* forget what truncation removed (from the front only, invariant 4) */
        size_t k = 0;
        while (k < log->nsegs && (!nn || log->segs[k].num < nums[0])) seg_free(log, &log->segs[k++]);
        if (k) {
            memmove(log->segs, log->segs + k, (log->nsegs - k) * sizeof *log->segs);
            log->nsegs -= k;
        }
        if (log->nsegs && (log->segs[0].num != nums[0] || log->segs[log->nsegs - 1].num > nums[nn - 1])) {
            rc = dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: segments %llu..%llu were seen, the directory now holds "
                                   "%llu..%llu", log->dir, (unsigned long long)log->segs[0].num,
                                   (unsigned long long)log->segs[log->nsegs - 1].num, (unsigned long long)nums[0],
                                   (unsigned long long)nums[nn - 1]);
            goto out;
        }
        int retry = 0;
        int64_t floor = INT64_MIN;
        uint32_t fmt = DBSP_STEPLOG_FORMAT_MIN;
        for (size_t i = 0; i < nn; i++) {
            if (i + 1 < log->nsegs) { /* already read while another segment followed it: sealed, complete */
                Seg *s = &log->segs[i];
                if (s->records) floor = s->max_step;
                fmt = s->format;
                continue;
            }
            if (i == log->nsegs) {
                char *path = seg_path(log, nums[i]);
                if (!path) { rc = oom(); goto out; }
                Seg s = {.num = nums[i], .min_step = 0, .max_step = -1};
                rc = log->vfs->open(log->vfs, path, ro ? DBSP_VFS_READONLY : 0, &s.f);
                free(path);
                if (rc == DBSP_ENOTFOUND && ro && attempt < 20) { retry = 1; rc = DBSP_OK; break; } /* dropped meanwhile */
                if (rc) goto out;
                if ((rc = segs_push(log, s))) { log->vfs->close(s.f); goto out; }
                seal_previous(log);
            }
            Seg *s = &log->segs[i];
            if ((rc = seg_load(log, s, i + 1 == nn, floor))) goto out;
            if (s->format && s->format < fmt) {
                rc = dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: segment %llu has format %u after format %u",
                                       log->dir, (unsigned long long)s->num, s->format, fmt);
                goto out;
            }
            if (!s->format && i + 1 < nn) {
                rc = dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: segment %llu has no valid header", log->dir,
                                       (unsigned long long)s->num);
                goto out;
            }
            if (s->format) fmt = s->format;
            if (s->records) floor = s->max_step;
        }
        if (!retry) break;
    }
    if (!rc && log->closed_seg && (!log->nsegs || log->segs[log->nsegs - 1].num < log->closed_seg))
        rc = dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: the log was closed cleanly with segment %llu as its "
                               "newest, which is missing (nothing was changed)", log->dir,
                               (unsigned long long)log->closed_seg);
out:
    free(nums);
    return rc;
}

int dbsp_steplog_open(const char *dir, DbspVfs *vfs, uint64_t segment_bytes, int flags, DbspStepLog **out) {
    DbspStepLog *log = calloc(1, sizeof *log);
    if (!log) return oom();
    log->vfs = vfs ? vfs : dbsp_vfs_posix();
    log->seg_bytes = segment_bytes ? segment_bytes : (64u << 20);
    log->flags = flags;
    log->lockfd = -1;
    pthread_rwlock_init(&log->seg_lock, NULL);
    pthread_mutex_init(&log->mu, NULL);
    pthread_mutex_init(&log->fd_mu, NULL);
    pthread_cond_init(&log->cv, NULL);
    int rc = DBSP_OK;
    if (!(log->dir = strdup(dir))) { rc = oom(); goto fail; }
    if (readonly(log)) {
        struct stat st;
        if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
            rc = dbsp_storage_fail(DBSP_ENOTFOUND, ENOENT, "steplog %s: no such directory", dir);
            goto fail;
        }
    } else if (mkdir(dir, 0755) == 0) {
        char *parent = dbsp_path_dirname(dir);
        rc = parent ? log->vfs->fsync_dir(log->vfs, parent) : oom();
        free(parent);
        if (rc) goto fail;
    } else if (errno != EEXIST) {
        rc = dbsp_storage_fail(dbsp_storage_status_of_errno(errno), errno, "steplog mkdir %s: %s", dir, strerror(errno));
        goto fail;
    }
    if (!readonly(log) && (rc = dbsp_dir_lock(dir, 1, "steplog", &log->lockfd))) goto fail; /* invariant 9 */
    if (!(flags & DBSP_STEPLOG_NO_LOG_FILE) && (rc = open_log_file(log))) goto fail;
    if ((rc = rescan(log))) goto fail;
    if (!readonly(log)) {
        if (!log->nsegs) {
            Seg s;
            if ((rc = seg_create(log, 1, &s))) goto fail;
            if ((rc = segs_push(log, s))) { log->vfs->close(s.f); goto fail; }
        }
        Seg *a = &log->segs[log->nsegs - 1]; /* invariant 5: what was recovered counts as fsynced from now on */
        if ((rc = log->vfs->fsync(a->f))) goto fail;
        if (log->closed_seg && (rc = write_log_file(log, log->log_format, 0, 0))) goto fail; /* invariant 10 */
        for (size_t i = 0; i < log->nsegs; i++) log->segs[i].synced = log->segs[i].size;
    }
    for (size_t i = log->nsegs; i-- > 0;)
        if (log->segs[i].records) {
            log->has_last = 1;
            log->last_step = log->segs[i].max_step;
            break;
        }
    CHECK_INVARIANTS(log);
    log->opened = 1;
    *out = log;
    return DBSP_OK;
fail:
    dbsp_steplog_close(log);
    return rc;
}

void dbsp_steplog_close(DbspStepLog *log) {
    if (!log) return;
    /* invariant 10: a writer whose every record is durable marks its end in LOG (best effort: no mark is what a
     * crash leaves) */
    if (log->opened && !readonly(log) && !(log->flags & DBSP_STEPLOG_NO_LOG_FILE) && !log->failed && !log->blen &&
        log->durable_ticket == log->next_ticket && log->nsegs &&
        log->segs[log->nsegs - 1].synced == log->segs[log->nsegs - 1].size && log->log_format == DBSP_STEPLOG_FORMAT)
        (void)write_log_file(log, log->log_format, log->segs[log->nsegs - 1].num, log->segs[log->nsegs - 1].size);
    for (size_t i = 0; i < log->nsegs; i++) seg_free(log, &log->segs[i]);
    free(log->segs);
    free(log->open_nums);
    free(log->buf);
    free(log->spare);
    free(log->dir);
    dbsp_dir_unlock(log->lockfd);
    pthread_rwlock_destroy(&log->seg_lock);
    pthread_mutex_destroy(&log->mu);
    pthread_mutex_destroy(&log->fd_mu);
    pthread_cond_destroy(&log->cv);
    free(log);
}

int dbsp_steplog_refresh(DbspStepLog *log) {
    if (!readonly(log)) return DBSP_OK;
    pthread_rwlock_wrlock(&log->seg_lock);
    int rc = rescan(log);
    CHECK_INVARIANTS(log);
    pthread_rwlock_unlock(&log->seg_lock);
    return rc;
}

/* ---------- group commit ---------- */

/* Leader: seals the active segment (fsyncing what is unsynced, invariant 3) and starts the next one in format 2
 * (rewriting LOG first if it names an older format, invariant 8). */
static int rotate(DbspStepLog *log, Seg *act) {
    int rc;
    if (act->synced < act->size) {
        if ((rc = log->vfs->fsync(act->f))) return rc;
        pthread_rwlock_wrlock(&log->seg_lock);
        log->segs[log->nsegs - 1].synced = act->size;
        pthread_rwlock_unlock(&log->seg_lock);
    }
    if (!(log->flags & DBSP_STEPLOG_NO_LOG_FILE) && log->log_format < DBSP_STEPLOG_FORMAT &&
        (rc = write_log_file(log, DBSP_STEPLOG_FORMAT, 0, 0)))
        return rc;
    Seg s;
    if ((rc = seg_create(log, act->num + 1, &s))) return rc;
    pthread_rwlock_wrlock(&log->seg_lock);
    if (!(rc = segs_push(log, s))) seal_previous(log);
    pthread_rwlock_unlock(&log->seg_lock);
    if (rc) { log->vfs->close(s.f); return rc; }
    *act = s;
    return DBSP_OK;
}

/* Leader: writes one batch of format-2 frames to the active segment (rotating first if it is full or older than
 * this format), stamped with the segment's fsynced length (invariant 5); with `durable`, fsyncs it. */
static int write_batch(DbspStepLog *log, unsigned char *data, size_t len, int durable) {
    /* only the leader changes the active segment; truncate_below may move the array, so copy under the lock */
    pthread_rwlock_rdlock(&log->seg_lock);
    Seg act = log->segs[log->nsegs - 1];
    pthread_rwlock_unlock(&log->seg_lock);
    int rc = DBSP_OK;
    if (len && (act.format != DBSP_STEPLOG_FORMAT || (act.size > SEG_HDR && act.size + len > log->seg_bytes)) &&
        (rc = rotate(log, &act)))
        return rc;
    if (len) {
        stamp_marks(data, len, act.synced);
        if ((rc = log->vfs->pwrite(act.f, data, len, act.size))) return rc;
    }
    uint64_t synced = act.synced;
    if (durable && synced < act.size + len) {
        if ((rc = log->vfs->fsync(act.f))) return rc;
        synced = act.size + len;
    }
    pthread_rwlock_wrlock(&log->seg_lock);
    Seg *a = &log->segs[log->nsegs - 1];
    for (size_t off = 0; off < len && !rc; off += F2_HDR + rd32(data + off + 4))
        rc = seg_add(a, (int64_t)rd64(data + off + F2_HDR), a->size + off);
    if (!rc) {
        a->size += len;
        a->synced = synced;
    }
    CHECK_INVARIANTS(log);
    pthread_rwlock_unlock(&log->seg_lock);
    return rc;
}

static int failed_status(DbspStepLog *log) {
    return dbsp_storage_fail(log->fail_status, log->fail_errno, "%s (the log must be reopened)", log->fail_msg);
}

int dbsp_steplog_enqueuev(DbspStepLog *log, int64_t step, const void *handle, size_t hlen, const void *producer,
                          size_t plen, uint64_t seq, const DbspSlice *parts, size_t nparts, uint64_t *ticket) {
    if (readonly(log)) return refuse_readonly(log, "append");
    size_t len = 0;
    for (size_t i = 0; i < nparts; i++) {
        len += parts[i].len;
        if (len > DBSP_STEPLOG_MAX_PAYLOAD) break;
    }
    if (hlen > 65535 || plen > 65535 || len > DBSP_STEPLOG_MAX_PAYLOAD)
        return dbsp_storage_fail(DBSP_ETOOBIG, 0, "steplog %s: record too large (handle %zu, producer %zu, payload %zu bytes)",
                                 log->dir, hlen, plen, len);
    size_t body = BODY_HDR + hlen + plen + len, frame = F2_HDR + body;
    unsigned char h[F2_HDR + BODY_HDR]; /* frame and body header; the body CRC is computed before locking */
    memset(h, 0, sizeof h);
    memcpy(h, REC_MAGIC, 4);
    wr32(h + 4, (uint32_t)body);
    unsigned char *bh = h + F2_HDR;
    wr64(bh, (uint64_t)step);
    wr64(bh + 8, seq);
    wr16(bh + 16, (uint16_t)hlen);
    wr16(bh + 18, (uint16_t)plen);
    uint32_t crc = dbsp_crc32c(0, bh, BODY_HDR);
    if (hlen) crc = dbsp_crc32c(crc, handle, hlen);
    if (plen) crc = dbsp_crc32c(crc, producer, plen);
    for (size_t i = 0; i < nparts; i++)
        if (parts[i].len) crc = dbsp_crc32c(crc, parts[i].data, parts[i].len);
    wr32(h + 16, crc); /* the mark and the header CRC are stamped by the leader that writes it */
    pthread_mutex_lock(&log->mu);
    if (log->failed) { int rc = failed_status(log); pthread_mutex_unlock(&log->mu); return rc; }
    if (log->has_last && step < log->last_step) {
        pthread_mutex_unlock(&log->mu);
        return dbsp_storage_fail(DBSP_EINVAL, 0, "steplog %s: step %lld is below the last logged step %lld", log->dir,
                                 (long long)step, (long long)log->last_step);
    }
    if (log->blen + frame > log->bcap) {
        size_t cap = log->bcap ? log->bcap : 65536;
        while (cap < log->blen + frame) cap *= 2;
        unsigned char *b = realloc(log->buf, cap);
        if (!b) { pthread_mutex_unlock(&log->mu); return oom(); }
        log->buf = b;
        log->bcap = cap;
    }
    unsigned char *b = log->buf + log->blen;
    memcpy(b, h, sizeof h);
    b += sizeof h;
    if (hlen) { memcpy(b, handle, hlen); b += hlen; }
    if (plen) { memcpy(b, producer, plen); b += plen; }
    for (size_t i = 0; i < nparts; i++)
        if (parts[i].len) { memcpy(b, parts[i].data, parts[i].len); b += parts[i].len; }
    log->blen += frame;
    log->has_last = 1;
    log->last_step = step;
    *ticket = ++log->next_ticket;
    pthread_mutex_unlock(&log->mu);
    return DBSP_OK;
}

int dbsp_steplog_enqueue(DbspStepLog *log, int64_t step, const void *handle, size_t hlen, const void *producer,
                         size_t plen, uint64_t seq, const void *payload, size_t len, uint64_t *ticket) {
    DbspSlice part = {payload, len};
    return dbsp_steplog_enqueuev(log, step, handle, hlen, producer, plen, seq, &part, 1, ticket);
}

/* Returns once every record up to `ticket` is written (and with `durable`, fsynced), leading a write if no other
 * caller is. */
static int flush_to(DbspStepLog *log, uint64_t ticket, int durable) {
    if (readonly(log)) return refuse_readonly(log, "write");
    int rc = DBSP_OK;
    pthread_mutex_lock(&log->mu);
    if (ticket > log->next_ticket) ticket = log->next_ticket;
    while ((durable ? log->durable_ticket : log->written_ticket) < ticket) {
        if (log->failed) { rc = failed_status(log); break; }
        if (log->syncing) { pthread_cond_wait(&log->cv, &log->mu); continue; }
        /* become the leader for everything buffered so far */
        log->syncing = 1;
        unsigned char *data = log->buf;
        size_t dlen = log->blen, dcap = log->bcap;
        uint64_t target = log->next_ticket;
        log->buf = log->spare;
        log->bcap = log->spare_cap;
        log->blen = 0;
        log->spare = NULL;
        log->spare_cap = 0;
        pthread_mutex_unlock(&log->mu);
        int wrc = write_batch(log, data, dlen, durable);
        pthread_mutex_lock(&log->mu);
        if (!log->spare) { log->spare = data; log->spare_cap = dcap; } else free(data);
        log->syncing = 0;
        if (durable) log->fsyncs++;
        if (wrc) {
            log->failed = 1;
            log->fail_status = wrc;
            log->fail_errno = dbsp_storage_errno();
            snprintf(log->fail_msg, sizeof log->fail_msg, "%s", dbsp_storage_errmsg());
        } else {
            log->written_ticket = target;
            if (durable) log->durable_ticket = target;
        }
        pthread_cond_broadcast(&log->cv);
    }
    pthread_mutex_unlock(&log->mu);
    return rc;
}

int dbsp_steplog_write(DbspStepLog *log, uint64_t ticket) { return flush_to(log, ticket, 0); }

int dbsp_steplog_sync(DbspStepLog *log, uint64_t ticket) { return flush_to(log, ticket, 1); }

int dbsp_steplog_append(DbspStepLog *log, int64_t step, const void *handle, size_t hlen, const void *producer,
                        size_t plen, uint64_t seq, const void *payload, size_t len) {
    uint64_t ticket = 0;
    int rc = dbsp_steplog_enqueue(log, step, handle, hlen, producer, plen, seq, payload, len, &ticket);
    return rc ? rc : dbsp_steplog_sync(log, ticket);
}

/* ---------- reads and retention ---------- */

/* The offset of the first record of segment s with step >= `step` (s->size if there is none). */
static uint64_t seek_step(const Seg *s, int64_t step) {
    size_t lo = 0, hi = s->nidx;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (s->idx[mid].step < step) lo = mid + 1; else hi = mid;
    }
    return lo < s->nidx ? s->idx[lo].off : s->size;
}

int dbsp_steplog_read(DbspStepLog *log, int64_t from_step, int64_t to_step, size_t max_bytes, uint64_t *resume_seg,
                      uint64_t *resume_off, unsigned char **out, size_t *outlen) {
    unsigned char *buf = NULL;
    size_t blen = 0, bcap = 0;
    int rc = DBSP_OK;
    pthread_rwlock_rdlock(&log->seg_lock);
    size_t i = 0;
    uint64_t off = SEG_HDR;
    if (*resume_seg) {
        while (i < log->nsegs && log->segs[i].num < *resume_seg) i++;
        if (i < log->nsegs && log->segs[i].num == *resume_seg) off = *resume_off;
    } else {
        while (i + 1 < log->nsegs && (!log->segs[i].records || log->segs[i].max_step < from_step)) i++;
        if (i < log->nsegs) off = seek_step(&log->segs[i], from_step);
    }
    *resume_seg = 0;
    Seg *pinned = NULL;
    DbspFile *f = NULL;
    for (; i < log->nsegs; i++, off = SEG_HDR) {
        Seg *s = &log->segs[i];
        if (s->records && s->min_step > to_step) break;
        if (off >= s->size) continue;
        uint64_t hdr = s->format == 1 ? F1_HDR : F2_HDR;
        if (pinned) seg_unpin(log, pinned);
        pinned = NULL;
        if ((rc = seg_pin(log, s, &f))) goto out;
        pinned = s;
        while (off < s->size) {
            unsigned char fh[F2_HDR];
            uint32_t len;
            uint64_t mark;
            int ok;
            if ((rc = dbsp_vfs_read_exact(f, fh, hdr, off, "record header"))) goto out;
            if (s->format == 1) {
                len = rd32(fh);
                ok = len >= BODY_HDR && len <= MAX_BODY;
            } else {
                ok = f2_head_ok(fh, hdr, off, &len, &mark);
            }
            if (!ok || off + hdr + len > s->size) {
                rc = dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: segment %llu: bad record header at offset %llu",
                                       log->dir, (unsigned long long)s->num, (unsigned long long)off);
                goto out;
            }
            if (blen + 4 + len > bcap) {
                size_t cap = bcap ? bcap : 65536;
                while (cap < blen + 4 + len) cap *= 2;
                unsigned char *nb = realloc(buf, cap);
                if (!nb) { rc = oom(); goto out; }
                buf = nb;
                bcap = cap;
            }
            unsigned char *body = buf + blen + 4;
            if ((rc = dbsp_vfs_read_exact(f, body, len, off + hdr, "record body"))) goto out;
            uint32_t crc = s->format == 1 ? dbsp_crc32c(dbsp_crc32c(0, fh, 4), body, len) : dbsp_crc32c(0, body, len);
            if (crc != rd32(fh + (s->format == 1 ? 4 : 16))) {
                rc = dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: segment %llu: checksum mismatch at offset %llu",
                                       log->dir, (unsigned long long)s->num, (unsigned long long)off);
                goto out;
            }
            off += hdr + len;
            int64_t step = (int64_t)rd64(body);
            if (step > to_step) goto out;
            if (step < from_step) continue;
            wr32(buf + blen, len);
            blen += 4 + len;
            if (blen >= max_bytes) {
                if (off < s->size) { *resume_seg = s->num; *resume_off = off; }
                else if (i + 1 < log->nsegs) { *resume_seg = log->segs[i + 1].num; *resume_off = SEG_HDR; }
                goto out;
            }
        }
    }
out:
    if (pinned) seg_unpin(log, pinned);
    pthread_rwlock_unlock(&log->seg_lock);
    if (rc) { free(buf); *resume_seg = 0; return rc; }
    *out = buf;
    *outlen = blen;
    return DBSP_OK;
}

int dbsp_steplog_truncate_below(DbspStepLog *log, int64_t step, uint64_t *dropped) {
    *dropped = 0;
    if (readonly(log)) return refuse_readonly(log, "truncate");
    int rc = dbsp_steplog_sync(log, UINT64_MAX); /* invariant 4 */
    if (rc) return rc;
    pthread_rwlock_wrlock(&log->seg_lock);
    size_t keep = log->nsegs - 1; /* invariant 4: never the active segment, nor the one holding the newest record */
    for (size_t i = log->nsegs; i-- > 0;)
        if (log->segs[i].records) { if (i < keep) keep = i; break; }
    size_t k = 0;
    while (k < keep && (!log->segs[k].records || log->segs[k].max_step < step)) {
        char *path = seg_path(log, log->segs[k].num);
        if (!path) { rc = oom(); break; }
        rc = log->vfs->unlink(log->vfs, path);
        free(path);
        if (rc) break;
        seg_free(log, &log->segs[k]);
        k++;
    }
    if (k) {
        memmove(log->segs, log->segs + k, (log->nsegs - k) * sizeof *log->segs);
        log->nsegs -= k;
        int drc = log->vfs->fsync_dir(log->vfs, log->dir);
        if (!rc) rc = drc;
    }
    CHECK_INVARIANTS(log);
    pthread_rwlock_unlock(&log->seg_lock);
    *dropped = k;
    return rc;
}

int dbsp_steplog_info(DbspStepLog *log, int *has, int64_t *first_step, int64_t *last_step, uint64_t *records,
                      uint64_t *segments, uint64_t *fsyncs) {
    pthread_rwlock_rdlock(&log->seg_lock);
    *has = 0;
    *records = 0;
    *first_step = *last_step = 0;
    for (size_t i = 0; i < log->nsegs; i++) {
        Seg *s = &log->segs[i];
        if (!s->records) continue;
        if (!*has) { *first_step = s->min_step; *has = 1; }
        *last_step = s->max_step;
        *records += s->records;
    }
    *segments = log->nsegs;
    pthread_rwlock_unlock(&log->seg_lock);
    pthread_mutex_lock(&log->mu);
    *fsyncs = log->fsyncs;
    pthread_mutex_unlock(&log->mu);
    return DBSP_OK;
}

int dbsp_steplog_segments(DbspStepLog *log, DbspStepLogSegment *out, size_t cap, size_t *count) {
    pthread_rwlock_rdlock(&log->seg_lock);
    *count = log->nsegs;
    for (size_t i = 0; i < log->nsegs && i < cap; i++) {
        const Seg *s = &log->segs[i];
        out[i] = (DbspStepLogSegment){s->num, s->format, s->size, s->records, s->nidx,
                                      s->records ? s->min_step : 0, s->records ? s->max_step : 0};
    }
    pthread_rwlock_unlock(&log->seg_lock);
    return DBSP_OK;
}
