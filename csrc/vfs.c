/* vfs.c: the POSIX I/O table and a fault-injecting wrapper modelled on SQLite's test6.c crash layer.
 *
 * Fault model (the fault VFS):
 *  1. Every counted operation increments its fault VFS's counter (model 6); operation `crash_at` does not run and instead
 *     "crashes": for every file with unsynced writes (open or already closed), the writes are undone in reverse
 *     order (restoring the remembered pre-images and the synced size), then a subset chosen by the damage mode
 *     is re-applied in order, possibly torn. From then on every operation fails with DBSP_ECRASHED.
 *  2. fsync is a barrier: it forgets the file's remembered writes. A truncate of a file with no remembered write is
 *     also treated as durable (a simplification: the page store never truncates, the step log fsyncs right after it
 *     does, and a streamed file truncates its new temporary file); a truncate of one with remembered writes is
 *     remembered as they are (with the bytes it cut), undone at a crash and kept or not as a write is, never torn.
 *     A punched hole is remembered as a write of zeros. A file opened with DBSP_VFS_ADOPT (a merge's scratch file,
 *     written through a shared mapping: batchfile.py invariant 7) is remembered as one write of all its bytes over
 *     an empty synced file, and as created: until an fsync, a crash may drop, tear or remove it.
 *  3. Operation `error_at` fails once with the armed errno (EIO, ENOSPC or EOPNOTSUPP) and has no effect.
 *  4. Creating a file and renaming one are not durable until the directory is fsynced: at a crash (in every
 *     mode but keep; at random in reorder and chaos) an undurable rename is undone and an undurable new file
 *     is removed. Unlinks are treated as durable once they return, and so is a rename over an existing file
 *     (also when the renamed file was new: the existing name is replaced atomically, never left absent).
 *  5. A crash leaves the open descriptors and mappings of the files it damages as they were: each damaged file is
 *     rebuilt in a new file renamed over its name (the damage applied there), so a mapping of the old one (a merge's
 *     scratch output, a batch file) never faults with SIGBUS on a page the crash cut away; the process is over for
 *     the model anyway (every later operation fails) and the next open reads the names.
 *  6. Each fault VFS is a model of its own: the process-wide one (dbsp_vfs_fault) and each one dbsp_vfs_fault_new
 *     makes (a pipeline's or a store's, in tests) count, arm, crash and remember writes apart, so the operations of
 *     another pipeline of the process (one an earlier test left to the collector, whose files a finalizer
 *     unlinks) or of another thread through another instance never take a number of the one a test enumerates.
 *     Within one instance the numbering is the order its operations take its lock, over every thread using it.
 */
#include "vfs.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/file.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---------- helpers ---------- */

char *dbsp_path_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    return p;
}

char *dbsp_path_dirname(const char *path) {
    const char *slash = strrchr(path, '/');
    if (!slash) return strdup(".");
    if (slash == path) return strdup("/");
    return strndup(path, (size_t)(slash - path));
}

static int lock_fd(int fd, int exclusive, const char *path, const char *what) {
    if (flock(fd, (exclusive ? LOCK_EX : LOCK_SH) | LOCK_NB) == 0) return DBSP_OK;
    if (errno == EWOULDBLOCK)
        return dbsp_storage_fail(DBSP_EBUSY, EWOULDBLOCK, "%s %s is in use: another open %s holds its lock (a "
                                 "second writer would lose committed writes, a reader could see pages being "
                                 "rewritten); close the other one first", what, path, what);
    return dbsp_storage_fail(DBSP_EIO, errno, "%s %s: flock: %s", what, path, strerror(errno));
}

int dbsp_vfs_lock(DbspFile *f, int exclusive, const char *what) { return lock_fd(f->fd, exclusive, f->path, what); }

int dbsp_dir_lock(const char *dir, int exclusive, const char *what, int *out) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return dbsp_storage_fail(dbsp_storage_status_of_errno(errno), errno, "%s %s: open: %s", what, dir,
                                         strerror(errno));
    int rc = lock_fd(fd, exclusive, dir, what);
    if (rc) { close(fd); return rc; }
    *out = fd;
    return DBSP_OK;
}

void dbsp_dir_unlock(int fd) {
    if (fd >= 0) close(fd); /* releases the lock */
}

int dbsp_vfs_read_exact(DbspFile *f, void *buf, size_t len, uint64_t off, const char *what) {
    size_t n = 0;
    int rc = f->vfs->pread(f, buf, len, off, &n);
    if (rc) return rc;
    if (n != len)
        return dbsp_storage_fail(DBSP_ECORRUPT, 0, "%s: %s truncated: wanted %zu bytes at offset %llu, file has %zu",
                                 f->path, what, len, (unsigned long long)off, n);
    return DBSP_OK;
}

static int io_fail(int err, const char *op, const char *path) {
    return dbsp_storage_fail(dbsp_storage_status_of_errno(err), err, "%s %s: %s", op, path, strerror(err));
}

/* ---------- POSIX ---------- */

static int px_open(DbspVfs *vfs, const char *path, int flags, DbspFile **out) {
    int oflags = ((flags & DBSP_VFS_READONLY) ? O_RDONLY : O_RDWR) | O_CLOEXEC;
    if (flags & DBSP_VFS_CREATE) oflags |= O_CREAT;
    if (flags & DBSP_VFS_EXCL) oflags |= O_EXCL;
    int fd;
    do fd = open(path, oflags, 0644); while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        if (errno == ENOENT && !(flags & DBSP_VFS_CREATE))
            return dbsp_storage_fail(DBSP_ENOTFOUND, ENOENT, "open %s: no such file", path);
        return io_fail(errno, "open", path);
    }
    DbspFile *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        free(f);
        close(fd);
        return dbsp_storage_fail(DBSP_ENOMEM, ENOMEM, "open %s: out of memory", path);
    }
    f->vfs = vfs;
    f->fd = fd;
    *out = f;
    return DBSP_OK;
}

static int px_close(DbspFile *f) {
    if (!f) return DBSP_OK;
    close(f->fd);
    free(f->path);
    free(f);
    return DBSP_OK;
}

static int px_pread(DbspFile *f, void *buf, size_t len, uint64_t off, size_t *nread) {
    size_t done = 0;
    while (done < len) {
        ssize_t n = pread(f->fd, (char *)buf + done, len - done, (off_t)(off + done));
        if (n < 0) {
            if (errno == EINTR) continue;
            return io_fail(errno, "pread", f->path);
        }
        if (n == 0) break;
        done += (size_t)n;
    }
    *nread = done;
    return DBSP_OK;
}

static int px_pwrite(DbspFile *f, const void *buf, size_t len, uint64_t off) {
    size_t done = 0;
    while (done < len) {
        ssize_t n = pwrite(f->fd, (const char *)buf + done, len - done, (off_t)(off + done));
        if (n < 0) {
            if (errno == EINTR) continue;
            return io_fail(errno, "pwrite", f->path);
        }
        done += (size_t)n;
    }
    return DBSP_OK;
}

static int px_fsync(DbspFile *f) {
    if (fdatasync(f->fd) != 0) return io_fail(errno, "fsync", f->path);
    return DBSP_OK;
}

static int px_size(DbspFile *f, uint64_t *out) {
    struct stat st;
    if (fstat(f->fd, &st) != 0) return io_fail(errno, "fstat", f->path);
    *out = (uint64_t)st.st_size;
    return DBSP_OK;
}

static int px_truncate(DbspFile *f, uint64_t size) {
    if (ftruncate(f->fd, (off_t)size) != 0) return io_fail(errno, "ftruncate", f->path);
    return DBSP_OK;
}

static int px_fsync_dir(DbspVfs *vfs, const char *dirpath) {
    int fd = open(dirpath, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return io_fail(errno, "open directory", dirpath);
    int rc = fsync(fd) != 0 ? io_fail(errno, "fsync directory", dirpath) : DBSP_OK;
    close(fd);
    return rc;
}

static int px_rename(DbspVfs *vfs, const char *from, const char *to) {
    if (rename(from, to) != 0) return io_fail(errno, "rename", from);
    return DBSP_OK;
}

static int px_unlink(DbspVfs *vfs, const char *path) {
    if (unlink(path) != 0) {
        if (errno == ENOENT) return DBSP_OK;
        return io_fail(errno, "unlink", path);
    }
    return DBSP_OK;
}

static int px_punch(DbspFile *f, uint64_t off, uint64_t len) {
#ifdef FALLOC_FL_PUNCH_HOLE
    if (fallocate(f->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)off, (off_t)len) == 0) return DBSP_OK;
    int err = errno;
    if (err == EOPNOTSUPP || err == ENOSYS || err == EINVAL) /* no hole punching on this file system */
        return dbsp_storage_fail(DBSP_ENOTSUP, EOPNOTSUPP, "punch hole %s: not supported by its file system",
                                 f->path);
    return io_fail(err, "punch hole", f->path);
#else
    return dbsp_storage_fail(DBSP_ENOTSUP, EOPNOTSUPP, "punch hole %s: not supported here", f->path);
#endif
}

static DbspVfs posix_vfs = {"posix", px_open, px_close, px_pread, px_pwrite, px_fsync,
                            px_size, px_truncate, px_fsync_dir, px_rename, px_unlink, px_punch};

DbspVfs *dbsp_vfs_posix(void) { return &posix_vfs; }

/* ---------- fault injection ---------- */

typedef struct PendingWrite {
    uint64_t off;         /* a truncate: the size it set */
    size_t len;           /* a truncate: 0 */
    size_t old_len;       /* bytes of the pre-image that existed in the file (the rest was past EOF); a truncate:
                           * the bytes it cut */
    unsigned char *data;  /* len new bytes followed by old_len pre-image bytes */
    int trunc;            /* a truncate (of a file with unsynced writes), not a write */
} PendingWrite;

typedef struct FaultState {    /* the unsynced state of one path */
    char *path;
    uint64_t synced_size;
    PendingWrite *w;
    size_t n, cap;
    int open_count;
    int created;          /* created since its directory was last fsynced */
    char *renamed_from;   /* renamed from this path since its directory was last fsynced */
    struct FaultState *next;
} FaultState;

typedef struct FaultVfs {     /* one fault VFS (model 6): its own counter, arming and remembered writes */
    DbspVfs base;             /* first: the DbspVfs * of a fault VFS (and every DbspFile's vfs) is its FaultVfs */
    pthread_mutex_t mu;
    uint64_t ops, crash_at, error_at, seed;
    int mode, err, crashed;
    FaultState *files;
} FaultVfs;

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void state_forget(FaultState *s) {
    for (size_t i = 0; i < s->n; i++) free(s->w[i].data);
    s->n = 0;
}

static FaultState *state_get(FaultVfs *fv, const char *path, int fd) {
    for (FaultState *s = fv->files; s; s = s->next)
        if (strcmp(s->path, path) == 0) return s;
    FaultState *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->path = strdup(path);
    struct stat st;
    s->synced_size = fstat(fd, &st) == 0 ? (uint64_t)st.st_size : 0;
    s->next = fv->files;
    fv->files = s;
    return s;
}

static void fault_free_all(FaultVfs *fv) {
    while (fv->files) {
        FaultState *s = fv->files;
        fv->files = s->next;
        state_forget(s);
        free(s->w);
        free(s->path);
        free(s->renamed_from);
        free(s);
    }
}

/* Applies the damage mode to every remembered write of every path of fv (fault_do_crash, below); caller holds fv->mu. */
/* A copy of `path` in a new file (its name: *tmp, malloc'd), open read-write; -1 when it cannot be made. */
static int copy_to_new(const char *path, char **tmp) {
    int in = open(path, O_RDONLY | O_CLOEXEC);
    if (in < 0) return -1;
    size_t n = strlen(path);
    char *t = malloc(n + 8);
    int out = -1;
    if (t) {
        memcpy(t, path, n);
        memcpy(t + n, ".crash~", 8);
        out = open(t, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    }
    char buf[1 << 16];
    ssize_t r = 0;
    while (out >= 0 && (r = read(in, buf, sizeof buf)) > 0)
        if (write(out, buf, (size_t)r) != r) r = -1;
    close(in);
    if (out >= 0 && r < 0) {
        close(out);
        unlink(t);
        out = -1;
    }
    if (out < 0) free(t);
    else *tmp = t;
    return out;
}

static void fault_do_crash(FaultVfs *fv, int mode, uint64_t seed) {
    uint64_t rng = seed * 0x9E3779B97F4A7C15ull + 1;
    for (FaultState *s = fv->files; s; s = s->next) {
        if (s->n == 0 || !s->path[0]) continue;
        char *tmp = NULL;
        int fd = copy_to_new(s->path, &tmp); /* model 5: the damage goes to a new file, renamed over the name */
        if (fd < 0) continue;
        for (size_t i = s->n; i-- > 0;) { /* undo, newest first */
            PendingWrite *w = &s->w[i];
            if (w->old_len && pwrite(fd, w->data + w->len, w->old_len, (off_t)w->off) < 0) break;
        }
        if (ftruncate(fd, (off_t)s->synced_size) != 0) { /* best effort */ }
        for (size_t i = 0; i < s->n; i++) {
            PendingWrite *w = &s->w[i];
            size_t keep = w->trunc ? 1 : w->len; /* a truncate is kept or not, never torn */
            switch (mode) {
            case DBSP_CRASH_DROP: keep = 0; break;
            case DBSP_CRASH_TEAR:
                if (i + 1 == s->n)
                    keep = w->trunc || !w->len ? (size_t)(rng_next(&rng) & 1) : (size_t)(rng_next(&rng) % w->len);
                break;
            case DBSP_CRASH_REORDER: keep = (rng_next(&rng) & 1) ? keep : 0; break;
            case DBSP_CRASH_CHAOS: {
                uint64_t r = rng_next(&rng) % 3;
                keep = r == 0 ? 0 : r == 1 || w->trunc || !w->len ? keep : (size_t)(rng_next(&rng) % w->len);
                break;
            }
            default: break;
            }
            if (keep && w->trunc) {
                if (ftruncate(fd, (off_t)w->off) != 0) break;
            } else if (keep && pwrite(fd, w->data, keep, (off_t)w->off) < 0) break;
        }
        close(fd);
        if (rename(tmp, s->path) != 0) unlink(tmp);
        free(tmp);
        state_forget(s);
    }
    for (FaultState *s = fv->files; s; s = s->next) { /* then the directory entries */
        if (!s->path[0] || mode == DBSP_CRASH_KEEP) continue;
        int undo = (mode == DBSP_CRASH_REORDER || mode == DBSP_CRASH_CHAOS) ? (int)(rng_next(&rng) & 1) : 1;
        if (!undo) continue;
        if (s->renamed_from && rename(s->path, s->renamed_from) == 0) {
            free(s->path);
            s->path = s->renamed_from;
            s->renamed_from = NULL;
        }
        if (s->created) unlink(s->path);
    }
    fv->crashed = 1;
}

/* Counts one operation of `fv`; returns nonzero (with the message set) if it must not run. Caller holds fv->mu. */
static int fault_tick(FaultVfs *fv, const char *op, const char *path) {
    if (fv->crashed) return dbsp_storage_fail(DBSP_ECRASHED, EIO, "%s %s: simulated crash already happened", op, path);
    fv->ops++;
    if (fv->crash_at && fv->ops == fv->crash_at) {
        fault_do_crash(fv, fv->mode, fv->seed);
        return dbsp_storage_fail(DBSP_ECRASHED, EIO, "%s %s: simulated crash at operation %llu", op, path,
                                 (unsigned long long)fv->ops);
    }
    if (fv->error_at && fv->ops == fv->error_at)
        return dbsp_storage_fail(dbsp_storage_status_of_errno(fv->err), fv->err,
                                 "%s %s: injected %s at operation %llu", op, path, strerror(fv->err),
                                 (unsigned long long)fv->ops);
    return 0;
}

/* Declares `fv` (the FaultVfs of `vfs_`), locks it and counts the operation; returns its refusal, unlocked. */
#define FAULT_GUARD(vfs_, op, path)                  \
    FaultVfs *fv = (FaultVfs *)(vfs_);               \
    pthread_mutex_lock(&fv->mu);                     \
    int guard_rc_ = fault_tick(fv, op, path);        \
    if (guard_rc_) {                                 \
        pthread_mutex_unlock(&fv->mu);               \
        return guard_rc_;                            \
    }

static int fault_remember(FaultState *s, PendingWrite w) {
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 16;
        PendingWrite *p = realloc(s->w, cap * sizeof *p);
        if (!p) return DBSP_ENOMEM;
        s->w = p;
        s->cap = cap;
    }
    s->w[s->n++] = w;
    return DBSP_OK;
}

/* DBSP_VFS_ADOPT (model 2): every byte of the file is one unsynced write over an empty file, the file created. */
static int fault_adopt(FaultState *s, DbspFile *f) {
    struct stat st;
    if (fstat(f->fd, &st) != 0) return io_fail(errno, "fstat", f->path);
    size_t len = (size_t)st.st_size, got = 0;
    unsigned char *data = malloc(len + 1);
    if (!data) return dbsp_storage_fail(DBSP_ENOMEM, ENOMEM, "open %s: out of memory in fault VFS", f->path);
    int rc = px_pread(f, data, len, 0, &got);
    if (!rc && got != len) rc = dbsp_storage_fail(DBSP_EIO, EIO, "open %s: changed while adopted", f->path);
    state_forget(s);
    s->synced_size = 0;
    s->created = 1;
    if (!rc && len && fault_remember(s, (PendingWrite){0, len, 0, data, 0}) == DBSP_OK) data = NULL;
    else if (!rc && len) rc = dbsp_storage_fail(DBSP_ENOMEM, ENOMEM, "open %s: out of memory in fault VFS", f->path);
    free(data);
    return rc;
}

static int ft_open(DbspVfs *vfs, const char *path, int flags, DbspFile **out) {
    FAULT_GUARD(vfs, "open", path);
    int existed = access(path, F_OK) == 0;
    int rc = px_open(vfs, path, flags & ~DBSP_VFS_ADOPT, out);
    if (rc == DBSP_OK) {
        FaultState *s = state_get(fv, path, (*out)->fd);
        if (s) {
            s->open_count++;
            if (!existed) s->created = 1;
        }
        if (s && (flags & DBSP_VFS_ADOPT)) rc = fault_adopt(s, *out);
        if (rc) {
            px_close(*out);
            *out = NULL;
        }
    }
    pthread_mutex_unlock(&fv->mu);
    return rc;
}

static int ft_close(DbspFile *f) { /* not counted: the remembered writes outlive the descriptor */
    return px_close(f);
}

static int ft_pread(DbspFile *f, void *buf, size_t len, uint64_t off, size_t *nread) {
    FAULT_GUARD(f->vfs, "pread", f->path);
    int rc = px_pread(f, buf, len, off, nread);
    pthread_mutex_unlock(&fv->mu);
    return rc;
}

static int ft_pwrite(DbspFile *f, const void *buf, size_t len, uint64_t off) {
    FAULT_GUARD(f->vfs, "pwrite", f->path);
    int rc = DBSP_ENOMEM;
    FaultState *s = state_get(fv, f->path, f->fd);
    unsigned char *data = malloc(len * 2 + 1);
    if (!s || !data) goto out;
    memcpy(data, buf, len);
    size_t old_len = 0;
    if ((rc = px_pread(f, data + len, len, off, &old_len)) != DBSP_OK) goto out;
    if ((rc = fault_remember(s, (PendingWrite){off, len, old_len, data, 0})) != DBSP_OK) goto out;
    if ((rc = px_pwrite(f, buf, len, off)) != DBSP_OK) { s->n--; goto out; }
    data = NULL;
out:
    free(data);
    pthread_mutex_unlock(&fv->mu);
    if (rc == DBSP_ENOMEM) dbsp_storage_fail(rc, ENOMEM, "pwrite %s: out of memory in fault VFS", f->path);
    return rc;
}

static void fault_mark_synced(FaultVfs *fv, DbspFile *f) {
    FaultState *s = state_get(fv, f->path, f->fd);
    if (!s) return;
    state_forget(s);
    struct stat st;
    if (fstat(f->fd, &st) == 0) s->synced_size = (uint64_t)st.st_size;
}

static int ft_fsync(DbspFile *f) { /* no real fsync: durability is what the model says it is */
    FAULT_GUARD(f->vfs, "fsync", f->path);
    fault_mark_synced(fv, f);
    pthread_mutex_unlock(&fv->mu);
    return DBSP_OK;
}

static int ft_size(DbspFile *f, uint64_t *out) {
    FAULT_GUARD(f->vfs, "size", f->path);
    int rc = px_size(f, out);
    pthread_mutex_unlock(&fv->mu);
    return rc;
}

static int ft_truncate(DbspFile *f, uint64_t size) {
    FAULT_GUARD(f->vfs, "truncate", f->path);
    FaultState *s = state_get(fv, f->path, f->fd);
    int rc = DBSP_OK;
    if (s && s->n) { /* model 2: remembered with the bytes it cuts */
        uint64_t cur = 0;
        unsigned char *cut = NULL;
        size_t got = 0;
        if (!(rc = px_size(f, &cur)) && cur > size) {
            if (!(cut = malloc((size_t)(cur - size))))
                rc = dbsp_storage_fail(DBSP_ENOMEM, ENOMEM, "truncate %s: out of memory in fault VFS", f->path);
            else rc = px_pread(f, cut, (size_t)(cur - size), size, &got);
        }
        if (!rc && fault_remember(s, (PendingWrite){size, 0, got, cut, 1}) != DBSP_OK)
            rc = dbsp_storage_fail(DBSP_ENOMEM, ENOMEM, "truncate %s: out of memory in fault VFS", f->path);
        else if (!rc && (rc = px_truncate(f, size))) s->n--;
        if (rc) free(cut);
    } else if ((rc = px_truncate(f, size)) == DBSP_OK) fault_mark_synced(fv, f);
    pthread_mutex_unlock(&fv->mu);
    return rc;
}

static int ft_punch(DbspFile *f, uint64_t off, uint64_t len) { /* model 2: a write of zeros */
    FAULT_GUARD(f->vfs, "punch hole", f->path);
    FaultState *s = state_get(fv, f->path, f->fd);
    uint64_t cur = 0;
    int rc = px_size(f, &cur);
    size_t n = !rc && off < cur ? (size_t)((off + len < cur ? off + len : cur) - off) : 0;
    unsigned char *data = n ? calloc(1, 2 * n) : NULL;
    size_t got = 0;
    if (!rc && (!s || (n && !data)))
        rc = dbsp_storage_fail(DBSP_ENOMEM, ENOMEM, "punch hole %s: out of memory in fault VFS", f->path);
    if (!rc && n) rc = px_pread(f, data + n, n, off, &got);
    if (!rc) rc = px_punch(f, off, len);
    if (!rc && n && fault_remember(s, (PendingWrite){off, n, got, data, 0}) != DBSP_OK)
        rc = dbsp_storage_fail(DBSP_ENOMEM, ENOMEM, "punch hole %s: out of memory in fault VFS (the hole is made)",
                               f->path);
    else if (!rc && n) data = NULL;
    free(data);
    pthread_mutex_unlock(&fv->mu);
    return rc;
}

static int ft_fsync_dir(DbspVfs *vfs, const char *dirpath) {
    FAULT_GUARD(vfs, "fsync directory", dirpath);
    for (FaultState *s = fv->files; s; s = s->next) {
        char *d = s->path[0] ? dbsp_path_dirname(s->path) : NULL;
        if (d && strcmp(d, dirpath) == 0) {
            s->created = 0;
            free(s->renamed_from);
            s->renamed_from = NULL;
        }
        free(d);
    }
    pthread_mutex_unlock(&fv->mu);
    return DBSP_OK;
}

static int ft_rename(DbspVfs *vfs, const char *from, const char *to) {
    FAULT_GUARD(vfs, "rename", from);
    int target_existed = access(to, F_OK) == 0;
    int rc = px_rename(vfs, from, to);
    if (rc == DBSP_OK) {
        for (FaultState *s = fv->files; s; s = s->next) { /* the target's old state is gone; the source moves */
            if (strcmp(s->path, to) == 0) { state_forget(s); s->synced_size = 0; s->path[0] = 0; }
        }
        for (FaultState *s = fv->files; s; s = s->next) {
            if (strcmp(s->path, from) == 0) {
                char *p = strdup(to);
                if (p) {
                    free(s->renamed_from);
                    s->renamed_from = target_existed ? NULL : s->path;  /* over an existing file: durable */
                    if (target_existed) {
                        free(s->path);
                        s->created = 0; /* the name existed: a crash leaves it (old or new), never removes it */
                    }
                    s->path = p;
                }
            }
        }
    }
    pthread_mutex_unlock(&fv->mu);
    return rc;
}

static int ft_unlink(DbspVfs *vfs, const char *path) {
    FAULT_GUARD(vfs, "unlink", path);
    int rc = px_unlink(vfs, path);
    if (rc == DBSP_OK)
        for (FaultState *s = fv->files; s; s = s->next)
            if (strcmp(s->path, path) == 0) { state_forget(s); s->path[0] = 0; }
    pthread_mutex_unlock(&fv->mu);
    return rc;
}

#define FAULT_TABLE {"fault", ft_open, ft_close, ft_pread, ft_pwrite, ft_fsync, \
                     ft_size, ft_truncate, ft_fsync_dir, ft_rename, ft_unlink, ft_punch}

static FaultVfs fault_vfs = {FAULT_TABLE, PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, 0, 0, EIO, 0, NULL};

DbspVfs *dbsp_vfs_fault(void) { return &fault_vfs.base; }

DbspVfs *dbsp_vfs_fault_new(void) {
    static const DbspVfs table = FAULT_TABLE;
    FaultVfs *fv = calloc(1, sizeof *fv);
    if (!fv) return NULL;
    fv->base = table;
    fv->err = EIO;
    if (pthread_mutex_init(&fv->mu, NULL) != 0) {
        free(fv);
        return NULL;
    }
    return &fv->base;
}

void dbsp_vfs_fault_arm(DbspVfs *vfs, uint64_t crash_at, int mode, uint64_t seed, uint64_t error_at,
                        int error_errno) {
    FaultVfs *fv = (FaultVfs *)vfs;
    pthread_mutex_lock(&fv->mu);
    fault_free_all(fv);
    fv->ops = 0;
    fv->crash_at = crash_at;
    fv->mode = mode;
    fv->seed = seed;
    fv->error_at = error_at;
    fv->err = error_errno ? error_errno : EIO;
    fv->crashed = 0;
    pthread_mutex_unlock(&fv->mu);
}

uint64_t dbsp_vfs_fault_ops(DbspVfs *vfs) {
    FaultVfs *fv = (FaultVfs *)vfs;
    pthread_mutex_lock(&fv->mu);
    uint64_t n = fv->ops;
    pthread_mutex_unlock(&fv->mu);
    return n;
}

int dbsp_vfs_fault_crashed(DbspVfs *vfs) {
    FaultVfs *fv = (FaultVfs *)vfs;
    pthread_mutex_lock(&fv->mu);
    int c = fv->crashed;
    pthread_mutex_unlock(&fv->mu);
    return c;
}

void dbsp_vfs_fault_crash_now(DbspVfs *vfs, int mode, uint64_t seed) {
    FaultVfs *fv = (FaultVfs *)vfs;
    pthread_mutex_lock(&fv->mu);
    if (!fv->crashed) fault_do_crash(fv, mode, seed);
    pthread_mutex_unlock(&fv->mu);
}
