/* cdata.c: DbspColumn views of record batches exported through the Arrow C data interface (see cdata.h). */
#include <string.h>
#include "cdata.h"
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
    if (f[0] != 't') return 0;
    /* temporal: date32 and time32 are 32-bit, date64, time64, timestamps and durations 64-bit (bindings' rule) */
    if (strcmp(f, "tdD") == 0 || strcmp(f, "tts") == 0 || strcmp(f, "ttm") == 0) return DBSP_DATE32;
    if (strcmp(f, "tdm") == 0 || strcmp(f, "ttu") == 0 || strcmp(f, "ttn") == 0) return DBSP_TIMESTAMP;
    if (f[1] == 's' && strchr("smun", f[2]) && f[2] && f[3] == ':') return DBSP_TIMESTAMP;  /* tss:, tsm:UTC, ... */
    if (f[1] == 'D' && f[2] && strchr("smun", f[2]) && !f[3]) return DBSP_TIMESTAMP;          /* tDs, tDm, ... */
    return 0;
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
