/* smallfile.c: files put in place atomically through the VFS (temporary file written whole or streamed, fsync, rename, fsync of the directory), so the fault VFS covers them like the page store and the step log.
 *
 * Invariants:
 *  (1) after dbsp_file_replace returns, `path` durably holds the new bytes; a crash before that leaves the old
 *      content (or no file if there was none), never a prefix or a mix: the bytes reach `path` only by the
 *      rename of a fully written and fsynced temporary file;
 *  (2) after dbsp_file_remove returns, the removal is durable (the directory was fsynced);
 *  (3) a streamed file (DbspFileWriter) is (1) in pieces: the bytes go to `path`.tmp by as many pwrites as the
 *      caller makes, and reach `path` only by dbsp_file_writer_commit's rename after its fsync. dbsp_file_replace
 *      is a writer with one piece, so both take the same operations in the same order: open, truncate, pwrite
 *      (each piece), fsync, rename, fsync of the directory (without `sync`, the two fsyncs are left out: a file no
 *      crash needs to find again);
 *  (4) an adopted writer (dbsp_file_writer_adopt: a merge's scratch file that becomes a batch file in place) is
 *      (3) over a temporary file that exists already: its bytes so far written outside the VFS and never synced
 *      (the fault VFS remembers them as unsynced writes), then truncate, punch and pwrite as the caller makes them,
 *      and the same commit: fsync, rename over `path`, fsync of the directory.
 * Callers frame what they store (magic, version, checksum: dbsp_core/codec.py) and check it when reading.
 */
#include "smallfile.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int oom(void) { return dbsp_storage_fail(DBSP_ENOMEM, ENOMEM, "smallfile: out of memory"); }

struct DbspFileWriter {
    DbspVfs *vfs;
    DbspFile *f;   /* `path`.tmp, open */
    char *path;
    char *tmp;
    char *dir;
};

static void writer_free(DbspFileWriter *w) {
    if (w->f) w->vfs->close(w->f);
    free(w->path);
    free(w->tmp);
    free(w->dir);
    free(w);
}

int dbsp_file_writer_open(DbspVfs *vfs, const char *path, DbspFileWriter **out) {
    size_t n = strlen(path);
    DbspFileWriter *w = calloc(1, sizeof *w);
    if (!w) return oom();
    w->vfs = vfs;
    w->path = strdup(path);
    w->tmp = malloc(n + 5);
    w->dir = dbsp_path_dirname(path);
    if (!w->path || !w->tmp || !w->dir) { writer_free(w); return oom(); }
    memcpy(w->tmp, path, n);
    memcpy(w->tmp + n, ".tmp", 5);
    int rc = vfs->open(vfs, w->tmp, DBSP_VFS_CREATE, &w->f);
    if (!rc) rc = vfs->truncate(w->f, 0); /* a stale `path`.tmp of a crash holds nothing of this file */
    if (rc) { writer_free(w); return rc; }
    *out = w;
    return DBSP_OK;
}

int dbsp_file_writer_adopt(DbspVfs *vfs, const char *tmp, const char *path, DbspFileWriter **out) {
    if (!vfs->punch)
        return dbsp_storage_fail(DBSP_ENOTSUP, EOPNOTSUPP, "the %s VFS cannot take over a file in place", vfs->name);
    DbspFileWriter *w = calloc(1, sizeof *w);
    if (!w) return oom();
    w->vfs = vfs;
    w->path = strdup(path);
    w->tmp = strdup(tmp);
    w->dir = dbsp_path_dirname(path);
    if (!w->path || !w->tmp || !w->dir) { writer_free(w); return oom(); }
    int rc = vfs->open(vfs, w->tmp, DBSP_VFS_ADOPT, &w->f);
    if (rc) { writer_free(w); return rc; }
    *out = w;
    return DBSP_OK;
}

int dbsp_file_writer_truncate(DbspFileWriter *w, uint64_t size) { return w->vfs->truncate(w->f, size); }

int dbsp_file_writer_punch(DbspFileWriter *w, uint64_t off, uint64_t len) {
    return len ? w->vfs->punch(w->f, off, len) : DBSP_OK;
}

int dbsp_file_writer_pwrite(DbspFileWriter *w, const void *data, size_t len, uint64_t off) {
    return len ? w->vfs->pwrite(w->f, data, len, off) : DBSP_OK;
}

int dbsp_file_writer_pread(DbspFileWriter *w, void *buf, size_t len, uint64_t off, size_t *nread) {
    return w->vfs->pread(w->f, buf, len, off, nread);
}

int dbsp_file_writer_commit(DbspFileWriter *w, int sync) {
    int rc = sync ? w->vfs->fsync(w->f) : DBSP_OK;
    if (!rc) {
        rc = w->vfs->close(w->f);
        w->f = NULL;
    }
    if (!rc) rc = w->vfs->rename(w->vfs, w->tmp, w->path);
    if (!rc && sync) rc = w->vfs->fsync_dir(w->vfs, w->dir);
    writer_free(w);
    return rc;
}

int dbsp_file_writer_abort(DbspFileWriter *w, int unlink) {
    int rc = w->vfs->close(w->f);
    w->f = NULL;
    if (unlink) {
        int rc2 = w->vfs->unlink(w->vfs, w->tmp);
        rc = rc ? rc : rc2;
    }
    writer_free(w);
    return rc;
}

int dbsp_file_replace(DbspVfs *vfs, const char *path, const void *data, size_t len) {
    /* no size bound: the bytes are the caller's already */
    DbspFileWriter *w = NULL;
    int rc = dbsp_file_writer_open(vfs, path, &w);
    if (rc) return rc;
    if ((rc = dbsp_file_writer_pwrite(w, data, len, 0))) {
        dbsp_file_writer_abort(w, 0);
        return rc;
    }
    return dbsp_file_writer_commit(w, 1);
}

int dbsp_file_read(DbspVfs *vfs, const char *path, unsigned char **out, size_t *len) {
    DbspFile *f = NULL;
    uint64_t size = 0;
    unsigned char *buf = NULL;
    int rc = vfs->open(vfs, path, 0, &f);
    if (rc) return rc;
    if ((rc = vfs->size(f, &size))) goto out;
    if (size > DBSP_SMALLFILE_MAX) {
        rc = dbsp_storage_fail(DBSP_ETOOBIG, 0, "%s: %llu bytes is more than a small file holds", path,
                               (unsigned long long)size);
        goto out;
    }
    buf = malloc(size ? size : 1);
    if (!buf) { rc = oom(); goto out; }
    if (size && (rc = dbsp_vfs_read_exact(f, buf, size, 0, "file"))) goto out;
    *out = buf;
    *len = size;
    buf = NULL;
out:
    free(buf);
    vfs->close(f);
    return rc;
}

int dbsp_file_remove(DbspVfs *vfs, const char *path) {
    char *dir = dbsp_path_dirname(path);
    if (!dir) return oom();
    int rc = vfs->unlink(vfs, path);
    if (!rc) rc = vfs->fsync_dir(vfs, dir);
    free(dir);
    return rc;
}
