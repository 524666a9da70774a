/* groupdecode.c: see groupdecode.h. The Arrow IPC message layout read here (Message.fbs, Schema.fbs of the Arrow
 * format): an encapsulated message is 0xFFFFFFFF, an int32 metadata length L (a multiple of 8), L bytes of a
 * flatbuffer Message {version: short, header_type: ubyte, header: table, bodyLength: long, custom_metadata}, then the
 * body; header_type 3 is a RecordBatch {length: long, nodes: [FieldNode {length: long, null_count: long}], buffers:
 * [Buffer {offset: long, length: long}], compression: table, variadicBufferCounts: [long]}, with one node a column
 * and, a column, its buffers in order (validity, then values; or validity, offsets, values). A flatbuffer table at t
 * starts with an int32 soffset to its vtable (at t - soffset): u16 vtable bytes, u16 table bytes, a u16 offset a
 * field from t (0: absent); an offset field holds a u32 forward offset from itself; a vector a u32 count then its
 * elements. Every position is checked against the metadata's L bytes before it is read. */
#include "groupdecode.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "crc32c.h"
#include "le.h"
#include "spillread.h"

static int bad(DbspGDec *d, int64_t g, const char *what) {
    d->bad_group = g;
    snprintf(d->what, sizeof d->what, "%s", what);
    return DBSP_GDEC_DAMAGED;
}

static inline int bit(const uint8_t *v, int64_t i) { return (v[i >> 3] >> (i & 7)) & 1; }

/* ---- flatbuffers, bounds-checked against n bytes ---- */

typedef struct {
    const uint8_t *b;
    int64_t n;
} Fb;

/* The table at t: its vtable's position and size; 0 when they do not fit. */
static int fb_table(const Fb *f, int64_t t, int64_t *vt, int64_t *vtsize) {
    if (t < 0 || t > f->n - 4) return 0;
    int64_t v = t - (int64_t)(int32_t)rd32(f->b + t);
    if (v < 0 || v > f->n - 4) return 0;
    int64_t vs = rd16(f->b + v);
    if (vs < 4 || (vs & 1) || v + vs > f->n) return 0;
    *vt = v;
    *vtsize = vs;
    return 1;
}

/* Field i of the table at t (vtable vt, vs bytes) of `size` bytes: its position, 0 when absent, -1 when it does not
 * fit. */
static int64_t fb_field(const Fb *f, int64_t t, int64_t vt, int64_t vs, int i, int64_t size) {
    if (4 + 2 * i + 2 > vs) return 0;
    int64_t off = rd16(f->b + vt + 4 + 2 * i);
    if (off == 0) return 0;
    if (off < 4 || t + off > f->n - size) return -1;
    return t + off;
}

/* Where the u32 offset at p points; -1 when it does not fit `need` bytes. */
static int64_t fb_deref(const Fb *f, int64_t p, int64_t need) {
    if (p < 0 || p > f->n - 4) return -1;
    int64_t to = p + (int64_t)rd32(f->b + p);
    if (to > f->n - need) return -1;
    return to;
}

/* The vector the offset field at p names, of elements of `elem` bytes: its first element's position and *count;
 * -1 when it does not fit. */
static int64_t fb_vector(const Fb *f, int64_t p, int64_t elem, int64_t *count) {
    int64_t v = fb_deref(f, p, 4);
    if (v < 0) return -1;
    int64_t c = rd32(f->b + v);
    if (c > (f->n - v - 4) / elem) return -1;
    *count = c;
    return v + 4;
}

/* ---- one group's message ---- */

static int nbufs_of(int kind) { return kind == DBSP_GCOL_VAR32 || kind == DBSP_GCOL_VAR64 ? 3 : 2; }

/* Parse the message m[0..mlen) of group g (expected `rows` rows): fills out[0..ncols). */
static int parse_msg(DbspGDec *d, int64_t g, const uint8_t *m, int64_t mlen, int64_t rows, DbspGBuf *out) {
    if (mlen < 16 || rd32(m) != 0xFFFFFFFFu) return bad(d, g, "its message does not start with a continuation marker");
    int64_t L = (int64_t)(int32_t)rd32(m + 4);
    if (L < 8 || (L & 7) || L > mlen - 8) return bad(d, g, "its message's metadata length does not fit the slot");
    Fb f = {m + 8, L};
    int64_t vt, vs;
    int64_t root = fb_deref(&f, 0, 4);
    if (root < 0 || !fb_table(&f, root, &vt, &vs)) return bad(d, g, "its message's flatbuffer root does not fit");
    int64_t p = fb_field(&f, root, vt, vs, 1, 1);
    if (p < 0) return bad(d, g, "its message's header type does not fit");
    if (p == 0 || f.b[p] != 3) return DBSP_GDEC_UNSUPPORTED; /* not a record batch */
    int64_t pb = fb_field(&f, root, vt, vs, 3, 8);
    if (pb <= 0) return bad(d, g, "its message's body length is missing or does not fit");
    int64_t body_len = (int64_t)rd64(f.b + pb);
    if (body_len < 0 || body_len != mlen - 8 - L)
        return bad(d, g, "its message's metadata and body lengths are not the Arrow footer's block");
    const uint8_t *body = m + 8 + L;
    p = fb_field(&f, root, vt, vs, 2, 4);
    if (p <= 0) return bad(d, g, "its message has no record batch header");
    int64_t rb = fb_deref(&f, p, 4), rvt, rvs;
    if (rb < 0 || !fb_table(&f, rb, &rvt, &rvs)) return bad(d, g, "its record batch table does not fit");
    p = fb_field(&f, rb, rvt, rvs, 3, 4);
    if (p < 0) return bad(d, g, "its record batch's compression field does not fit");
    if (p > 0) return DBSP_GDEC_UNSUPPORTED; /* a compressed body */
    p = fb_field(&f, rb, rvt, rvs, 4, 4);
    if (p < 0) return bad(d, g, "its record batch's variadic counts do not fit");
    if (p > 0) {
        int64_t nv;
        if (fb_vector(&f, p, 8, &nv) < 0) return bad(d, g, "its record batch's variadic counts do not fit");
        if (nv) return DBSP_GDEC_UNSUPPORTED;
    }
    p = fb_field(&f, rb, rvt, rvs, 0, 8);
    if (p < 0) return bad(d, g, "its record batch's length does not fit");
    int64_t len = p ? (int64_t)rd64(f.b + p) : 0;
    if (len != rows) return bad(d, g, "its record batch does not hold the rows its index entry names");
    int64_t nn, nb;
    p = fb_field(&f, rb, rvt, rvs, 1, 4);
    int64_t nodes = p > 0 ? fb_vector(&f, p, 16, &nn) : -1;
    p = fb_field(&f, rb, rvt, rvs, 2, 4);
    int64_t bufs = p > 0 ? fb_vector(&f, p, 16, &nb) : -1;
    if (nodes < 0 || bufs < 0) return bad(d, g, "its record batch's nodes or buffers do not fit");
    int64_t want = 0;
    for (int c = 0; c < d->ncols; c++) want += nbufs_of(d->kind[c]);
    if (nn != d->ncols || nb != want) return bad(d, g, "its record batch's nodes or buffers are not its schema's");
    /* the writer's layout, exactly: each buffer at the 8-byte boundary after the one before, the body their span, so
     * that a damaged offset or length reads no other buffer's bytes */
    int64_t at = 0;
    for (int64_t j = 0; j < nb; j++) {
        const uint8_t *e = f.b + bufs + 16 * j;
        int64_t off = (int64_t)rd64(e), blen = (int64_t)rd64(e + 8);
        if (off != at || blen < 0 || blen > body_len - off)
            return bad(d, g, "a buffer's offset or length is not where the buffer before it ends");
        at = off + ((blen + 7) & ~(int64_t)7);
    }
    if (at != body_len) return bad(d, g, "its buffers do not span its message body");
    int64_t bi = 0;
    for (int c = 0; c < d->ncols; c++) {
        const uint8_t *node = f.b + nodes + 16 * c;
        int64_t nlen = (int64_t)rd64(node), nnull = (int64_t)rd64(node + 8);
        if (nlen != rows || nnull < 0 || nnull > rows) return bad(d, g, "a column's length or null count is wrong");
        const uint8_t *bp[3];
        int64_t bl[3];
        int k = nbufs_of(d->kind[c]);
        for (int j = 0; j < k; j++, bi++) {
            const uint8_t *e = f.b + bufs + 16 * bi;
            int64_t off = (int64_t)rd64(e), blen = (int64_t)rd64(e + 8);
            if (off < 0 || blen < 0 || off > body_len || blen > body_len - off)
                return bad(d, g, "a buffer's offset or length does not fit the message body");
            bp[j] = body + off;
            bl[j] = blen;
        }
        DbspGBuf *o = &out[c];
        o->valid = NULL;
        o->offs = NULL;
        if (nnull > 0) { /* the bitmap's nulls are its null count (the writer omits the bitmap of no nulls) */
            if (bl[0] < (rows + 7) / 8) return bad(d, g, "a validity bitmap is shorter than its rows");
            int64_t set = 0, r = 0;
            for (; r + 8 <= rows; r += 8) set += __builtin_popcount(bp[0][r >> 3]);
            for (; r < rows; r++) set += bit(bp[0], r);
            if (rows - set != nnull) return bad(d, g, "a column's null count is not its validity bitmap's");
            o->valid = bp[0];
        } else if (bl[0] != 0) {
            return bad(d, g, "a column of no nulls has a validity bitmap");
        }
        switch (d->kind[c]) {
        case DBSP_GCOL_FIXED:
            if (bl[1] / d->width[c] < rows) return bad(d, g, "a column's values are shorter than its rows");
            break;
        case DBSP_GCOL_BOOL:
            if (bl[1] < (rows + 7) / 8) return bad(d, g, "a boolean column's bits are shorter than its rows");
            break;
        default: {
            int64_t w = d->kind[c] == DBSP_GCOL_VAR32 ? 4 : 8;
            if (bl[1] / w < rows + 1) return bad(d, g, "a column's offsets are shorter than its rows");
            o->offs = bp[1];
            bp[1] = bp[2];
            bl[1] = bl[2];
        }
        }
        o->data = bp[1];
        o->data_len = bl[1];
    }
    return DBSP_GDEC_OK;
}

static int pick(DbspGDec *d, int32_t g, int32_t r) {
    if (d->nrows == d->sel_cap) {
        int64_t cap = d->sel_cap ? 2 * d->sel_cap : 4096;
        int32_t *a = realloc(d->sel_g, (size_t)cap * sizeof *a);
        if (!a) return DBSP_GDEC_NOMEM;
        d->sel_g = a;
        a = realloc(d->sel_r, (size_t)cap * sizeof *a);
        if (!a) return DBSP_GDEC_NOMEM;
        d->sel_r = a;
        d->sel_cap = cap;
    }
    d->sel_g[d->nrows] = g;
    d->sel_r[d->nrows++] = r;
    return DBSP_GDEC_OK;
}

/* The reads' buffer: a thread's own, kept between calls up to the keep limit (a lookup's ~1,000 slots: no fresh
 * pages to fault and zero a call; SCRATCH_KEEP, lowered by dbsp_gdec_keep_limit: a memory budget's share); a larger
 * one is the call's (*own set). A thread's kept buffer above a lowered limit is freed at its next call. */
#define SCRATCH_KEEP ((size_t)32 << 20)
static _Atomic size_t keep_limit = SCRATCH_KEEP;
static __thread uint8_t *scratch_buf;
static __thread size_t scratch_cap;

size_t dbsp_gdec_keep_limit(size_t limit) { return atomic_exchange(&keep_limit, limit); }

static uint8_t *scratch(size_t n, int *own) {
    size_t keep = atomic_load_explicit(&keep_limit, memory_order_relaxed);
    *own = 0;
    if (scratch_cap > keep) {
        free(scratch_buf);
        scratch_buf = NULL;
        scratch_cap = 0;
    }
    if (n > keep) {
        *own = 1;
        return malloc(n);
    }
    if (n > scratch_cap) {
        free(scratch_buf);
        size_t cap = (size_t)1 << 20;
        if (cap > keep) cap = keep;
        if (cap < n) cap = n;
        scratch_buf = malloc(cap);
        scratch_cap = scratch_buf ? cap : 0;
    }
    return scratch_buf;
}

int dbsp_gdec_scan(DbspGDec *d, int64_t ng, const int64_t *slot_of, const int64_t *nslots, const int64_t *msg_len,
                   const int64_t *rows, const uint64_t *first_hash, const uint64_t *hashes, int64_t nh) {
    int64_t G = d->slot;
    d->nrows = 0;
    d->bad_group = -1;
    d->bad_page = -1;
    d->what[0] = 0;
    d->pages_checked = 0;
    for (int c = 0; c < d->ncols; c++) d->var_bytes[c] = d->nulls[c] = 0;
    if (d->khcol < 0 || d->khcol >= d->ncols || d->kind[d->khcol] != DBSP_GCOL_FIXED || d->width[d->khcol] != 8)
        return DBSP_GDEC_UNSUPPORTED;
    for (int c = 0; c < d->ncols; c++)
        if (d->kind[c] < DBSP_GCOL_FIXED || d->kind[c] > DBSP_GCOL_VAR64 ||
            (d->kind[c] == DBSP_GCOL_FIXED && d->width[c] <= 0))
            return DBSP_GDEC_UNSUPPORTED;
    if (ng <= 0) return DBSP_GDEC_OK;
    if (ng > INT32_MAX) return DBSP_GDEC_NOMEM;
    int64_t *boff = malloc((size_t)(ng + 1) * sizeof *boff);
    const uint8_t **gp = NULL; /* each group's bytes: in the mapping, or in the reads' buffer */
    if (!boff) return DBSP_GDEC_NOMEM;
    int st = DBSP_GDEC_OK;
    /* where each group's slots go in the buffer: [slot * G, min(end of the Arrow section, (slot + slots) * G)) */
    boff[0] = 0;
    for (int64_t i = 0; i < ng; i++) {
        int64_t lo = slot_of[i] * G, hi = (slot_of[i] + nslots[i]) * G;
        if (hi > d->arrow_end) hi = d->arrow_end;
        if (slot_of[i] < 1 || nslots[i] < 1 || hi <= lo || msg_len[i] > hi - lo || msg_len[i] < 0 ||
            slot_of[i] >= d->npages) {
            st = bad(d, i, "its slots do not fit the Arrow section");
            goto out;
        }
        /* a group whose slots are all checked: its message only (the slot's gap not copied) */
        int64_t pend = (hi + G - 1) / G, pg = slot_of[i];
        while (pg < pend && pg < d->npages && d->checked[pg]) pg++;
        boff[i + 1] = boff[i] + (pg == pend ? msg_len[i] : hi - lo);
    }
    gp = malloc((size_t)ng * sizeof *gp);
    d->bufs = malloc((size_t)ng * (size_t)d->ncols * sizeof *d->bufs);
    if (!gp || !d->bufs) {
        st = DBSP_GDEC_NOMEM;
        goto out;
    }
    /* the reads' pages asked for first when the caller says the file is cold (d->advise): one WILLNEED a run */
    for (int64_t i = 0; d->advise && i < ng;) {
        int64_t j = i + 1;
        while (j < ng && slot_of[j] * G == slot_of[j - 1] * G + (boff[j] - boff[j - 1])) j++;
        (void)posix_fadvise(d->fd, (off_t)(slot_of[i] * G), (off_t)(boff[j] - boff[i]), POSIX_FADV_WILLNEED);
        i = j;
    }
    if (d->map) { /* in place: each group's bytes within the mapping, checked before a byte is read; units flagged */
        uintptr_t u0 = (uintptr_t)d->map >> DBSP_GDEC_UNIT_SHIFT;
        for (int64_t i = 0; i < ng; i++) {
            int64_t at = slot_of[i] * G, n = boff[i + 1] - boff[i];
            if (at > d->map_len || n > d->map_len - at) {
                d->bad_group = i;
                st = DBSP_GDEC_SHORT;
                goto out;
            }
            gp[i] = d->map + at;
            if (d->units && n > 0) {
                int64_t a = (int64_t)(((uintptr_t)gp[i] >> DBSP_GDEC_UNIT_SHIFT) - u0);
                int64_t b = (int64_t)(((uintptr_t)(gp[i] + n - 1) >> DBSP_GDEC_UNIT_SHIFT) - u0);
                for (int64_t u = a; u <= b && u < d->nunits; u++) d->units[u] = 1;
            }
        }
    } else {
        uint8_t *buf = d->buf = scratch((size_t)boff[ng] + 8, &d->buf_own);
        if (!buf) {
            st = DBSP_GDEC_NOMEM;
            goto out;
        }
        for (int64_t i = 0; i < ng; i++) gp[i] = buf + boff[i];
        /* the reads: a pread a run of adjacent groups */
        for (int64_t i = 0; i < ng;) {
            int64_t j = i + 1;
            while (j < ng && slot_of[j] * G == slot_of[j - 1] * G + (boff[j] - boff[j - 1])) j++;
            int64_t at = slot_of[i] * G, want = boff[j] - boff[i], got = 0;
            while (got < want) {
                ssize_t r = pread(d->fd, buf + boff[i] + got, (size_t)(want - got), (off_t)(at + got));
                if (r < 0) {
                    if (errno == EINTR) continue;
                    d->err = errno;
                    d->bad_group = i;
                    st = DBSP_GDEC_IOERR;
                    goto out;
                }
                if (r == 0) {
                    d->bad_group = i;
                    st = DBSP_GDEC_SHORT;
                    goto out;
                }
                got += r;
            }
            i = j;
        }
    }
    /* the CRC of every slot not checked yet (invariant G2), before a byte of it is decoded */
    for (int64_t i = 0; i < ng; i++) {
        int64_t n = boff[i + 1] - boff[i];
        for (int64_t k = 0; k * G < n; k++) {
            int64_t pg = slot_of[i] + k;
            if (pg >= d->npages) {
                st = bad(d, i, "its slots lie past the CRC pages");
                goto out;
            }
            if (d->checked[pg]) continue;
            int64_t len = n - k * G < G ? n - k * G : G;
            if (dbsp_crc32c(0, gp[i] + k * G, (size_t)len) != d->page_crcs[pg]) {
                d->bad_group = i;
                d->bad_page = pg;
                st = DBSP_GDEC_CRC;
                goto out;
            }
            d->checked[pg] = 1;
            d->pages_checked++;
        }
    }
    /* parse, check G1, pick */
    int64_t j = 0;
    for (int64_t i = 0; i < ng; i++) {
        DbspGBuf *gb = d->bufs + i * d->ncols;
        if (rows[i] < 1 || rows[i] > INT32_MAX) {
            st = bad(d, i, "its index entry names no rows");
            goto out;
        }
        st = parse_msg(d, i, gp[i], msg_len[i], rows[i], gb);
        if (st != DBSP_GDEC_OK) goto out;
        const DbspGBuf *k = &gb[d->khcol];
        if (k->valid) {
            st = bad(d, i, "its key hash column has nulls");
            goto out;
        }
        const uint8_t *kp = k->data;
        uint64_t prev = rd64(kp);
        if (prev != first_hash[i]) {
            st = bad(d, i, "its first key hash is not its index entry's");
            goto out;
        }
        if (nh >= 0) { /* hashes[j] is the first probed hash >= this group's first (probes and groups ascend) */
            int64_t lo = 0, hi = nh;
            while (lo < hi) {
                int64_t mid = lo + (hi - lo) / 2;
                if (hashes[mid] < prev) lo = mid + 1; else hi = mid;
            }
            j = lo;
        }
        int64_t start = d->nrows, fg = d->gid ? d->gid[i] : i, nr = rows[i];
        if (!d->verified || !d->verified[fg]) { /* its key hashes ascend (G1), checked branch-free, once a group */
            int down = 0;
            for (int64_t r = 1; r < nr; r++) down |= rd64(kp + 8 * r) < rd64(kp + 8 * (r - 1));
            if (down) {
                st = bad(d, i, "its key hashes do not ascend");
                goto out;
            }
            if (d->verified) d->verified[fg] = 1; /* the file does not change: a later read need not check again */
        }
        if (nh < 0) {
            for (int64_t r = 0; r < nr; r++)
                if ((st = pick(d, (int32_t)i, (int32_t)r)) != DBSP_GDEC_OK) goto out;
        } else { /* each probed hash in the group's range found by binary search from where the last one's rows end */
            uint64_t top = rd64(kp + 8 * (nr - 1));
            int64_t r = 0;
            for (; j < nh && hashes[j] <= top; j++) {
                int64_t a = r, b = nr;
                while (a < b) {
                    int64_t mid = a + (b - a) / 2;
                    if (rd64(kp + 8 * mid) < hashes[j]) a = mid + 1; else b = mid;
                }
                for (r = a; r < nr && rd64(kp + 8 * r) == hashes[j]; r++)
                    if ((st = pick(d, (int32_t)i, (int32_t)r)) != DBSP_GDEC_OK) goto out;
            }
        }
        /* the picked rows' offsets and nulls */
        for (int c = 0; c < d->ncols; c++) {
            const DbspGBuf *b = &gb[c];
            for (int64_t s = start; s < d->nrows; s++) {
                int64_t r = d->sel_r[s];
                if (b->valid && !bit(b->valid, r)) d->nulls[c]++;
                if (b->offs) {
                    int64_t o0, o1;
                    if (d->kind[c] == DBSP_GCOL_VAR32) {
                        o0 = (int32_t)rd32(b->offs + 4 * r);
                        o1 = (int32_t)rd32(b->offs + 4 * r + 4);
                    } else {
                        o0 = (int64_t)rd64(b->offs + 8 * r);
                        o1 = (int64_t)rd64(b->offs + 8 * r + 8);
                    }
                    if (o0 < 0 || o1 < o0 || o1 > b->data_len) {
                        st = bad(d, i, "a value's offsets do not fit its column");
                        goto out;
                    }
                    d->var_bytes[c] += o1 - o0;
                }
            }
        }
    }
    for (int c = 0; c < d->ncols; c++)
        if (d->kind[c] == DBSP_GCOL_VAR32 && d->var_bytes[c] > INT32_MAX) {
            st = DBSP_GDEC_UNSUPPORTED; /* more than a 32-bit offset: Arrow's path */
            goto out;
        }
out:
    free(boff);
    free(gp);
    return st;
}

void dbsp_gdec_fill(DbspGDec *d, uint8_t **valid, uint8_t **data, uint8_t **vals) {
    int64_t n = d->nrows, nc = d->ncols;
    const int32_t *sg = d->sel_g, *sr = d->sel_r;
    for (int c = 0; c < nc; c++) {
        if (valid[c]) {
            uint8_t *v = valid[c];
            for (int64_t s = 0; s < n; s++) {
                const DbspGBuf *b = d->bufs + (int64_t)sg[s] * nc + c;
                if (!b->valid || bit(b->valid, sr[s])) v[s >> 3] |= (uint8_t)(1u << (s & 7));
            }
        }
        uint8_t *out = data[c];
        switch (d->kind[c]) {
        case DBSP_GCOL_FIXED: {
            int64_t w = d->width[c];
            if (w == 8) {
                for (int64_t s = 0; s < n; s++)
                    memcpy(out + 8 * s, d->bufs[(int64_t)sg[s] * nc + c].data + 8 * (int64_t)sr[s], 8);
            } else {
                for (int64_t s = 0; s < n; s++)
                    memcpy(out + w * s, d->bufs[(int64_t)sg[s] * nc + c].data + w * (int64_t)sr[s], (size_t)w);
            }
            break;
        }
        case DBSP_GCOL_BOOL:
            for (int64_t s = 0; s < n; s++)
                if (bit(d->bufs[(int64_t)sg[s] * nc + c].data, sr[s])) out[s >> 3] |= (uint8_t)(1u << (s & 7));
            break;
        default: {
            int wide = d->kind[c] == DBSP_GCOL_VAR64;
            int64_t at = 0;
            uint8_t *vo = vals[c];
            for (int64_t s = 0; s < n; s++) {
                const DbspGBuf *b = d->bufs + (int64_t)sg[s] * nc + c;
                int64_t r = sr[s], o0, o1;
                if (wide) {
                    wr64(out + 8 * s, (uint64_t)at);
                    o0 = (int64_t)rd64(b->offs + 8 * r);
                    o1 = (int64_t)rd64(b->offs + 8 * r + 8);
                } else {
                    wr32(out + 4 * s, (uint32_t)at);
                    o0 = (int32_t)rd32(b->offs + 4 * r);
                    o1 = (int32_t)rd32(b->offs + 4 * r + 4);
                }
                if (o1 > o0) memcpy(vo + at, b->data + o0, (size_t)(o1 - o0)); /* checked by the scan */
                at += o1 - o0;
            }
            if (wide) wr64(out + 8 * n, (uint64_t)at); else wr32(out + 4 * n, (uint32_t)at);
        }
        }
    }
}

void dbsp_gdec_free(DbspGDec *d) {
    if (d->buf_own) free(d->buf);
    d->buf_own = 0;
    free(d->bufs);
    free(d->sel_g);
    free(d->sel_r);
    d->buf = NULL;
    d->bufs = NULL;
    d->sel_g = d->sel_r = NULL;
    d->sel_cap = 0;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

int dbsp_gdec_lookup(DbspGDec *d, const uint64_t *bloom, int64_t nwords, int k, int64_t ngroups,
                     const uint64_t *first_hash, const int64_t *slot_of, const int64_t *nslots,
                     const int64_t *msg_len, const int64_t *rows, const uint64_t *hashes, int64_t m) {
    d->nrows = 0;
    d->bad_group = -1;
    d->bad_page = -1;
    d->what[0] = 0;
    d->pages_checked = 0;
    d->groups_read = 0;
    for (int c = 0; c < d->ncols; c++) d->var_bytes[c] = d->nulls[c] = 0;
    if (m <= 0 || ngroups <= 0) return DBSP_GDEC_OK;
    if (nwords < 1 || (nwords & (nwords - 1))) return bad(d, -1, "its Bloom filter is not a power of two of words");
    int st = DBSP_GDEC_OK;
    uint64_t *h = malloc((size_t)m * sizeof *h);
    uint8_t *may = malloc((size_t)m);
    int64_t *gl = malloc((size_t)m * 5 * sizeof *gl);
    uint64_t *gfirst = malloc((size_t)m * sizeof *gfirst);
    if (!h || !may || !gl || !gfirst) {
        st = DBSP_GDEC_NOMEM;
        goto out;
    }
    /* the probed hashes: those the filter may hold, ascending and unique */
    dbsp_bloom_probe(bloom, (size_t)nwords, k, hashes, (size_t)m, may);
    int64_t n = 0;
    for (int64_t i = 0; i < m; i++)
        if (may[i]) h[n++] = hashes[i];
    if (n) qsort(h, (size_t)n, sizeof *h, cmp_u64);
    int64_t u = 0;
    for (int64_t i = 0; i < n; i++)
        if (u == 0 || h[i] != h[u - 1]) h[u++] = h[i];
    /* each one's group: the last whose first key hash is not above it (invariant G3); none: below the batch */
    int64_t ng = 0, lo = 0, last = -1;
    for (int64_t i = 0; i < u; i++) {
        int64_t a = lo, b = ngroups; /* the first group whose first hash is above h[i], searched from the last one */
        while (a < b) {
            int64_t mid = a + (b - a) / 2;
            if (first_hash[mid] <= h[i]) a = mid + 1; else b = mid;
        }
        lo = a;
        int64_t g = a - 1;
        if (g >= 0 && g != last) gl[ng++] = last = g;
    }
    int64_t *s_slot = gl + m, *s_nslots = gl + 2 * m, *s_len = gl + 3 * m, *s_rows = gl + 4 * m;
    for (int64_t i = 0; i < ng; i++) {
        int64_t g = gl[i];
        s_slot[i] = slot_of[g];
        s_nslots[i] = nslots[g];
        s_len[i] = msg_len[g];
        s_rows[i] = rows[g];
        gfirst[i] = first_hash[g];
    }
    d->groups_read = ng;
    d->gid = gl;
    st = dbsp_gdec_scan(d, ng, s_slot, s_nslots, s_len, s_rows, gfirst, h, u);
    if (st != DBSP_GDEC_OK && d->bad_group >= 0 && d->bad_group < ng) d->bad_group = gl[d->bad_group];
out:
    free(h);
    free(may);
    free(gl);
    free(gfirst);
    return st;
}
