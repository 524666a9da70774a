/* smallfile.h: whole files (a storage directory's layout and rescale records, spilled batch files) replaced atomically through the VFS; DBSP_SMALLFILE_MAX bounds what dbsp_file_read loads into memory, not what dbsp_file_replace writes. */
#ifndef DBSP_SMALLFILE_H
#define DBSP_SMALLFILE_H

#include <stddef.h>

#include "vfs.h"

#define DBSP_SMALLFILE_MAX (64u << 20)

/* Makes `path` hold exactly `data` (any size): writes `path`.tmp, fsyncs it, renames it over `path` and fsyncs the
 * directory.
 * A crash at any point leaves the old file or the new one, never a mix (a stale `path`.tmp may remain). */
int dbsp_file_replace(DbspVfs *vfs, const char *path, const void *data, size_t len);
/* Reads the whole file into a malloc'd buffer (*out, *len; the caller frees it); DBSP_ENOTFOUND if it is missing,
 * DBSP_ETOOBIG if it is larger than DBSP_SMALLFILE_MAX. */
int dbsp_file_read(DbspVfs *vfs, const char *path, unsigned char **out, size_t *len);
/* Unlinks `path` (a missing file is fine) and fsyncs its directory, so the removal is durable when this returns. */
int dbsp_file_remove(DbspVfs *vfs, const char *path);

#endif
