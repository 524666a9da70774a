/* smallfile.c: whole small files replaced atomically through the VFS (temporary file, fsync, rename, fsync of the directory), so the fault VFS covers them like the page store and the step log.
 *
 * Invariants:
 *  (1) after dbsp_file_replace returns, `path` durably holds the new bytes; a crash before that leaves the old
 *      content (or no file if there was none), never a prefix or a mix: the bytes reach `path` only by the
 *      rename of a fully written and fsynced temporary file;
 *  (2) after dbsp_file_remove returns, the removal is durable (the directory was fsynced).
 * Callers frame what they store (magic, version, checksum: dbsp_core/codec.py) and check it when reading.
 */
#include "smallfile.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int oom(void) { return dbsp_storage_fail(DBSP_ENOMEM, ENOMEM, "smallfile: out of memory"); }

int dbsp_file_replace(DbspVfs *vfs, const char *path, const void *data, size_t len) {
    /* no size bound: the bytes are the caller's already (a spilled batch file may hold gigabytes) */
    size_t n = strlen(path);
    char *tmp = malloc(n + 5);
    char *dir = dbsp_path_dirname(path);
    DbspFile *f = NULL;
    int rc = DBSP_OK;
    if (!tmp || !dir) { rc = oom(); goto out; }
    memcpy(tmp, path, n);
    memcpy(tmp + n, ".tmp", 5);
    if ((rc = vfs->open(vfs, tmp, DBSP_VFS_CREATE, &f))) goto out;
    if ((rc = vfs->truncate(f, 0))) goto out;
    if (len && (rc = vfs->pwrite(f, data, len, 0))) goto out;
    if ((rc = vfs->fsync(f))) goto out;
    rc = vfs->close(f);
    f = NULL;
    if (rc) goto out;
    if ((rc = vfs->rename(vfs, tmp, path))) goto out;
    rc = vfs->fsync_dir(vfs, dir);
out:
    if (f) vfs->close(f);
    free(tmp);
    free(dir);
    return rc;
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
