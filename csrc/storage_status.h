/* storage_status.h: status codes and the thread-local error message of the storage layer (vfs, pagestore, steplog). */
#ifndef DBSP_STORAGE_STATUS_H
#define DBSP_STORAGE_STATUS_H

#include "status.h"

/* Storage codes start at 100 so they never clash with the kernel codes in status.h. */
enum {
    DBSP_EIO = 100,       /* an I/O call failed; dbsp_storage_errno() holds the errno */
    DBSP_ENOSPC = 101,    /* the device is full */
    DBSP_ECORRUPT = 102,  /* an on-disk structure failed its checksum or validity rule */
    DBSP_EFORMAT = 103,   /* an on-disk structure has an unknown format version */
    DBSP_ECRASHED = 104,  /* the fault VFS simulated a crash; every later operation fails */
    DBSP_ESTATE = 105,    /* the object is closed or failed and must be reopened */
    DBSP_ENOTFOUND = 106, /* the requested version, table or record does not exist */
    DBSP_EBUSY = 107,     /* another open object holds the file's OS lock (a second writer would lose data) */
    DBSP_ENOTSUP = 108    /* the file system does not support the operation (hole punching) */
};

/* Records a formatted message for the calling thread and returns `status` (so callers can `return dbsp_storage_fail(...)`). */
int dbsp_storage_fail(int status, int err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* The last message recorded on this thread ("" if none). */
const char *dbsp_storage_errmsg(void);
/* The errno recorded with the last failure on this thread (0 if none). */
int dbsp_storage_errno(void);
/* Maps an errno value to DBSP_ENOSPC, DBSP_ENOTSUP (EOPNOTSUPP) or DBSP_EIO. */
int dbsp_storage_status_of_errno(int err);

#endif
