/* steplog.c: the append-only, segmented step log with group commit (the durable record of input, seed 000 "Input").
 *
 * DESIGN NOTES
 * ============
 * Invariants:
 *  (1) every acknowledged append is in a record that was fsynced before the acknowledgement;
 *  (2) steps never decrease along the log (across records and segments);
 *  (3) only the last segment is ever written; a segment is sealed (never written again) once a later one exists,
 *      and every byte of a sealed segment was fsynced before the next segment was created;
 *  (4) segment numbers are consecutive; truncation removes segments from the front only;
 *  (5) recovery accepts a prefix of valid records per segment: the first invalid record of the last segment
 *      starts a torn tail that is cut off (and fsynced); an invalid record in a sealed segment is corruption.
 *
 * On-disk format (little-endian)
 * ------------------------------
 * <dir>/LOG (32 bytes): "DBSPSLOG" | u32 format (1) | 16 zero bytes | u32 reserved | u32 CRC32C of bytes 0..27.
 * <dir>/<20-digit segment number>.seg: a 32-byte header "DBSPSSEG" | u32 format (1) | u32 header length (32) |
 *   u64 segment number | u32 zero | u32 CRC32C of bytes 0..27, then records back to back:
 *   u32 body length L (>= 24, <= 24 + 2*65535 + 1 GiB) | u32 CRC32C over the 4 length bytes and the body | body:
 *   i64 step | u64 seq | u16 handle length | u16 producer length | u32 zero | handle | producer | payload.
 * Validity rule of a record: the whole frame lies inside the file, L is in range, the CRC matches, handle and
 * producer lengths fit in L, and the step is >= the previous record's.
 *
 * Group commit: appenders copy their frame into a shared buffer under `mu` and wait; the first waiter without
 * a sync in flight becomes the leader, takes the whole buffer, writes it with one pwrite, fsyncs once and wakes
 * every appender whose record it covered. `append` is `enqueue` (copy the frame into the buffer, in log order,
 * and take a ticket) then `sync(ticket)` (wait, or lead, until every record up to the ticket is durable); a
 * caller may split the two to overlap the fsync with other work. A record is written to the file only by a
 * sync, so before its sync returns it may or may not be durable, and readers never see it before it is.
 */
#include "steplog.h"

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "crc32c.h"

#define SEG_HDR 32u
#define LOG_HDR 32u
#define MAX_BODY (DBSP_STEPLOG_BODY_HEADER + 2u * 65535u + DBSP_STEPLOG_MAX_PAYLOAD)

static inline uint16_t rd16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t rd64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline void wr16(unsigned char *p, uint16_t v) { memcpy(p, &v, 2); }
static inline void wr32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void wr64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }

typedef struct {
    uint64_t num;
    DbspFile *f;
    uint64_t size;       /* durable bytes */
    int64_t min_step, max_step;
    uint64_t records;
} Seg;

struct DbspStepLog {
    DbspVfs *vfs;
    char *dir;
    uint64_t seg_bytes;
    pthread_rwlock_t seg_lock; /* guards segs (readers: read, truncate; writer: leader on rotate/size update) */
    Seg *segs;
    size_t nsegs, segcap;
    pthread_mutex_t mu;        /* guards everything below */
    pthread_cond_t cv;
    unsigned char *buf, *spare;
    size_t blen, bcap, spare_cap;
    int64_t buf_min, buf_max;
    uint64_t buf_records;
    uint64_t next_ticket, durable_ticket, fsyncs;
    int syncing, failed, fail_status, fail_errno;
    char fail_msg[400];
    int has_last;
    int64_t last_step;
};

static int oom(void) { return dbsp_storage_fail(DBSP_ENOMEM, ENOMEM, "steplog: out of memory"); }

static char *seg_path(DbspStepLog *log, uint64_t num) {
    char name[32];
    snprintf(name, sizeof name, "%020llu.seg", (unsigned long long)num);
    return dbsp_path_join(log->dir, name);
}

static void encode_header(unsigned char *h, const char *magic, uint64_t num) {
    memset(h, 0, 32);
    memcpy(h, magic, 8);
    wr32(h + 8, DBSP_STEPLOG_FORMAT);
    wr32(h + 12, 32);
    wr64(h + 16, num);
    wr32(h + 28, dbsp_crc32c(0, h, 28));
}

/* 0 valid, else a status (ECORRUPT / EFORMAT) with the message set. */
static int check_header(const unsigned char *h, const char *magic, uint64_t num, const char *path) {
    if (memcmp(h, magic, 8) != 0 || rd32(h + 28) != dbsp_crc32c(0, h, 28))
        return dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: header magic or checksum is wrong", path);
    if (rd32(h + 8) != DBSP_STEPLOG_FORMAT)
        return dbsp_storage_fail(DBSP_EFORMAT, 0, "steplog %s: format version %u, this build reads %u", path,
                                 rd32(h + 8), DBSP_STEPLOG_FORMAT);
    if (rd32(h + 12) != 32 || rd64(h + 16) != num)
        return dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: header names segment %llu", path,
                                 (unsigned long long)rd64(h + 16));
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

/* Creates segment `num` with its header, durably (file and directory). */
static int seg_create(DbspStepLog *log, uint64_t num, Seg *out) {
    char *path = seg_path(log, num);
    if (!path) return oom();
    DbspFile *f = NULL;
    unsigned char h[SEG_HDR];
    encode_header(h, "DBSPSSEG", num);
    int rc = log->vfs->open(log->vfs, path, DBSP_VFS_CREATE, &f);
    if (!rc) rc = log->vfs->truncate(f, 0);
    if (!rc) rc = log->vfs->pwrite(f, h, SEG_HDR, 0);
    if (!rc) rc = log->vfs->fsync(f);
    if (!rc) rc = log->vfs->fsync_dir(log->vfs, log->dir);
    free(path);
    if (rc) { if (f) log->vfs->close(f); return rc; }
    *out = (Seg){num, f, SEG_HDR, 0, -1, 0};
    return DBSP_OK;
}

/* Validates one frame at buf[0..avail); returns its total length, or 0 if it is not a valid record. */
static size_t frame_check(const unsigned char *b, size_t avail, int64_t min_step, int64_t *step) {
    if (avail < 8) return 0;
    uint32_t len = rd32(b);
    if (len < DBSP_STEPLOG_BODY_HEADER || len > MAX_BODY || (size_t)len + 8 > avail) return 0;
    uint32_t crc = dbsp_crc32c(dbsp_crc32c(0, b, 4), b + 8, len);
    if (crc != rd32(b + 4)) return 0;
    const unsigned char *body = b + 8;
    if ((size_t)rd16(body + 16) + rd16(body + 18) > len - DBSP_STEPLOG_BODY_HEADER) return 0;
    *step = (int64_t)rd64(body);
    if (*step < min_step) return 0;
    return (size_t)len + 8;
}

/* Scans a segment: fills min/max/records/size; a torn tail of the last segment is cut off. */
static int seg_recover(DbspStepLog *log, Seg *s, int is_last, int64_t *prev_step, int *has_prev) {
    char *path = seg_path(log, s->num);
    if (!path) return oom();
    uint64_t size;
    int rc = log->vfs->size(s->f, &size);
    unsigned char *data = NULL;
    if (rc) goto out;
    if (size < SEG_HDR) {
        if (!is_last) { rc = dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: sealed segment shorter than its header", path); goto out; }
        goto reinit;
    }
    if (!(data = malloc(size))) { rc = oom(); goto out; }
    if ((rc = dbsp_vfs_read_exact(s->f, data, size, 0, "segment"))) goto out;
    if ((rc = check_header(data, "DBSPSSEG", s->num, path))) {
        if (rc == DBSP_ECORRUPT && is_last) goto reinit; /* a crash while creating it */
        goto out;
    }
    uint64_t off = SEG_HDR;
    int64_t floor = *has_prev ? *prev_step : INT64_MIN;
    s->records = 0;
    while (off < size) {
        int64_t step;
        size_t n = frame_check(data + off, size - off, floor, &step);
        if (!n) break;
        if (!s->records) s->min_step = step;
        s->max_step = step;
        s->records++;
        floor = step;
        off += n;
    }
    if (s->records) { *prev_step = s->max_step; *has_prev = 1; }
    if (off != size) {
        if (!is_last) {
            rc = dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: invalid record at offset %llu of a sealed segment", path,
                                   (unsigned long long)off);
            goto out;
        }
        if ((rc = log->vfs->truncate(s->f, off)) || (rc = log->vfs->fsync(s->f))) goto out;
    }
    s->size = off;
    goto out;
reinit: {
        unsigned char h[SEG_HDR];
        encode_header(h, "DBSPSSEG", s->num);
        if ((rc = log->vfs->truncate(s->f, 0)) || (rc = log->vfs->pwrite(s->f, h, SEG_HDR, 0)) ||
            (rc = log->vfs->fsync(s->f)))
            goto out;
        s->size = SEG_HDR;
        s->records = 0;
    }
out:
    free(data);
    free(path);
    return rc;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static int open_log_file(DbspStepLog *log) {
    char *path = dbsp_path_join(log->dir, "LOG"), *tmp = dbsp_path_join(log->dir, "LOG.create");
    DbspFile *f = NULL;
    unsigned char h[LOG_HDR];
    int rc;
    if (!path || !tmp) { rc = oom(); goto out; }
    rc = log->vfs->open(log->vfs, path, 0, &f);
    if (rc == DBSP_ENOTFOUND) {
        encode_header(h, "DBSPSLOG", 0);
        if ((rc = log->vfs->open(log->vfs, tmp, DBSP_VFS_CREATE, &f)) || (rc = log->vfs->truncate(f, 0)) ||
            (rc = log->vfs->pwrite(f, h, LOG_HDR, 0)) || (rc = log->vfs->fsync(f)))
            goto out;
        log->vfs->close(f);
        f = NULL;
        if ((rc = log->vfs->rename(log->vfs, tmp, path)) || (rc = log->vfs->fsync_dir(log->vfs, log->dir))) goto out;
        goto out;
    }
    if (rc) goto out;
    if ((rc = dbsp_vfs_read_exact(f, h, LOG_HDR, 0, "log header"))) goto out;
    rc = check_header(h, "DBSPSLOG", 0, path);
out:
    if (f) log->vfs->close(f);
    free(path);
    free(tmp);
    return rc;
}

int dbsp_steplog_open(const char *dir, DbspVfs *vfs, uint64_t segment_bytes, DbspStepLog **out) {
    DbspStepLog *log = calloc(1, sizeof *log);
    if (!log) return oom();
    log->vfs = vfs ? vfs : dbsp_vfs_posix();
    log->seg_bytes = segment_bytes ? segment_bytes : (64u << 20);
    pthread_rwlock_init(&log->seg_lock, NULL);
    pthread_mutex_init(&log->mu, NULL);
    pthread_cond_init(&log->cv, NULL);
    int rc = DBSP_OK;
    uint64_t *nums = NULL;
    size_t nn = 0, ncap = 0;
    if (!(log->dir = strdup(dir))) { rc = oom(); goto fail; }
    if (mkdir(dir, 0755) == 0) {
        char *parent = dbsp_path_dirname(dir);
        rc = parent ? log->vfs->fsync_dir(log->vfs, parent) : oom();
        free(parent);
        if (rc) goto fail;
    } else if (errno != EEXIST) {
        rc = dbsp_storage_fail(dbsp_storage_status_of_errno(errno), errno, "steplog mkdir %s: %s", dir, strerror(errno));
        goto fail;
    }
    if ((rc = open_log_file(log))) goto fail;
    DIR *d = opendir(dir);
    if (!d) { rc = dbsp_storage_fail(DBSP_EIO, errno, "steplog opendir %s: %s", dir, strerror(errno)); goto fail; }
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t l = strlen(de->d_name);
        if (l != 24 || strcmp(de->d_name + 20, ".seg") != 0) continue;
        if (nn == ncap) {
            ncap = ncap ? ncap * 2 : 16;
            uint64_t *n2 = realloc(nums, ncap * sizeof *n2);
            if (!n2) { closedir(d); rc = oom(); goto fail; }
            nums = n2;
        }
        nums[nn++] = strtoull(de->d_name, NULL, 10);
    }
    closedir(d);
    qsort(nums, nn, sizeof *nums, cmp_u64);
    int64_t prev = 0;
    int has_prev = 0;
    for (size_t i = 0; i < nn; i++) {
        if (i && nums[i] != nums[i - 1] + 1) {
            rc = dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: segment %llu is missing", dir,
                                   (unsigned long long)(nums[i - 1] + 1));
            goto fail;
        }
        char *path = seg_path(log, nums[i]);
        if (!path) { rc = oom(); goto fail; }
        Seg s = {nums[i], NULL, 0, 0, -1, 0};
        rc = log->vfs->open(log->vfs, path, 0, &s.f);
        free(path);
        if (rc) goto fail;
        if ((rc = segs_push(log, s))) { log->vfs->close(s.f); goto fail; }
        if ((rc = seg_recover(log, &log->segs[log->nsegs - 1], i + 1 == nn, &prev, &has_prev))) goto fail;
    }
    if (!log->nsegs) {
        Seg s;
        if ((rc = seg_create(log, 1, &s))) goto fail;
        if ((rc = segs_push(log, s))) { log->vfs->close(s.f); goto fail; }
    }
    log->has_last = has_prev;
    log->last_step = prev;
    free(nums);
    *out = log;
    return DBSP_OK;
fail:
    free(nums);
    dbsp_steplog_close(log);
    return rc;
}

void dbsp_steplog_close(DbspStepLog *log) {
    if (!log) return;
    for (size_t i = 0; i < log->nsegs; i++) log->vfs->close(log->segs[i].f);
    free(log->segs);
    free(log->buf);
    free(log->spare);
    free(log->dir);
    pthread_rwlock_destroy(&log->seg_lock);
    pthread_mutex_destroy(&log->mu);
    pthread_cond_destroy(&log->cv);
    free(log);
}

/* Leader: writes one batch into the active segment (rotating first if it is full) and fsyncs it. */
static int write_batch(DbspStepLog *log, const unsigned char *data, size_t len, int64_t bmin, int64_t bmax,
                       uint64_t nrec) {
    /* only the leader changes the active segment; truncate_below may move the array, so copy under the lock */
    pthread_rwlock_rdlock(&log->seg_lock);
    Seg act = log->segs[log->nsegs - 1];
    pthread_rwlock_unlock(&log->seg_lock);
    int rc;
    if (act.size > SEG_HDR && act.size + len > log->seg_bytes) {
        Seg s;
        if ((rc = seg_create(log, act.num + 1, &s))) return rc;
        pthread_rwlock_wrlock(&log->seg_lock);
        rc = segs_push(log, s);
        pthread_rwlock_unlock(&log->seg_lock);
        if (rc) { log->vfs->close(s.f); return rc; }
        act = s;
    }
    if ((rc = log->vfs->pwrite(act.f, data, len, act.size)) || (rc = log->vfs->fsync(act.f))) return rc;
    pthread_rwlock_wrlock(&log->seg_lock);
    Seg *a = &log->segs[log->nsegs - 1];
    if (!a->records) a->min_step = bmin;
    a->max_step = bmax;
    a->records += nrec;
    a->size += len;
    pthread_rwlock_unlock(&log->seg_lock);
    return DBSP_OK;
}

static int failed_status(DbspStepLog *log) {
    return dbsp_storage_fail(log->fail_status, log->fail_errno, "%s (the log must be reopened)", log->fail_msg);
}

int dbsp_steplog_enqueue(DbspStepLog *log, int64_t step, const void *handle, size_t hlen, const void *producer,
                         size_t plen, uint64_t seq, const void *payload, size_t len, uint64_t *ticket) {
    if (hlen > 65535 || plen > 65535 || len > DBSP_STEPLOG_MAX_PAYLOAD)
        return dbsp_storage_fail(DBSP_ETOOBIG, 0, "steplog %s: record too large (handle %zu, producer %zu, payload %zu bytes)",
                                 log->dir, hlen, plen, len);
    size_t body = DBSP_STEPLOG_BODY_HEADER + hlen + plen + len, frame = body + 8;
    unsigned char h[8 + DBSP_STEPLOG_BODY_HEADER]; /* frame and body header; the CRC is computed before locking */
    wr32(h, (uint32_t)body);
    wr64(h + 8, (uint64_t)step);
    wr64(h + 16, seq);
    wr16(h + 24, (uint16_t)hlen);
    wr16(h + 26, (uint16_t)plen);
    wr32(h + 28, 0);
    uint32_t crc = dbsp_crc32c(0, h, 4);
    crc = dbsp_crc32c(crc, h + 8, DBSP_STEPLOG_BODY_HEADER);
    crc = dbsp_crc32c(crc, handle, hlen);
    crc = dbsp_crc32c(crc, producer, plen);
    if (len) crc = dbsp_crc32c(crc, payload, len);
    wr32(h + 4, crc);
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
    if (hlen) memcpy(b + sizeof h, handle, hlen);
    if (plen) memcpy(b + sizeof h + hlen, producer, plen);
    if (len) memcpy(b + sizeof h + hlen + plen, payload, len);
    if (!log->buf_records) log->buf_min = step;
    log->buf_max = step;
    log->buf_records++;
    log->blen += frame;
    log->has_last = 1;
    log->last_step = step;
    *ticket = ++log->next_ticket;
    pthread_mutex_unlock(&log->mu);
    return DBSP_OK;
}

int dbsp_steplog_sync(DbspStepLog *log, uint64_t ticket) {
    int rc = DBSP_OK;
    pthread_mutex_lock(&log->mu);
    if (ticket > log->next_ticket) ticket = log->next_ticket;
    while (log->durable_ticket < ticket) {
        if (log->failed) { rc = failed_status(log); break; }
        if (log->syncing) { pthread_cond_wait(&log->cv, &log->mu); continue; }
        /* become the leader for everything buffered so far */
        log->syncing = 1;
        unsigned char *data = log->buf;
        size_t dlen = log->blen, dcap = log->bcap;
        int64_t bmin = log->buf_min, bmax = log->buf_max;
        uint64_t nrec = log->buf_records, target = log->next_ticket;
        log->buf = log->spare;
        log->bcap = log->spare_cap;
        log->blen = 0;
        log->buf_records = 0;
        log->spare = NULL;
        log->spare_cap = 0;
        pthread_mutex_unlock(&log->mu);
        int wrc = write_batch(log, data, dlen, bmin, bmax, nrec);
        pthread_mutex_lock(&log->mu);
        if (!log->spare) { log->spare = data; log->spare_cap = dcap; } else free(data);
        log->syncing = 0;
        log->fsyncs++;
        if (wrc) {
            log->failed = 1;
            log->fail_status = wrc;
            log->fail_errno = dbsp_storage_errno();
            snprintf(log->fail_msg, sizeof log->fail_msg, "%s", dbsp_storage_errmsg());
        } else {
            log->durable_ticket = target;
        }
        pthread_cond_broadcast(&log->cv);
    }
    pthread_mutex_unlock(&log->mu);
    return rc;
}

int dbsp_steplog_append(DbspStepLog *log, int64_t step, const void *handle, size_t hlen, const void *producer,
                        size_t plen, uint64_t seq, const void *payload, size_t len) {
    uint64_t ticket = 0;
    int rc = dbsp_steplog_enqueue(log, step, handle, hlen, producer, plen, seq, payload, len, &ticket);
    return rc ? rc : dbsp_steplog_sync(log, ticket);
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
    }
    *resume_seg = 0;
    for (; i < log->nsegs; i++, off = SEG_HDR) {
        Seg *s = &log->segs[i];
        if (s->records && s->min_step > to_step) break;
        while (off < s->size) {
            unsigned char fh[8];
            if ((rc = dbsp_vfs_read_exact(s->f, fh, 8, off, "record header"))) goto out;
            uint32_t len = rd32(fh);
            if (len < DBSP_STEPLOG_BODY_HEADER || len > MAX_BODY || off + 8 + len > s->size) {
                rc = dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: segment %llu: bad record length at offset %llu",
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
            if ((rc = dbsp_vfs_read_exact(s->f, body, len, off + 8, "record body"))) goto out;
            if (dbsp_crc32c(dbsp_crc32c(0, fh, 4), body, len) != rd32(fh + 4)) {
                rc = dbsp_storage_fail(DBSP_ECORRUPT, 0, "steplog %s: segment %llu: checksum mismatch at offset %llu",
                                       log->dir, (unsigned long long)s->num, (unsigned long long)off);
                goto out;
            }
            off += 8 + len;
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
    pthread_rwlock_unlock(&log->seg_lock);
    if (rc) { free(buf); *resume_seg = 0; return rc; }
    *out = buf;
    *outlen = blen;
    return DBSP_OK;
}

int dbsp_steplog_truncate_below(DbspStepLog *log, int64_t step, uint64_t *dropped) {
    int rc = DBSP_OK;
    *dropped = 0;
    pthread_rwlock_wrlock(&log->seg_lock);
    size_t k = 0;
    while (k + 1 < log->nsegs && (!log->segs[k].records || log->segs[k].max_step < step)) {
        char *path = seg_path(log, log->segs[k].num);
        if (!path) { rc = oom(); break; }
        rc = log->vfs->unlink(log->vfs, path);
        free(path);
        if (rc) break;
        log->vfs->close(log->segs[k].f);
        k++;
    }
    if (k) {
        memmove(log->segs, log->segs + k, (log->nsegs - k) * sizeof *log->segs);
        log->nsegs -= k;
        int drc = log->vfs->fsync_dir(log->vfs, log->dir);
        if (!rc) rc = drc;
    }
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
