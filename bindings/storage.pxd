# storage.pxd: declarations mirroring the storage headers of csrc/ (storage_status, vfs, pagestore, steplog).
from libc.stdint cimport int64_t, uint64_t

cdef extern from "status.h" nogil:
    enum:
        DBSP_OK
        DBSP_ENOMEM
        DBSP_EINVAL
        DBSP_ETOOBIG

cdef extern from "storage_status.h" nogil:
    enum:
        DBSP_EIO
        DBSP_ENOSPC
        DBSP_ECORRUPT
        DBSP_EFORMAT
        DBSP_ECRASHED
        DBSP_ESTATE
        DBSP_ENOTFOUND
        DBSP_EBUSY
        DBSP_ENOTSUP
    const char *dbsp_storage_errmsg()
    int dbsp_storage_errno()

cdef extern from "crc32c.h" nogil:
    unsigned int dbsp_crc32c(unsigned int crc, const void *data, size_t len)
    unsigned int dbsp_crc32c_portable(unsigned int crc, const void *data, size_t len)
    unsigned int dbsp_crc32c_combine(unsigned int crc_a, unsigned int crc_b, uint64_t len_b)
    unsigned int dbsp_crc32c_pages(unsigned int crc, const void *data, size_t len, size_t page, unsigned int *out)

cdef extern from "bloom.h" nogil:
    int dbsp_bloom_build(const uint64_t *hashes, size_t n, uint64_t *words, size_t nwords, int k)

cdef extern from "vfs.h" nogil:
    ctypedef struct DbspVfs:
        int (*punch)(void *f, uint64_t off, uint64_t len)
    DbspVfs *dbsp_vfs_posix()
    DbspVfs *dbsp_vfs_fault()
    DbspVfs *dbsp_vfs_fault_new()
    void dbsp_vfs_fault_arm(DbspVfs *vfs, uint64_t crash_at, int mode, uint64_t seed, uint64_t error_at,
                            int error_errno)
    uint64_t dbsp_vfs_fault_ops(DbspVfs *vfs)
    int dbsp_vfs_fault_crashed(DbspVfs *vfs)
    void dbsp_vfs_fault_crash_now(DbspVfs *vfs, int mode, uint64_t seed)

cdef extern from "pagestore.h" nogil:
    ctypedef struct DbspPageStore:
        pass
    ctypedef struct DbspTxn:
        pass
    ctypedef struct DbspCursor:
        pass
    int dbsp_pagestore_open(const char *path, DbspVfs *vfs, size_t cache_pages, DbspPageStore **out)
    int dbsp_pagestore_open_readonly(const char *path, DbspVfs *vfs, size_t cache_pages, DbspPageStore **out)
    int dbsp_pagestore_create(const char *path, DbspVfs *vfs, uint64_t version, size_t cache_pages,
                              DbspPageStore **out)
    void dbsp_pagestore_close(DbspPageStore *ps)
    int dbsp_pagestore_versions(DbspPageStore *ps, uint64_t *first, uint64_t *count)
    int dbsp_pagestore_check(DbspPageStore *ps)
    int dbsp_pagestore_check_version(DbspPageStore *ps, uint64_t version)
    int dbsp_pagestore_stats(DbspPageStore *ps, uint64_t *page_count, uint64_t *free_pages, uint64_t *last_commit_pages,
                             uint64_t *cached_pages, uint64_t *dirty_pages)
    int dbsp_pagestore_begin(DbspPageStore *ps, uint64_t v, DbspTxn **out)
    int dbsp_pagestore_read(DbspPageStore *ps, uint64_t v, DbspTxn **out)
    int dbsp_txn_commit(DbspTxn *t)
    void dbsp_txn_abort(DbspTxn *t)
    int dbsp_txn_get(DbspTxn *t, const void *table, size_t tlen, const void *key, size_t klen,
                     const void **val, size_t *vlen)
    int dbsp_txn_put(DbspTxn *t, const void *table, size_t tlen, const void *key, size_t klen,
                     const void *val, size_t vlen)
    int dbsp_txn_delete(DbspTxn *t, const void *table, size_t tlen, const void *key, size_t klen, int *found)
    int dbsp_txn_get_step(DbspTxn *t, int64_t *step)
    int dbsp_txn_set_step(DbspTxn *t, int64_t step)
    uint64_t dbsp_txn_version(DbspTxn *t)
    int dbsp_cursor_open(DbspTxn *t, const void *table, size_t tlen, const void *start, size_t slen,
                         const void *end, size_t elen, DbspCursor **out)
    int dbsp_cursor_next(DbspCursor *c, const void **key, size_t *klen, const void **val, size_t *vlen)
    void dbsp_cursor_close(DbspCursor *c)

cdef extern from "steplog.h" nogil:
    ctypedef struct DbspStepLog:
        pass
    ctypedef struct DbspSlice:
        const void *data
        size_t len
    ctypedef struct DbspStepLogSegment:
        uint64_t num
        unsigned int format
        uint64_t bytes
        uint64_t records
        uint64_t steps
        int64_t first_step
        int64_t last_step
    enum:
        DBSP_STEPLOG_FORMAT
        DBSP_STEPLOG_MAX_PAYLOAD
        DBSP_STEPLOG_READONLY
        DBSP_STEPLOG_NO_LOG_FILE
    int dbsp_steplog_open(const char *dir, DbspVfs *vfs, uint64_t segment_bytes, int flags, DbspStepLog **out)
    void dbsp_steplog_close(DbspStepLog *log)
    int dbsp_steplog_refresh(DbspStepLog *log)
    int dbsp_steplog_append(DbspStepLog *log, int64_t step, const void *handle, size_t hlen, const void *producer,
                            size_t plen, uint64_t seq, const void *payload, size_t len)
    int dbsp_steplog_enqueue(DbspStepLog *log, int64_t step, const void *handle, size_t hlen,
                             const void *producer, size_t plen, uint64_t seq, const void *payload, size_t len,
                             uint64_t *ticket)
    int dbsp_steplog_enqueuev(DbspStepLog *log, int64_t step, const void *handle, size_t hlen,
                              const void *producer, size_t plen, uint64_t seq, const DbspSlice *parts, size_t nparts,
                              uint64_t *ticket)
    int dbsp_steplog_write(DbspStepLog *log, uint64_t ticket)
    int dbsp_steplog_sync(DbspStepLog *log, uint64_t ticket)
    int dbsp_steplog_read(DbspStepLog *log, int64_t from_step, int64_t to_step, size_t max_bytes,
                          uint64_t *resume_seg, uint64_t *resume_off, unsigned char **out, size_t *outlen)
    int dbsp_steplog_truncate_below(DbspStepLog *log, int64_t step, uint64_t *segments_dropped)
    int dbsp_steplog_info(DbspStepLog *log, int *has, int64_t *first_step, int64_t *last_step, uint64_t *records,
                          uint64_t *segments, uint64_t *fsyncs)
    int dbsp_steplog_segments(DbspStepLog *log, DbspStepLogSegment *out, size_t cap, size_t *count)

cdef extern from "smallfile.h" nogil:
    int dbsp_file_replace(DbspVfs *vfs, const char *path, const void *data, size_t len)
    int dbsp_file_read(DbspVfs *vfs, const char *path, unsigned char **out, size_t *len)
    int dbsp_file_remove(DbspVfs *vfs, const char *path)
    ctypedef struct DbspFileWriter:
        pass
    int dbsp_file_writer_open(DbspVfs *vfs, const char *path, DbspFileWriter **out)
    int dbsp_file_writer_adopt(DbspVfs *vfs, const char *tmp, const char *path, DbspFileWriter **out)
    int dbsp_file_writer_truncate(DbspFileWriter *w, uint64_t size)
    int dbsp_file_writer_punch(DbspFileWriter *w, uint64_t off, uint64_t len)
    int dbsp_file_writer_pwrite(DbspFileWriter *w, const void *data, size_t len, uint64_t off)
    int dbsp_file_writer_pread(DbspFileWriter *w, void *buf, size_t len, uint64_t off, size_t *nread)
    int dbsp_file_writer_commit(DbspFileWriter *w, int sync)
    int dbsp_file_writer_abort(DbspFileWriter *w, int unlink)
