/* split.c: the parts of strings split at a literal separator (split.h). */
#include <string.h>

#include "split.h"
#include "status.h"

/* the first match of sep in s[from, len) at or after from, or -1 */
static int64_t find_sep(const uint8_t *s, int64_t len, int64_t from, const uint8_t *sep, int64_t seplen) {
    if (seplen == 1) {  /* parts are short (URL path segments): a plain loop beats a memchr call per part */
        uint8_t b = sep[0];
        for (int64_t i = from; i < len; i++)
            if (s[i] == b) return i;
        return -1;
    }
    while (from + seplen <= len) {
        const uint8_t *p = memchr(s + from, sep[0], (size_t)(len - seplen + 1 - from));
        if (p == NULL) return -1;
        int64_t at = p - s;
        if (seplen == 1 || memcmp(p + 1, sep + 1, (size_t)(seplen - 1)) == 0) return at;
        from = at + 1;
    }
    return -1;
}

int dbsp_split_locate(const DbspColumn *c, int64_t n, const uint8_t *sep, int64_t seplen, const int64_t *idx,
                      int32_t k, int64_t *start, int32_t *const *offsets, uint8_t *const *validity,
                      int64_t *null_count, int64_t *bytes) {
    if (c->type != DBSP_UTF8 && c->type != DBSP_BINARY) return DBSP_ETYPE;
    if (seplen < 1 || k < 1) return DBSP_EINVAL;
    int64_t top = 0;  /* the highest part wanted: the scan of a row stops there */
    for (int32_t j = 0; j < k; j++) {
        if (idx[j] < 0) return DBSP_EINVAL;
        if (idx[j] > top) top = idx[j];
        memset(validity[j], 0, (size_t)((n + 7) / 8));
        offsets[j][0] = 0;
        null_count[j] = 0;
        bytes[j] = 0;
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t len = 0;
        const uint8_t *s = dbsp_col_valid(c, i) ? dbsp_col_bytes(c, i, &len) : NULL;
        for (int32_t j = 0; j < k; j++) start[j * n + i] = -1;
        if (s != NULL) {  /* invariant 1: part `part` runs from `from` to the next match (or the end) */
            int64_t from = 0, base = s - c->data;
            for (int64_t part = 0;; part++) {
                int64_t at = find_sep(s, len, from, sep, seplen);
                int64_t end = at < 0 ? len : at;
                for (int32_t j = 0; j < k; j++) {
                    if (idx[j] == part) {
                        start[j * n + i] = base + from;
                        offsets[j][i + 1] = (int32_t)(end - from);  /* the length, made an offset below */
                    }
                }
                if (at < 0 || part == top) break;
                from = at + seplen;
            }
        }
        for (int32_t j = 0; j < k; j++) {
            int64_t l = 0;
            if (start[j * n + i] >= 0) {
                l = offsets[j][i + 1];
                validity[j][i >> 3] |= (uint8_t)(1u << (i & 7));
            } else {
                null_count[j]++;
            }
            bytes[j] += l;  /* at most the input's bytes (invariant 2): fits int32 offsets */
            offsets[j][i + 1] = (int32_t)bytes[j];
        }
    }
    return DBSP_OK;
}

int dbsp_split_copy(const DbspColumn *c, int64_t n, const int64_t *start, const int32_t *offsets, uint8_t *data) {
    if (c->type != DBSP_UTF8 && c->type != DBSP_BINARY) return DBSP_ETYPE;
    for (int64_t i = 0; i < n; i++) {
        int64_t l = (int64_t)offsets[i + 1] - offsets[i];
        if (l > 0) memcpy(data + offsets[i], c->data + start[i], (size_t)l);
    }
    return DBSP_OK;
}
