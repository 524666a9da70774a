/* smallfile.h: files put in place atomically through the VFS, whole (a storage directory's layout and rescale records) or streamed in pieces (spilled batch files); DBSP_SMALLFILE_MAX bounds what dbsp_file_read loads into memory, not what is written. */
#ifndef DBSP_SMALLFILE_H
#define DBSP_SMALLFILE_H

#include <stddef.h>
#include <stdint.h>

#include "vfs.h"

#define DBSP_SMALLFILE_MAX (64u << 20)

/* Makes `path` hold exactly `data` (any size): writes `path`.tmp, fsyncs it, renames it over `path` and fsyncs the
 * directory.
 * A crash at any point leaves the old file or the new one, never a mix (a stale `path`.tmp may remain). */
int dbsp_file_replace(DbspVfs *vfs, const char *path, const void *data, size_t len);
/* A file streamed to `path`.tmp in pieces and then put in place whole (dbsp_file_replace is one piece of it):
 * dbsp_file_writer_open creates or truncates `path`.tmp; pwrite and pread go to it at any offset;
 * dbsp_file_writer_commit fsyncs it (with `sync`), closes it, renames it over `path` and fsyncs the directory (with
 * `sync`); dbsp_file_writer_abort closes it and, with `unlink`, removes `path`.tmp. Commit and abort free the
 * writer whatever happens. Every step is one operation of the VFS, so the fault VFS sees each of them. */
typedef struct DbspFileWriter DbspFileWriter;
int dbsp_file_writer_open(DbspVfs *vfs, const char *path, DbspFileWriter **out);
/* A writer whose temporary file is the existing file `tmp` (a merge's scratch file, its rows written through a shared
 * mapping and never synced: opened with DBSP_VFS_ADOPT, not truncated), put in place over `path` by commit as the
 * others are; abort with `unlink` removes `tmp`. DBSP_ENOTSUP when the VFS cannot punch holes (it has no punch). */
int dbsp_file_writer_adopt(DbspVfs *vfs, const char *tmp, const char *path, DbspFileWriter **out);
/* Sets the temporary file's size (one VFS truncate). */
int dbsp_file_writer_truncate(DbspFileWriter *w, uint64_t size);
/* Punches a hole in the temporary file (one VFS punch); DBSP_ENOTSUP when its file system cannot. */
int dbsp_file_writer_punch(DbspFileWriter *w, uint64_t off, uint64_t len);
int dbsp_file_writer_pwrite(DbspFileWriter *w, const void *data, size_t len, uint64_t off);
int dbsp_file_writer_pread(DbspFileWriter *w, void *buf, size_t len, uint64_t off, size_t *nread);
int dbsp_file_writer_commit(DbspFileWriter *w, int sync);
int dbsp_file_writer_abort(DbspFileWriter *w, int unlink);
/* Reads the whole file into a malloc'd buffer (*out, *len; the caller frees it); DBSP_ENOTFOUND if it is missing,
 * DBSP_ETOOBIG if it is larger than DBSP_SMALLFILE_MAX. */
int dbsp_file_read(DbspVfs *vfs, const char *path, unsigned char **out, size_t *len);
/* Unlinks `path` (a missing file is fine) and fsyncs its directory, so the removal is durable when this returns. */
int dbsp_file_remove(DbspVfs *vfs, const char *path);

#endif
