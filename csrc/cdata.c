/* cdata.c: DbspColumn views of record batches exported through the Arrow C data interface (see cdata.h). */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include "cdata.h"
#include "gather.h"
#include "scratch.h"
#include "status.h"

static int has_extension_name(const char *metadata) {
    /* metadata: int32 count, then per pair int32 key length, key bytes, int32 value length, value bytes */
    if (!metadata) return 0;
    int32_t n;
    const char *p = metadata;
    memcpy(&n, p, 4); p += 4;
    for (int32_t i = 0; i < n; i++) {
        int32_t kl, vl;
        memcpy(&kl, p, 4); p += 4;
        if (kl == 20 && memcmp(p, "ARROW:extension:name", 20) == 0) return 1;
        p += kl;
        memcpy(&vl, p, 4); p += 4 + vl;
    }
    return 0;
}

int32_t dbsp_cdata_type(const struct ArrowSchema *s) {
    const char *f = s->format;
    if (!f || s->dictionary || has_extension_name(s->metadata)) return 0;
    if (f[0] && !f[1]) {
        switch (f[0]) {
        case 'b': return DBSP_BOOL;
        case 'c': return DBSP_INT8;
        case 'C': return DBSP_UINT8;
        case 's': return DBSP_INT16;
        case 'S': return DBSP_UINT16;
        case 'i': return DBSP_INT32;
        case 'I': return DBSP_UINT32;
        case 'l': return DBSP_INT64;
        case 'L': return DBSP_UINT64;
        case 'f': return DBSP_FLOAT32;
        case 'g': return DBSP_FLOAT64;
        case 'u': return DBSP_UTF8;
        case 'U': return DBSP_LARGE_UTF8;
        case 'z': return DBSP_BINARY;
        case 'Z': return DBSP_LARGE_BINARY;
        default: return 0;
        }
    }
    if (f[0] == 'd' && f[1] == ':') {  /* decimal64 ("d:p,s,64"): its unscaled value, an int64 (column.h invariant 4) */
        size_t n = strlen(f);
        return n > 3 && strcmp(f + n - 3, ",64") == 0 ? DBSP_INT64 : 0;
    }
    if (f[0] != 't') return 0;
    /* temporal: date32 and time32 are 32-bit, date64, time64, timestamps and durations 64-bit (bindings' rule) */
    if (strcmp(f, "tdD") == 0 || strcmp(f, "tts") == 0 || strcmp(f, "ttm") == 0) return DBSP_DATE32;
    if (strcmp(f, "tdm") == 0 || strcmp(f, "ttu") == 0 || strcmp(f, "ttn") == 0) return DBSP_TIMESTAMP;
    if (f[1] == 's' && strchr("smun", f[2]) && f[2] && f[3] == ':') return DBSP_TIMESTAMP;  /* tss:, tsm:UTC, ... */
    if (f[1] == 'D' && f[2] && strchr("smun", f[2]) && !f[3]) return DBSP_TIMESTAMP;          /* tDs, tDm, ... */
    return 0;
}

int dbsp_cdata_same_type(const struct ArrowSchema *t, int64_t k, const struct ArrowSchema *s, int32_t col) {
    if (k < 0 || k >= t->n_children || col < 0 || col >= s->n_children) return 0;
    const struct ArrowSchema *a = t->children[k], *b = s->children[col];
    if (!a->format || !b->format || a->dictionary || b->dictionary) return 0;
    if (has_extension_name(a->metadata) || has_extension_name(b->metadata)) return 0;
    return strcmp(a->format, b->format) == 0;
}

int dbsp_cdata_view(const struct ArrowSchema *s, const struct ArrowArray *a, int32_t ncols, DbspColumn *cols,
                    int64_t *nrows, const uint8_t *empty, int32_t *bad) {
    *bad = -1;
    if (!s->format || strcmp(s->format, "+s") != 0 || s->n_children != ncols || a->n_children != ncols)
        return DBSP_EINVAL;
    *nrows = a->length;
    for (int32_t k = 0; k < ncols; k++) {
        const struct ArrowSchema *cs = s->children[k];
        const struct ArrowArray *ca = a->children[k];
        int32_t t = dbsp_cdata_type(cs);
        if (t == 0) { *bad = k; return DBSP_ETYPE; }
        int var = dbsp_type_class(t) == DBSP_CLASS_BYTES;
        if (ca->n_buffers != (var ? 3 : 2) || ca->length < a->offset + a->length) return DBSP_EINVAL;
        const void *const *b = ca->buffers;
        cols[k].type = t;
        cols[k].offset = ca->offset + a->offset;
        cols[k].validity = (ca->null_count != 0 && b[0]) ? (const uint8_t *)b[0] : NULL;
        cols[k].values = b[1] ? b[1] : (const void *)empty;
        cols[k].data = var ? (b[2] ? (const uint8_t *)b[2] : empty) : NULL;
    }
    return DBSP_OK;
}

/* ---- export of gathered rows (invariant 4) ---- */

typedef struct {
    const void *bufs[3];
    void *owned[3];
} ChildPriv;

static void release_child(struct ArrowArray *a) {
    ChildPriv *p = a->private_data;
    for (int i = 0; i < 3; i++) free(p->owned[i]);
    free(p);
    a->release = NULL;
}

typedef struct {
    const void *bufs[1];
    struct ArrowArray *kids;       /* the children, contiguous */
    struct ArrowArray **kid_ptrs;
    int64_t n;
} RootPriv;

static void release_root(struct ArrowArray *a) {
    RootPriv *p = a->private_data;
    for (int64_t k = 0; k < p->n; k++)
        if (p->kids[k].release) p->kids[k].release(&p->kids[k]);
    free(p->kids); free(p->kid_ptrs); free(p);
    a->release = NULL;
}

static int gather_child(const DbspColumn *c, int64_t nrows, const int64_t *idx, int64_t m, struct ArrowArray *out) {
    int var = dbsp_type_class(c->type) == DBSP_CLASS_BYTES;
    int64_t vbytes;
    if (c->type == DBSP_BOOL) vbytes = (m + 7) / 8;
    else if (var) vbytes = (m + 1) * ((c->type == DBSP_LARGE_UTF8 || c->type == DBSP_LARGE_BINARY) ? 8 : 4);
    else vbytes = m * dbsp_type_width(c->type);
    ChildPriv *p = calloc(1, sizeof *p);
    int64_t *src = NULL, nulls = 0, nbytes = 0;
    int st = DBSP_ENOMEM;
    if (!p) return DBSP_ENOMEM;
    p->owned[1] = malloc((size_t)(vbytes ? vbytes : 1));
    if (c->validity) p->owned[0] = malloc((size_t)((m + 7) / 8 + 1));
    if (var) src = malloc((size_t)(m ? m : 1) * 8);
    if (!p->owned[1] || (c->validity && !p->owned[0]) || (var && !src)) goto fail;
    if ((st = dbsp_gather_column(c, idx, m, p->owned[0], p->owned[1], src, &nulls, &nbytes))) goto fail;
    if (var) {
        st = DBSP_ENOMEM;
        if (!(p->owned[2] = malloc((size_t)nbytes + 16))) goto fail;
        if ((st = dbsp_gather_data(c, nrows, m, p->owned[1], src, p->owned[2]))) goto fail;
    }
    free(src);
    if (nulls == 0) { free(p->owned[0]); p->owned[0] = NULL; }
    for (int i = 0; i < 3; i++) p->bufs[i] = p->owned[i];
    memset(out, 0, sizeof *out);
    out->length = m;
    out->null_count = nulls;
    out->n_buffers = var ? 3 : 2;
    out->buffers = p->bufs;
    out->release = release_child;
    out->private_data = p;
    return DBSP_OK;
fail:
    free(src);
    for (int i = 0; i < 3; i++) free(p->owned[i]);
    free(p);
    return st;
}

/* *out as the struct array of a record batch of m rows (invariant 1) with children kids[0..n) */
static void root_of(struct ArrowArray *out, int64_t m, int64_t n, struct ArrowArray **kids, const void **bufs,
                    void (*release)(struct ArrowArray *), void *priv) {
    memset(out, 0, sizeof *out);
    out->length = m;
    out->n_buffers = 1;
    out->buffers = bufs;  /* no validity: a record batch has no null rows */
    out->n_children = n;
    out->children = kids;
    out->release = release;
    out->private_data = priv;
}

/* dbsp_cdata_gather2 with room for `extra` more children after the gathered ones (p->n counts the gathered) */
static int gather_root(const DbspBatch *a, const int32_t *acols, int32_t na, const int64_t *aidx,
                       const DbspBatch *b, const int32_t *bcols, int32_t nb, const int64_t *bidx, int64_t m,
                       int32_t extra, struct ArrowArray *out) {
    int64_t n = (int64_t)na + (b ? nb : 0);
    RootPriv *p = calloc(1, sizeof *p);
    if (!p) return DBSP_ENOMEM;
    p->kids = calloc((size_t)(n + extra ? n + extra : 1), sizeof(struct ArrowArray));
    p->kid_ptrs = calloc((size_t)(n + extra ? n + extra : 1), sizeof(struct ArrowArray *));
    if (!p->kids || !p->kid_ptrs) { free(p->kids); free(p->kid_ptrs); free(p); return DBSP_ENOMEM; }
    for (int64_t k = 0; k < n; k++) {
        const DbspBatch *src = k < na ? a : b;
        const int32_t *cols = k < na ? acols : bcols;
        int64_t j = k < na ? k : k - na;
        int32_t c = cols ? cols[j] : (int32_t)j;
        int st = (c < 0 || c >= src->ncols) ? DBSP_EINVAL
               : gather_child(&src->cols[c], src->nrows, k < na ? aidx : bidx, m, &p->kids[k]);
        if (st) {
            p->n = k;
            struct ArrowArray tmp = { .private_data = p };
            release_root(&tmp);
            return st;
        }
        p->kid_ptrs[k] = &p->kids[k];
    }
    p->n = n;
    root_of(out, m, n, p->kid_ptrs, p->bufs, release_root, p);
    return DBSP_OK;
}

int dbsp_cdata_gather2(const DbspBatch *a, const int32_t *acols, int32_t na, const int64_t *aidx,
                       const DbspBatch *b, const int32_t *bcols, int32_t nb, const int64_t *bidx, int64_t m,
                       struct ArrowArray *out) {
    return gather_root(a, acols, na, aidx, b, bcols, nb, bidx, m, 0, out);
}

int dbsp_cdata_gather_ints(const DbspBatch *a, const int32_t *acols, int32_t na, const int64_t *aidx, int64_t m,
                           int32_t ni, int64_t *const *ivals, uint8_t *const *ivalid, const int64_t *inulls,
                           struct ArrowArray *out) {
    ChildPriv **cp = calloc((size_t)(ni ? ni : 1), sizeof *cp);
    int st = DBSP_ENOMEM;
    if (!cp) return st;
    for (int32_t k = 0; k < ni; k++)  /* allocate first: nothing can fail once the buffers are taken */
        if (!(cp[k] = calloc(1, sizeof(ChildPriv)))) goto fail;
    if ((st = gather_root(a, acols, na, aidx, NULL, NULL, 0, NULL, m, ni, out))) goto fail;
    RootPriv *p = out->private_data;
    for (int32_t k = 0; k < ni; k++) {
        struct ArrowArray *c = &p->kids[p->n];
        cp[k]->owned[0] = inulls[k] ? ivalid[k] : NULL;
        cp[k]->owned[1] = ivals[k];
        if (!inulls[k]) free(ivalid[k]);  /* no nulls: no validity buffer */
        for (int i = 0; i < 3; i++) cp[k]->bufs[i] = cp[k]->owned[i];
        memset(c, 0, sizeof *c);
        c->length = m;
        c->null_count = inulls[k];
        c->n_buffers = 2;
        c->buffers = cp[k]->bufs;
        c->release = release_child;
        c->private_data = cp[k];
        p->kid_ptrs[p->n++] = c;
    }
    out->n_children = p->n;
    free(cp);
    return DBSP_OK;
fail:
    for (int32_t k = 0; k < ni; k++) free(cp[k]);
    free(cp);
    return st;
}

int dbsp_cdata_gather(const DbspBatch *b, const int64_t *idx, int64_t m, struct ArrowArray *out) {
    return dbsp_cdata_gather2(b, NULL, b->ncols, idx, NULL, NULL, 0, NULL, m, out);
}

/* ---- exports from a share (invariant 5) ---- */

struct DbspCDataShare {
    _Atomic int64_t refs;
    int32_t n, cap;
    void *bufs[];
};

DbspCDataShare *dbsp_cdata_share_new(int32_t cap) {
    DbspCDataShare *sh = malloc(sizeof *sh + (size_t)(cap > 0 ? cap : 1) * sizeof(void *));
    if (!sh) return NULL;
    atomic_init(&sh->refs, 1);
    sh->n = 0;
    sh->cap = cap;
    return sh;
}

void dbsp_cdata_share_drop(DbspCDataShare *sh) {
    if (!sh || atomic_fetch_sub(&sh->refs, 1) != 1) return;
    for (int32_t i = 0; i < sh->n; i++) free(sh->bufs[i]);
    free(sh);
}

int dbsp_cdata_share_take(DbspCDataShare *sh, void *buf) {
    if (!buf) return DBSP_OK;
    if (sh->n >= sh->cap) return DBSP_ENOMEM;
    sh->bufs[sh->n++] = buf;
    return DBSP_OK;
}

int dbsp_cdata_share_gather(DbspCDataShare *sh, const DbspColumn *c, int64_t nrows, const int64_t *idx, int64_t m,
                            DbspCDataCol *col) {
    struct ArrowArray a;
    if (sh->n + 3 > sh->cap) return DBSP_ENOMEM;
    int st = gather_child(c, nrows, idx, m, &a);
    if (st != DBSP_OK) return st;
    ChildPriv *p = a.private_data;
    for (int i = 0; i < 3; i++) {
        (void)dbsp_cdata_share_take(sh, p->owned[i]);  /* room checked above */
        col->bufs[i] = p->bufs[i];
    }
    col->null_count = a.null_count;
    col->n_buffers = (int32_t)a.n_buffers;
    col->own[0] = col->own[1] = NULL;  /* the share's: both batches show a key column */
    free(p);
    return DBSP_OK;
}

typedef struct {
    const void *bufs[1];
    struct ArrowArray *kids;
    struct ArrowArray **kid_ptrs;
    const void **kid_bufs;  /* 3 a child */
    DbspCDataShare *sh;
} SharePriv;

typedef struct {
    DbspCDataShare *sh;
    void *own[2];
} OwnPriv;

static void release_share_child(struct ArrowArray *a) {
    OwnPriv *p = a->private_data;
    dbsp_cdata_share_drop(p->sh);
    free(p->own[0]); free(p->own[1]); free(p);
    a->release = NULL;
}

static void release_share_root(struct ArrowArray *a) {
    SharePriv *p = a->private_data;
    for (int64_t k = 0; k < a->n_children; k++)
        if (p->kids[k].release) p->kids[k].release(&p->kids[k]);
    free(p->kids); free(p->kid_ptrs); free(p->kid_bufs); free(p);
    a->release = NULL;
}

int dbsp_cdata_share_export(DbspCDataShare *sh, int32_t ncols, const DbspCDataCol *cols, int64_t m,
                            struct ArrowArray *out) {
    size_t nk = (size_t)(ncols > 0 ? ncols : 1);
    SharePriv *p = calloc(1, sizeof *p);
    if (!p) return DBSP_ENOMEM;
    p->kids = calloc(nk, sizeof(struct ArrowArray));
    p->kid_ptrs = malloc(nk * sizeof(struct ArrowArray *));
    p->kid_bufs = malloc(nk * 3 * sizeof(void *));
    int ok = p->kids && p->kid_ptrs && p->kid_bufs;
    for (int32_t k = 0; ok && k < ncols; k++)  /* allocate first: nothing can fail once the buffers are taken */
        ok = (p->kids[k].private_data = malloc(sizeof(OwnPriv))) != NULL;
    if (!ok) {
        for (int32_t k = 0; p->kids && k < ncols; k++) free(p->kids[k].private_data);
        free(p->kids); free(p->kid_ptrs); free(p->kid_bufs); free(p);
        return DBSP_ENOMEM;
    }
    p->sh = sh;
    for (int32_t k = 0; k < ncols; k++) {
        struct ArrowArray *c = &p->kids[k];
        OwnPriv *op = c->private_data;
        op->sh = sh;
        op->own[0] = cols[k].own[0];
        op->own[1] = cols[k].own[1];
        for (int i = 0; i < 3; i++) p->kid_bufs[3 * k + i] = cols[k].bufs[i];
        c->length = m;
        c->null_count = cols[k].null_count;
        c->n_buffers = cols[k].n_buffers;
        c->buffers = &p->kid_bufs[3 * k];
        c->release = release_share_child;
        p->kid_ptrs[k] = c;
    }
    atomic_fetch_add(&sh->refs, ncols);
    root_of(out, m, ncols, p->kid_ptrs, p->bufs, release_share_root, p);
    return DBSP_OK;
}

/* ---- export of region-owned columns (a merge's output) ---- */

typedef struct {
    const void *bufs[3];
    void *owned[3];
    size_t mapped[3];
} RegionPriv;

static void release_region_child(struct ArrowArray *a) {
    RegionPriv *p = a->private_data;
    for (int i = 0; i < 3; i++) dbsp_region_free(p->owned[i], p->mapped[i]);
    free(p);
    a->release = NULL;
}

int dbsp_cdata_export_regions(int32_t ncols, const int32_t *types, int64_t n, const int64_t *null_counts,
                              void **bufs, const size_t *mapped, struct ArrowArray *out) {
    RootPriv *p = calloc(1, sizeof *p);
    if (!p) return DBSP_ENOMEM;
    p->kids = calloc((size_t)(ncols ? ncols : 1), sizeof(struct ArrowArray));
    p->kid_ptrs = calloc((size_t)(ncols ? ncols : 1), sizeof(struct ArrowArray *));
    if (!p->kids || !p->kid_ptrs) {
        free(p->kids); free(p->kid_ptrs); free(p);
        return DBSP_ENOMEM;
    }
    for (int32_t k = 0; k < ncols; k++) {  /* allocate first: nothing can fail once the regions are taken */
        RegionPriv *c = malloc(sizeof *c);
        if (!c) {
            for (int32_t j = 0; j < k; j++) free(p->kids[j].private_data);
            free(p->kids); free(p->kid_ptrs); free(p);
            return DBSP_ENOMEM;
        }
        p->kids[k].private_data = c;
    }
    for (int32_t k = 0; k < ncols; k++) {
        RegionPriv *c = p->kids[k].private_data;
        int var = dbsp_type_class(types[k]) == DBSP_CLASS_BYTES;
        for (int i = 0; i < 3; i++) {
            c->owned[i] = bufs[k * 3 + i];
            c->mapped[i] = mapped[k * 3 + i];
            c->bufs[i] = c->owned[i];
        }
        if (null_counts[k] == 0) c->bufs[0] = NULL;  /* no nulls: no validity buffer (its region is freed with it) */
        struct ArrowArray *a = &p->kids[k];
        a->length = n;
        a->null_count = null_counts[k];
        a->offset = 0;
        a->n_buffers = var ? 3 : 2;
        a->buffers = c->bufs;
        a->n_children = 0;
        a->children = NULL;
        a->dictionary = NULL;
        a->release = release_region_child;
        p->kid_ptrs[k] = a;
    }
    p->n = ncols;
    memset(out, 0, sizeof *out);
    out->length = n;
    out->n_buffers = 1;
    out->buffers = p->bufs;
    out->n_children = ncols;
    out->children = p->kid_ptrs;
    out->release = release_root;
    out->private_data = p;
    return DBSP_OK;
}
