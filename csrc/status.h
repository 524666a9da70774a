/* status.h: the int status codes every csrc kernel returns (0 = success). */
#ifndef DBSP_STATUS_H
#define DBSP_STATUS_H

enum {
    DBSP_OK = 0,
    DBSP_ENOMEM = 1,     /* allocation failed */
    DBSP_EOVERFLOW = 2,  /* a weight (or an integer sum) left the int64 range */
    DBSP_EINVAL = 3,     /* an argument violates the kernel's contract */
    DBSP_ETYPE = 4,      /* unsupported or mismatched column type */
    DBSP_ETOOBIG = 5     /* a value or batch exceeds a format limit */
};

#endif
