/* storage_status.c: the thread-local error message and errno behind every failing storage status. */
#include "storage_status.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>

static _Thread_local char err_msg[512];
static _Thread_local int err_errno;

int dbsp_storage_fail(int status, int err, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err_msg, sizeof err_msg, fmt, ap);
    va_end(ap);
    err_errno = err;
    return status;
}

const char *dbsp_storage_errmsg(void) { return err_msg; }

int dbsp_storage_errno(void) { return err_errno; }

int dbsp_storage_status_of_errno(int err) {
    return err == ENOSPC || err == EDQUOT ? DBSP_ENOSPC : err == EOPNOTSUPP ? DBSP_ENOTSUP : DBSP_EIO;
}
