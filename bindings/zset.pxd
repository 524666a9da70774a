# zset.pxd: declarations mirroring the Z-set kernel headers of csrc/ (column, rows, hash, zset, merge, scratch, partition, join, lookup, agg, reduce, gather, split, timefmt).
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t

cdef extern from "status.h" nogil:
    enum:
        DBSP_OK
        DBSP_ENOMEM
        DBSP_EOVERFLOW
        DBSP_EINVAL
        DBSP_ETYPE
        DBSP_ETOOBIG

cdef extern from "column.h" nogil:
    enum:
        DBSP_BOOL
        DBSP_INT8
        DBSP_INT16
        DBSP_INT32
        DBSP_INT64
        DBSP_UINT8
        DBSP_UINT16
        DBSP_UINT32
        DBSP_UINT64
        DBSP_FLOAT32
        DBSP_FLOAT64
        DBSP_DATE32
        DBSP_TIMESTAMP
        DBSP_UTF8
        DBSP_LARGE_UTF8
        DBSP_BINARY
        DBSP_LARGE_BINARY

    ctypedef struct CColumn "DbspColumn":
        int32_t type
        int64_t offset
        const uint8_t *validity
        const void *values
        const uint8_t *data

    ctypedef struct CBatch "DbspBatch":
        int64_t nrows
        int32_t ncols
        const CColumn *cols
        const int64_t *weights

    int dbsp_type_width(int32_t t)

cdef extern from "rows.h" nogil:
    ctypedef struct CRows "DbspRows":
        int64_t n
        int64_t cap
        int64_t *idx
        int64_t *weights
        uint64_t *khash
    void dbsp_rows_free(CRows *r)

cdef extern from "hash.h" nogil:
    int DBSP_HASH_VERSION
    int dbsp_hash_columns(const CBatch *b, const int32_t *cols, int32_t ncols, uint64_t *out)

cdef extern from "zset.h" nogil:
    int dbsp_zset_consolidate(const CBatch *b, const int32_t *keys, int32_t nkeys, CRows *out)
    int dbsp_zset_consolidate_rh(const CBatch *b, const int32_t *keys, int32_t nkeys, CRows *out, uint64_t **rhash)
    int dbsp_zset_consolidate_runs(const CBatch *b, const uint64_t *kh, const int64_t *sel, int64_t n, CRows *out,
                                   uint64_t *orh)
    int dbsp_zset_merge(const CBatch *a, const uint64_t *akh, const CBatch *b, const uint64_t *bkh,
                        const int32_t *keys, int32_t nkeys, CRows *out)
    int dbsp_weights_negate(const int64_t *w, int64_t n, int64_t *out)
    int dbsp_zset_sum_adjacent(const CBatch *b, const uint64_t *h, int64_t *idx, int64_t *w, int64_t *n)
    int dbsp_zset_distinct(const CBatch *b, const uint64_t *rh, int64_t *idx, int64_t *w, int64_t *n)
    int dbsp_zset_hash_distinct(const CBatch *b, uint64_t *rh, int64_t *idx, int64_t *w, int64_t *n)
    int dbsp_zset_distinct_rows(const CBatch *b, int64_t *idx, int64_t *w, int64_t *n)
    int dbsp_rows_check_order(const CBatch *b, const int64_t *sel, const int64_t *weights, const uint64_t *khash,
                              int64_t n, const int32_t *keys, int32_t nkeys)
    int64_t dbsp_small_rows

cdef extern from "merge.h" nogil:
    ctypedef struct COutColumn "DbspOutColumn":
        int32_t type
        uint8_t *validity
        void *values
        uint8_t *data
        int64_t null_count
    ctypedef struct CMergeCursor "DbspMergeCursor":
        int64_t ia
        int64_t ib
        int64_t n
    void dbsp_merge_cursor_sizes(const CColumn *a, int64_t na, const CColumn *b, int64_t nb, int64_t *validity,
                                 int64_t *values, int64_t *data)
    int dbsp_merge_cursor_init(const CBatch *a, const CBatch *b, CMergeCursor *m, COutColumn *out)
    int dbsp_merge_cursor_step(const CBatch *a, const uint64_t *akh, const uint64_t *arh, const CBatch *b,
                               const uint64_t *bkh, const uint64_t *brh, const int32_t *keys, int32_t nkeys,
                               int64_t budget, CMergeCursor *m, COutColumn *out, int64_t *w, uint64_t *kh,
                               uint64_t *rh)
    void dbsp_merge_k_sizes(const CColumn *const *cols, const int64_t *n, int32_t k, int64_t *validity,
                            int64_t *values, int64_t *data)
    int dbsp_merge_k_init(const CBatch *const *inp, int32_t k, COutColumn *out)
    int dbsp_merge_k_step(const CBatch *const *inp, const uint64_t *const *kh, const uint64_t *const *rh, int32_t k,
                          const int32_t *keys, int32_t nkeys, int64_t budget, int64_t *pos, int64_t *n,
                          COutColumn *out, int64_t *w, uint64_t *okh, uint64_t *orh)

cdef extern from "scratch.h" nogil:
    void *dbsp_region_alloc(size_t nbytes, size_t *mapped)
    size_t dbsp_region_trim(void *p, size_t mapped, size_t keep)
    void dbsp_region_free(void *p, size_t mapped)
    size_t dbsp_scratch_trim(size_t keep)
    size_t dbsp_region_cache_trim(size_t keep)
    size_t dbsp_scratch_cache_limit(size_t bytes)
    size_t dbsp_region_cache_limit(size_t bytes)
    size_t dbsp_scratch_cached()
    size_t dbsp_region_cached()
    int dbsp_hugepages()
    int dbsp_malloc_trim()

cdef extern from "cdata.h" nogil:
    struct ArrowSchema:
        const char *format
        int64_t n_children
        void (*release)(ArrowSchema *)

    int dbsp_cdata_same_type(const ArrowSchema *t, int64_t k, const ArrowSchema *s, int32_t col)

    struct ArrowArray:
        int64_t length
        void (*release)(ArrowArray *)

    int32_t dbsp_cdata_type(const ArrowSchema *s)
    int dbsp_cdata_view(const ArrowSchema *s, const ArrowArray *a, int32_t ncols, CColumn *cols, int64_t *nrows,
                        const uint8_t *empty, int32_t *bad)
    int dbsp_cdata_gather(const CBatch *b, const int64_t *idx, int64_t m, ArrowArray *out)
    int dbsp_cdata_export_regions(int32_t ncols, const int32_t *types, int64_t n, const int64_t *null_counts,
                                  void **bufs, const size_t *mapped, ArrowArray *out)
    int dbsp_cdata_gather2(const CBatch *a, const int32_t *acols, int32_t na, const int64_t *aidx,
                           const CBatch *b, const int32_t *bcols, int32_t nb, const int64_t *bidx, int64_t m,
                           ArrowArray *out)

cdef extern from "fold.h" nogil:
    int dbsp_linear_fold(int64_t ng, int32_t ns, const int64_t *old, const int64_t *delta, const uint64_t *khash,
                         int64_t *grp, int64_t *w, uint64_t *kh, int64_t *vals, int64_t *n, int *ordered,
                         uint64_t *rh)

cdef extern from "keyindex.h" nogil:
    ctypedef struct CKeyIndex "DbspKeyIndex":
        pass
    int DBSP_KEYINDEX_MAX_KEYS
    int DBSP_KEYINDEX_MAX_VALS
    int dbsp_keyindex_new(const int32_t *types, int32_t nkeys, int32_t nvals, int64_t max_bytes, CKeyIndex **out)
    void dbsp_keyindex_free(CKeyIndex *ix)
    int64_t dbsp_keyindex_len(const CKeyIndex *ix)
    int64_t dbsp_keyindex_bytes(const CKeyIndex *ix)
    int dbsp_keyindex_broken(const CKeyIndex *ix)
    int64_t dbsp_keyindex_refusals(const CKeyIndex *ix)
    int dbsp_keyindex_growing(const CKeyIndex *ix)
    int64_t dbsp_keyindex_spills(const CKeyIndex *ix)
    void dbsp_keyindex_set_budget(int64_t bytes)
    void dbsp_keyindex_test_hash_bits(int32_t bits)
    int64_t dbsp_keyindex_budget()
    int64_t dbsp_keyindex_total_bytes()
    int dbsp_keyindex_get(const CKeyIndex *ix, const CBatch *b, const int32_t *keys, const int64_t *sel,
                          const uint64_t *kh, int64_t n, int64_t *acc)
    int dbsp_keyindex_add(CKeyIndex *ix, const CBatch *b, const int32_t *keys, const uint64_t *kh,
                          const int32_t *cols, int64_t sign)
    int dbsp_keyindex_get_slots(CKeyIndex *ix, const CBatch *b, const int32_t *keys, const int64_t *sel,
                                const uint64_t *kh, int64_t n, int64_t *acc, int64_t **slots)
    void dbsp_keyindex_set_slot(CKeyIndex *ix, int64_t *slot, const int64_t *vals, int64_t vstride)
    int dbsp_keyindex_add_before(CKeyIndex *ix, const CBatch *b, const int32_t *keys, const uint64_t *kh,
                                 const int32_t *cols, int64_t sign, int64_t *before)
    int dbsp_keyindex_take_back(CKeyIndex *ix, const CBatch *b, const int32_t *keys, const uint64_t *kh,
                                const int32_t *cols, int64_t sign)
    int dbsp_keyindex_put(CKeyIndex *ix, const CBatch *b, const int32_t *keys, int64_t r, uint64_t h,
                          const int64_t *vals, int64_t vstride, int64_t more)
    int dbsp_keyindex_check(const CKeyIndex *ix)
    int dbsp_keyindex_set_dir(CKeyIndex *ix, const char *dir)
    int64_t dbsp_keyindex_drop_pages(CKeyIndex *ix)
    int dbsp_keyindex_regions(const CKeyIndex *ix, void **at, size_t *len)

cdef extern from "partition.h" nogil:
    int dbsp_partition(const uint64_t *khash, int64_t n, const int32_t *part_of_shard, int shard_bits,
                       int32_t nparts, int64_t *perm, int64_t *offsets)

cdef extern from "join.h" nogil:
    ctypedef struct CPairs "DbspPairs":
        int64_t n
        int64_t cap
        int64_t *li
        int64_t *ri
        int64_t *w
    void dbsp_pairs_free(CPairs *p)
    int dbsp_join(const CBatch *a, const uint64_t *akh, const int32_t *akeys,
                  const CBatch *b, const uint64_t *bkh, const int32_t *bkeys, int32_t nkeys,
                  int left_outer, CPairs *out)
    int dbsp_join_fenced(const CBatch *a, const uint64_t *akh, const uint64_t *afence, const int32_t *akeys,
                         const CBatch *b, const uint64_t *bkh, const uint64_t *bfence, const int32_t *bkeys,
                         int32_t nkeys, int left_outer, CPairs *out)
    int dbsp_hash_join(const CBatch *a, const int32_t *akeys, const CBatch *b, const int32_t *bkeys,
                       int32_t nkeys, int left_outer, CPairs *out)

cdef extern from "lookup.h" nogil:
    int DBSP_FENCE_SHIFT
    int DBSP_DIR_MIN
    ctypedef struct CDir "DbspDir":
        const uint32_t *dir
        int32_t bits
    int32_t dbsp_dir_bits(int64_t n)
    int dbsp_dir_build(const uint64_t *kh, int64_t n, int32_t bits, uint32_t *dir)
    int64_t dbsp_dir_seek(const uint64_t *kh, const CDir *d, uint64_t h)
    int dbsp_lookup(const uint64_t *kh, int64_t n, const uint64_t *want, int64_t nwant, int64_t **idx, int64_t *nidx)
    int dbsp_lookup_fenced(const uint64_t *kh, int64_t n, const uint64_t *fence, const uint64_t *want, int64_t nwant,
                           int64_t **idx, int64_t *nidx)
    int dbsp_match_weights(const CBatch *a, const uint64_t *akh, const CBatch *b, const uint64_t *bkh, int64_t *acc)
    int dbsp_match_weights_fenced(const CBatch *a, const uint64_t *akh, const CBatch *b, const uint64_t *bkh,
                                  const uint64_t *bfence, int64_t *acc)
    int dbsp_match_weights_rh(const CBatch *a, const uint64_t *akh, const uint64_t *arh, const CBatch *b,
                              const uint64_t *bkh, const uint64_t *bfence, const uint64_t *brh, int64_t *acc)
    int dbsp_match_sums(const CBatch *a, const uint64_t *akh, const int64_t *sel, int64_t n, const int32_t *akeys,
                        const CBatch *b, const uint64_t *bkh, const uint64_t *bfence, const int32_t *bkeys,
                        int32_t nkeys, const int32_t *cols, int32_t ncols, int64_t *acc)

cdef extern from "agg.h" nogil:
    enum:
        DBSP_AGG_COUNT
        DBSP_AGG_COUNT_COL
        DBSP_AGG_SUM
        DBSP_AGG_MIN
        DBSP_AGG_MAX
    ctypedef struct CAggSpec "DbspAggSpec":
        int32_t kind
        int32_t col

cdef extern from "reduce.h" nogil:
    ctypedef struct CReduceOut "DbspReduceOut":
        int64_t ngroups
        int64_t cap
        int32_t naggs
        int64_t *group_row
        int64_t *khash
        int64_t *ivals
        double *fvals
        uint8_t *valid
    void dbsp_reduce_free(CReduceOut *r)
    int dbsp_reduce(const CBatch *b, const uint64_t *kh, const int32_t *keys, int32_t nkeys,
                    const CAggSpec *aggs, int32_t naggs, CReduceOut *out)
    int dbsp_group_reduce(const CBatch *b, const int32_t *keys, int32_t nkeys,
                          const CAggSpec *aggs, int32_t naggs, CReduceOut *out)
    int dbsp_group_reduce_all(const CBatch *b, const int32_t *keys, int32_t nkeys,
                              const CAggSpec *aggs, int32_t naggs, CReduceOut *out)

cdef extern from "gather.h" nogil:
    int dbsp_gather_check(const int64_t *idx, int64_t m, int64_t n)
    int dbsp_gather_column(const CColumn *c, const int64_t *idx, int64_t m, uint8_t *validity, void *values,
                           int64_t *src, int64_t *null_count, int64_t *data_bytes)
    int dbsp_gather_data(const CColumn *c, int64_t nrows, int64_t m, const void *offsets, const int64_t *src,
                         uint8_t *data)
    int dbsp_gather_column_at(const CColumn *c, const int64_t *idx, int64_t m, int64_t at, int64_t base,
                              uint8_t *validity, void *values, int64_t *src, int64_t *null_count,
                              int64_t *data_bytes)

cdef extern from "split.h" nogil:
    int dbsp_split_locate(const CColumn *c, int64_t n, const uint8_t *sep, int64_t seplen, const int64_t *idx,
                          int32_t k, int64_t *start, int32_t *const *offsets, uint8_t *const *validity,
                          int64_t *null_count, int64_t *bytes)
    int dbsp_split_copy(const CColumn *c, int64_t n, const int64_t *start, const int32_t *offsets, uint8_t *data)

cdef extern from "timefmt.h" nogil:
    int64_t dbsp_timefmt_width(const uint8_t *fmt, int64_t fmtlen)
    int dbsp_timefmt(const void *values, int width, const uint8_t *validity, int64_t vbit, int64_t n,
                     int64_t units_per_day, const uint8_t *fmt, int64_t fmtlen, int32_t *offsets, uint8_t *data)

cdef extern from "extremes.h" nogil:
    int dbsp_extremes_probe(CKeyIndex *ix, const CBatch *b, const uint64_t *kh, const int32_t *keys,
                            int32_t nkeys, const CAggSpec *slots, int32_t ns, int64_t *group_row, uint64_t *gkh,
                            int64_t *old, int64_t *nw, uint8_t *need, int64_t *ng, int64_t **held)
    int dbsp_extremes_probe_inserts(const CKeyIndex *ix, const CBatch *b, const int32_t *keys, int32_t nkeys,
                                    const CAggSpec *slots, int32_t ns, int64_t **group_row, uint64_t **gkh,
                                    int64_t **old, int64_t **nw, int64_t *ng)
    int dbsp_extremes_scan(const CBatch *b, const int32_t *keys, int32_t nkeys, const int64_t *rows,
                           const uint64_t *kh, int64_t n, const CBatch *const *vb, const uint64_t *const *vkh,
                           const uint64_t *const *vfence, int32_t nb, const int32_t *vkeys, int32_t vcol,
                           uint8_t *has, int64_t *mn, int64_t *mx)
    int dbsp_extremes_store(CKeyIndex *ix, const CBatch *b, const int32_t *keys, int64_t ng, int32_t nv,
                            const int64_t *group_row, const uint64_t *gkh, const int64_t *old, const int64_t *nw,
                            int64_t *grp, int64_t *w, int64_t *n)
    int dbsp_extremes_emit(CKeyIndex *ix, const CBatch *b, const int32_t *keys, int32_t nkeys, int32_t ns,
                           int32_t nv, int64_t ng, const int64_t *group_row, const uint64_t *gkh, const int64_t *old,
                           const int64_t *nw, const int32_t *snull, const int32_t *swidth, int32_t nout,
                           const int32_t *shown, const int32_t *nonnull, const int32_t *owidth,
                           ArrowArray *batch, ArrowArray *out, int64_t **w, uint64_t **kh, uint64_t **rh,
                           int64_t *n, int *ordered, int64_t **ow, int64_t *on, int64_t *const *held, int keyorder)
    int dbsp_extremes_batch(const CBatch *b, const int32_t *keys, int32_t nkeys, int32_t ns, int32_t nv, int64_t ng,
                            const int64_t *group_row, const uint64_t *gkh, const int64_t *old, const int64_t *nw,
                            const int32_t *snull, const int32_t *swidth, int keyorder, ArrowArray *batch,
                            int64_t **w, uint64_t **kh, uint64_t **rh, int64_t *n, int *ordered)

cdef extern from "linrun.h" nogil:
    ctypedef struct CLinRun "DbspLinRun":
        int found_dirty
        int keyorder
        int64_t groups
        int fused
    void dbsp_linrun_free(CLinRun *s)
    int64_t dbsp_lingroup_served()
    int dbsp_linear_apply(CKeyIndex *ix, const CBatch *b, const int32_t *keys, const CReduceOut *r, int32_t ns,
                          int64_t *old, int64_t **slots, int64_t *grp, int64_t *rows, int64_t *w, uint64_t *kh,
                          int64_t *vals, uint64_t *rh, int64_t *n, int *ordered)
    int dbsp_linear_run(CLinRun *s, const CBatch *b, const int32_t *keys, int32_t nkeys, const CAggSpec *specs,
                        int32_t ns, CKeyIndex *ix, const int32_t *shown, const int32_t *nonnull, int32_t nout,
                        int out_keys, ArrowArray *batch, ArrowArray *out, int64_t **w, uint64_t **kh,
                        int64_t *n, int *ordered, int *distinct)
    enum:
        DBSP_LINRUN_SUM_HI
        DBSP_LINRUN_SUM_LO
    int dbsp_linear_run2(CLinRun *s, const CBatch *b, const int32_t *keys, int32_t nkeys, const CAggSpec *specs,
                         int32_t ns, CKeyIndex *ix, const int32_t *shown, const int32_t *nonnull, const int32_t *avg,
                         const int32_t *avg_lo, int32_t nout, int out_keys, ArrowArray *batch, ArrowArray *out,
                         int64_t **w, uint64_t **kh, int64_t *n, int *ordered, int *distinct)
    int dbsp_linear_run3(CLinRun *s, const CBatch *b, const int32_t *keys, int32_t nkeys, const CAggSpec *specs,
                         int32_t ns, CKeyIndex *ix, const int32_t *shown, const int32_t *nonnull, const int32_t *avg,
                         const int32_t *avg_lo, int32_t nout, int out_keys, ArrowArray *batch, ArrowArray *out,
                         int64_t **w, uint64_t **kh, int64_t *n, int *ordered, int *distinct, const CKeyIndex *dirty,
                         uint8_t **fresh)

cdef extern from "joinrun.h" nogil:
    ctypedef struct CJoinRunOut "DbspJoinRunOut":
        ArrowArray change
        CColumn *cols
        int64_t n
        int64_t *w
        uint64_t *kh
        uint64_t *rh
        ArrowArray *parts
        int64_t **pw
        int64_t *pn
        int pad_met
    int dbsp_join_run(const CBatch *c, const ArrowSchema *cs, const int32_t *ckeys, int32_t nkeys, int change_left,
                      int32_t nb, const CBatch *const *bs, const uint64_t *const *bkh, const uint64_t *const *bfence,
                      const CDir *const *bdir, const int32_t *bkeys, const int32_t *lcols, int32_t nl, const int32_t *rcols, int32_t nr,
                      const CBatch *pad, CJoinRunOut *out)
    void dbsp_join_run_free(CJoinRunOut *out, int32_t nb)

cdef extern from "joinlin.h" nogil:
    ctypedef struct CJoinLinSide "DbspJoinLinSide":
        const CBatch *c
        const ArrowSchema *cs
        int32_t nb
        const CBatch *const *bs
        const uint64_t *const *bkh
        const uint64_t *const *bfence
        const CDir *const *bdir
        CJoinRunOut out
    ctypedef struct CJoinLin "DbspJoinLin":
        const int32_t *lkeys
        const int32_t *rkeys
        int32_t nkeys
        const int32_t *gside
        const int32_t *gcol
        const int32_t *gtype
        int32_t ng
        const int32_t *nonulls
        int32_t nnn
    int dbsp_join_linear_run(const CJoinLin *j, CJoinLinSide *sides, CLinRun *s, const int32_t *keys, int32_t nkeys,
                             const CAggSpec *specs, int32_t ns, CKeyIndex *ix, const int32_t *shown,
                             const int32_t *nonnull, const int32_t *avg, const int32_t *avg_lo, int32_t nout,
                             int out_keys, ArrowArray *batch, ArrowArray *out, int64_t **w, uint64_t **kh, int64_t *n,
                             int *ordered, int *distinct, const CKeyIndex *dirty, uint8_t **fresh, int *served)

cdef extern from "top1.h" nogil:
    int dbsp_top1(const CBatch *b, const uint64_t *kh, const int32_t *keys, int32_t nkeys, const int32_t *ocols,
                  const uint8_t *desc, int32_t nord, int64_t *best, int64_t *ngroups)
