/* vfs.h: the I/O function table under the page store and step log, with a POSIX and a fault-injecting implementation. */
#ifndef DBSP_VFS_H
#define DBSP_VFS_H

#include <stddef.h>
#include <stdint.h>

#include "storage_status.h"

typedef struct DbspVfs DbspVfs;
typedef struct DbspFile DbspFile;

enum {
    DBSP_VFS_CREATE = 1,
    DBSP_VFS_EXCL = 2,
    DBSP_VFS_READONLY = 4, /* open for reading only */
    /* open an existing file whose bytes were written outside the VFS (through a shared mapping: a merge's scratch
     * file) and neither they nor its name were ever synced; the fault VFS remembers all of them as unsynced writes
     * and the file as created since its directory was last fsynced (a crash may lose, tear or remove them) */
    DBSP_VFS_ADOPT = 8
};

/* Every entry returns DBSP_OK or a storage status with the thread's message set.
 * pread returns fewer bytes than asked only at end of file (*nread says how many). */
struct DbspVfs {
    const char *name;
    int (*open)(DbspVfs *vfs, const char *path, int flags, DbspFile **out);
    int (*close)(DbspFile *f);
    int (*pread)(DbspFile *f, void *buf, size_t len, uint64_t off, size_t *nread);
    int (*pwrite)(DbspFile *f, const void *buf, size_t len, uint64_t off);
    int (*fsync)(DbspFile *f);
    int (*size)(DbspFile *f, uint64_t *out);
    int (*truncate)(DbspFile *f, uint64_t size);
    int (*fsync_dir)(DbspVfs *vfs, const char *dirpath);
    int (*rename)(DbspVfs *vfs, const char *from, const char *to);
    int (*unlink)(DbspVfs *vfs, const char *path);
    /* Gives back the blocks of [off, off + len) (a hole: reads as zeros, the size unchanged). DBSP_ENOTSUP when the
     * file system cannot (the caller keeps the blocks: a hole is room, never content). NULL in a VFS that has no
     * such call: a merge output then never becomes its batch file in place (batchfile.py invariant 7). */
    int (*punch)(DbspFile *f, uint64_t off, uint64_t len);
};

struct DbspFile {
    DbspVfs *vfs;
    int fd;
    char *path;
};

/* The process-wide POSIX implementation. */
DbspVfs *dbsp_vfs_posix(void);

/* The process-wide fault-injecting implementation (wraps POSIX; thread-safe).
 * It counts every open/pread/pwrite/fsync/size/truncate/fsync_dir/rename/unlink/punch as one operation.
 * Unsynced writes (punches and truncates of a file with unsynced writes included) are remembered per file (with the
 * bytes they overwrote) until fsync (or a truncate of a file with none). */
DbspVfs *dbsp_vfs_fault(void);
/* A new fault-injecting implementation with a counter, arming and remembered writes of its own (vfs.c model 6);
 * NULL when out of memory. Never freed (a file may point at it; arm frees what it remembers). */
DbspVfs *dbsp_vfs_fault_new(void);

/* Damage applied to unsynced writes when the fault VFS simulates a crash. */
enum {
    DBSP_CRASH_KEEP = 0,    /* every unsynced write reached the disk */
    DBSP_CRASH_DROP = 1,    /* no unsynced write reached the disk */
    DBSP_CRASH_TEAR = 2,    /* all but the last reached it; the last only as a prefix of random length (torn sector) */
    DBSP_CRASH_REORDER = 3, /* a random subset reached it (later writes without earlier ones) */
    DBSP_CRASH_CHAOS = 4    /* a random subset, each possibly torn at a random byte */
};

/* The calls below take a fault VFS (dbsp_vfs_fault() or one of dbsp_vfs_fault_new()) and act on it alone.
 * Arms the fault VFS: the operation numbered `crash_at` (1-based; 0 = never) simulates a crash with `mode`
 * (using `seed` for the random choices) instead of running, and every later operation fails with DBSP_ECRASHED.
 * The operation numbered `error_at` (0 = never) fails once with `error_errno` (EIO, ENOSPC or EOPNOTSUPP: the
 * operation is not supported, DBSP_ENOTSUP) and does nothing.
 * Resets the operation counter and forgets all remembered writes. */
void dbsp_vfs_fault_arm(DbspVfs *vfs, uint64_t crash_at, int mode, uint64_t seed, uint64_t error_at,
                        int error_errno);
/* Number of operations counted since the last arm. */
uint64_t dbsp_vfs_fault_ops(DbspVfs *vfs);
/* 1 once a crash has been simulated since the last arm. */
int dbsp_vfs_fault_crashed(DbspVfs *vfs);
/* Simulates a crash now (same as reaching crash_at). */
void dbsp_vfs_fault_crash_now(DbspVfs *vfs, int mode, uint64_t seed);

/* OS locks (flock(2): per open file, so two opens in one process exclude each other too; released when the file
 * is closed or its process dies). dbsp_vfs_lock takes an exclusive (writer) or shared (reader) lock on an open
 * file without waiting; DBSP_EBUSY if another open file holds a conflicting one. dbsp_dir_lock does the same on
 * a directory (it creates nothing) and returns the descriptor to pass to dbsp_dir_unlock. */
int dbsp_vfs_lock(DbspFile *f, int exclusive, const char *what);
int dbsp_dir_lock(const char *dir, int exclusive, const char *what, int *fd);
void dbsp_dir_unlock(int fd);

/* Helpers on top of the table. */
int dbsp_vfs_read_exact(DbspFile *f, void *buf, size_t len, uint64_t off, const char *what);
char *dbsp_path_join(const char *dir, const char *name);
char *dbsp_path_dirname(const char *path);

#endif
