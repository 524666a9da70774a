# fold.pxi: the linear aggregate's step (fold.h): linear_fold, and linear_step through a key index.

def linear_fold(old, delta, khash):
    """A linear aggregate's step (csrc/fold.h): for `ng` groups with old totals `old` and a step's sums `delta`
    ((ng, ns) int64, slot 0 the row count) and key hashes `khash` (ng, ascending), the rows of new (+1) and old
    (-1) totals of the changed groups: (group of each row, weights, key hashes, slot values as an (ns, n) array,
    whether the rows are in canonical index order). WeightOverflowError if a total leaves int64."""
    o = np.ascontiguousarray(old, dtype=np.int64)
    d = np.ascontiguousarray(delta, dtype=np.int64)
    kh = np.ascontiguousarray(khash, dtype=np.uint64)
    if o.ndim != 2 or d.shape != o.shape or kh.shape != (o.shape[0],):
        raise ValueError(f"linear_fold: old {o.shape}, delta {d.shape} and khash {kh.shape} do not match")
    cdef int64_t ng = o.shape[0], cap = 2 * o.shape[0], n = 0
    cdef int32_t ns = o.shape[1]
    cdef int ordered = 1, st
    grp = np.empty(max(cap, 1), dtype=np.int64)
    w = np.empty(max(cap, 1), dtype=np.int64)
    kho = np.empty(max(cap, 1), dtype=np.uint64)
    vals = np.empty((ns, max(cap, 1)), dtype=np.int64)
    cdef const int64_t[:, ::1] po = o
    cdef const int64_t[:, ::1] pd = d
    cdef const uint64_t[::1] pk = kh
    cdef int64_t[::1] pg = grp
    cdef int64_t[::1] pw = w
    cdef uint64_t[::1] pkh = kho
    cdef int64_t[:, ::1] pv = vals
    if ng == 0 or ns == 0:
        return grp[:0], w[:0], kho[:0], vals[:, :0], True
    with nogil:
        st = dbsp_linear_fold(ng, ns, &po[0, 0], &pd[0, 0], &pk[0], &pg[0], &pw[0], &pkh[0], &pv[0, 0], &n, &ordered,
                              NULL)
    check_status(st, "linear_fold")
    return grp[:n], w[:n], kho[:n], vals[:, :n], bool(ordered)


def linear_step(table, keys, cols, KeyIndex ix):
    """A linear aggregate's step through its key index, in one call: group the rows of `table` (a Table or BatchView
    with weights) by the key columns `keys`, summing weight times each int64 column of `cols` (csrc/reduce.h); read
    each group's old sums from `ix` (whose sums are those columns' totals per key); emit the rows of new (+1) and old
    (-1) totals of the changed groups (csrc/fold.h); then store each changed group's new totals in `ix` (in place
    where the key was found), or drop the group when its new count (slot 0) is 0. Returns (rows, w, kh, rh, vals,
    ordered): per emitted row, the row of `table` carrying its key, its weight, key hash and row hash; the slot
    values as an (ns, n) array; and whether the rows are in canonical index order (linear_fold's). A
    WeightOverflowError (a sum or total leaves int64) leaves `ix` unchanged; so does a MemoryError or ValueError (past its
    size limit) while storing: the stores are undone (csrc/linrun.h invariant 4; ``ix.refusals`` counts them)."""
    cdef BatchView v = view_of(table)
    cdef Int32s k = Int32s(keys)
    cdef int32_t ns = len(cols)
    if k.n != ix.nkeys or ns != ix.nvals or ns == 0:
        raise ValueError(f"linear_step: {k.n} keys and {ns} columns for an index of {ix.nkeys} and {ix.nvals}")
    cdef CAggSpec *specs = agg_specs([("sum", c) for c in cols])
    cdef CReduceOut r
    cdef int st
    memset(&r, 0, sizeof(r))
    with nogil:
        st = dbsp_group_reduce_all(&v.c, k.p, k.n, specs, ns, &r)
    free(specs)
    if st != DBSP_OK:
        dbsp_reduce_free(&r)
        check_status(st, "linear_step")
    cdef int64_t ng = r.ngroups, cap = max(2 * r.ngroups, 1), n = 0
    cdef int ordered = 1
    cdef int32_t j
    # per emitted row: rows, w, kh, rh, then the slots (ns rows of cap): each its own allocation, shrunk to the rows
    # emitted below, so what the trace batch keeps (w, kh, the slots; rh when it keeps row hashes) pins no byte
    # beyond its own (a slice of one buffer for all of them, as before, pinned up to 2 * groups * (4 + ns) words,
    # ~2x the batch's, which the budget, counting the arrays' own bytes (spill.py batch_bytes), did not see until
    # the batch merged; bench/history/RESULTS-2026-11-28-to-2026-12-02.md, issue 31, r31-mend)
    cdef int64_t *rows = <int64_t *>malloc(cap * 8)
    cdef int64_t *w = <int64_t *>malloc(cap * 8)
    cdef uint64_t *kh = <uint64_t *>malloc(cap * 8)
    cdef uint64_t *rh = <uint64_t *>malloc(cap * 8)
    cdef int64_t *vals = <int64_t *>malloc(cap * ns * 8)
    cdef int64_t *old = <int64_t *>malloc(max(ng * ns, 1) * 8)
    cdef int64_t *grp = <int64_t *>malloc(cap * 8)
    cdef int64_t **slots = <int64_t **>malloc(max(ng, 1) * sizeof(int64_t *))
    if (old == NULL or grp == NULL or slots == NULL or rows == NULL or w == NULL or kh == NULL or rh == NULL
            or vals == NULL):
        free(old); free(grp); free(slots); dbsp_reduce_free(&r)
        free(rows); free(w); free(kh); free(rh); free(vals)
        raise MemoryError("linear_step: out of memory")
    with nogil:  # probe, fold and store (csrc/linrun.h invariant 1: the code dbsp_linear_run runs too)
        st = dbsp_linear_apply(ix.ix, &v.c, k.p, &r, ns, old, slots, grp, rows, w, kh, vals, rh, &n, &ordered)
        if st == DBSP_OK:
            for j in range(1, ns):  # the slots' rows side by side
                memmove(vals + j * n, vals + j * cap, n * 8)
    free(old); free(grp); free(slots)
    dbsp_reduce_free(&r)
    if st != DBSP_OK:
        free(rows); free(w); free(kh); free(rh); free(vals)
        check_status(st, "linear_step")
    return (own_array(rows, n, np.int64), own_array(_shrunk(w, n), n, np.int64),
            own_array(_shrunk(kh, n), n, np.uint64), own_array(_shrunk(rh, n), n, np.uint64),
            own_array(_shrunk(vals, n * ns), n * ns, np.int64).reshape(ns, n), bool(ordered))


cdef void *_shrunk(void *p, int64_t n) noexcept:
    """``p`` (malloc'ed) shrunk to ``n`` words (in place: a shrink copies nothing), or as it was if realloc fails."""
    cdef void *q = realloc(p, max(n, 1) * 8)
    return p if q == NULL else q


cdef class LinearRun:
    """A linear group-by's whole step in one C call that releases the GIL once (csrc/linrun.h; dbsp_core/runtime/plan.py
    design notes 2 and 4), with its scratch kept across steps: ``step(table, weights, ix)`` groups the change's rows by
    the key columns ``keys``, summing per slot its weights (``("count", None)``) or weight times an int64 column
    (``("sum", position)``), probes `ix` (a KeyIndex of those slots' totals per key), stores the new totals and returns
    the trace batch and the output Z-set's columns, built in C: ``(batch, out, w, kh, ordered, distinct)``. ``batch``
    has ``bschema`` (the keys, then the slots), ``out`` has ``oschema`` (the keys unless ``out_keys`` is false, then per
    shown aggregate ``shown[o]``'s slot, null where slot ``nonnull[o]`` (>= 0) is 0; with ``avg[o]`` not None, a
    float64 avg: the sum in slot ``shown[o]`` and low limb slot ``avg[o]`` (-1: none) over the count in slot
    ``nonnull[o]``, as Aggregate.finalize divides; specs may sum ``("sum_hi", c)`` / ``("sum_lo", c)``, the limbs of
    an int64 column); both None when no row changed.
    Returns None, having read and changed nothing, when a summed column or one of ``checked`` (positions: the columns
    a count of values counts) has a null. With ``dirty`` (a KeyIndex of a totals trace's dirty keys, one value a
    key), a seventh item: per row of ``batch`` whether its key is not dirty (csrc/linrun.h invariant 5; None when no
    row changed); ``found_dirty``: every key ``ix`` holds is dirty, so only the others are probed (invariant 6).
    ``keyorder``: the caller needs ``batch`` in key-hash order only (invariant 8): a group's rows then come new row
    first, not by row hash, and ``ordered`` says only that no two groups share a key hash.
    Errors as linear_step's."""
    cdef CLinRun s
    cdef Int32s keys, shown, nonnull, avg, avg_lo
    cdef CAggSpec *specs
    cdef int32_t ns, nout
    cdef int out_keys
    cdef tuple summed
    cdef readonly object bschema, oschema
    cdef readonly int64_t steps  # steps served (a counter for tests: the C path ran)
    cdef readonly int64_t fused_steps  # of them, those grouped by the hashing pass (csrc/linrun.h invariant 7)

    def __cinit__(self):
        memset(&self.s, 0, sizeof(self.s))
        self.specs = NULL

    def __dealloc__(self):
        dbsp_linrun_free(&self.s)
        free(self.specs)

    def __init__(self, keys, specs, shown, nonnull, out_keys, bschema, oschema, checked=(), avg=None):
        cdef int32_t j
        if len(shown) != len(nonnull) or not specs or len(specs) + len(shown) > 64:
            raise ValueError("LinearRun: 1 to 64 columns, and one non-null slot (or -1) per shown slot")
        avg = [None] * len(shown) if avg is None else list(avg)  # per shown slot: None, or an avg's low limb slot
        if len(avg) != len(shown) or any(a is not None and (nonnull[o] < 0 or not -1 <= a < len(specs))
                                         for o, a in enumerate(avg)):
            raise ValueError("LinearRun: an avg needs its count slot, and its low limb slot or -1")
        if any(not 0 <= j < len(specs) for j in shown) or any(not -1 <= j < len(specs) for j in nonnull):
            raise ValueError("LinearRun: a shown or non-null slot outside the slots")
        self.keys, self.shown, self.nonnull = Int32s(keys), Int32s(shown), Int32s(nonnull)
        self.avg = Int32s([0 if a is None else 1 for a in avg])
        self.avg_lo = Int32s([-1 if a is None else a for a in avg])
        self.ns, self.nout, self.out_keys = len(specs), len(shown), 1 if out_keys else 0
        limbs = {"sum_hi": DBSP_LINRUN_SUM_HI, "sum_lo": DBSP_LINRUN_SUM_LO}  # a limb of an int64 column's sum
        self.specs = agg_specs([("sum", c) if kind in limbs else (kind, c) for kind, c in specs])
        for j, (kind, c) in enumerate(specs):
            if kind in limbs:
                self.specs[j].kind = limbs[kind]
        self.summed = tuple(sorted({c for kind, c in specs if c is not None} | set(checked)))
        self.bschema, self.oschema = bschema, oschema
        self.steps = 0
        self.fused_steps = 0

    def step(self, table, weights, KeyIndex ix, KeyIndex dirty=None, bint found_dirty=False, bint keyorder=False):
        cdef BatchView v = view_of(table, weights)
        cdef int32_t c
        if self.keys.n != ix.nkeys or self.ns != ix.nvals:
            raise ValueError(f"LinearRun: {self.keys.n} keys and {self.ns} slots for an index of {ix.nkeys} and "
                             f"{ix.nvals}")
        check_dirty(dirty, self.keys.n)
        for c in self.summed:
            if c < 0 or c >= v.c.ncols:
                raise ValueError(f"LinearRun: column {c} outside the change's {v.c.ncols}")
            if v.c.cols[c].validity != NULL:  # a null: the chain's own steps serve it (counts of a column)
                return None
        cdef ArrowArray batch, out
        cdef int64_t *w = NULL
        cdef uint64_t *kh = NULL
        cdef int64_t n = 0
        cdef int ordered = 1, distinct = 1, st
        cdef uint8_t *fresh = NULL
        cdef const CKeyIndex *dix = NULL if dirty is None else dirty.ix
        self.s.found_dirty = 1 if found_dirty and dix != NULL else 0
        self.s.keyorder = 1 if keyorder else 0
        with nogil:
            st = dbsp_linear_run3(&self.s, &v.c, self.keys.p, self.keys.n, self.specs, self.ns, ix.ix, self.shown.p,
                                  self.nonnull.p, self.avg.p, self.avg_lo.p, self.nout, self.out_keys, &batch, &out,
                                  &w, &kh, &n, &ordered, &distinct, dix, &fresh if dix != NULL else NULL)
        check_status(st, "linear_run")
        self.steps += 1
        self.fused_steps += self.s.fused
        return linear_result(self.bschema, self.oschema, &batch, &out, w, kh, n, ordered, distinct, fresh,
                             dirty is not None)


def lingroup_served():
    """Changes grouped by the one-call step's hashing pass (csrc/lingroup.h), ever, in the process: for tests."""
    return dbsp_lingroup_served()


cdef int check_dirty(KeyIndex dirty, int32_t nkeys) except -1:
    """A dirty-key index (csrc/linrun.h invariant 5) fits the step's keys: as many key columns, one value a key."""
    if dirty is not None and (dirty.nkeys != nkeys or dirty.nvals != 1):
        raise ValueError(f"linear run: a dirty-key index of {dirty.nkeys} keys and {dirty.nvals} values for "
                         f"{nkeys} keys and 1 value")
    return 0


cdef object linear_result(bschema, oschema, ArrowArray *batch, ArrowArray *out, int64_t *w, uint64_t *kh, int64_t n,
                          int ordered, int distinct, uint8_t *fresh, bint with_fresh):
    """A one-call step's exports (dbsp_linear_run3, owned from here) as ``(batch, out, w, kh, ordered, distinct)``,
    with ``fresh`` (bool per row: its key is not dirty; csrc/linrun.h invariant 5) appended when asked."""
    tail = (None,) if with_fresh else ()
    if n == 0:
        return (None, None, None, None, True, True) + tail
    wa = own_array(w, n, np.int64)
    ka = own_array(kh, n, np.uint64)
    fa = own_array(fresh, n, np.uint8).view(np.bool_) if fresh != NULL else None
    try:
        bt = import_batch(batch, bschema)
    except BaseException:
        out.release(out)  # not imported: the first import failed
        raise
    res = (bt, import_batch(out, oschema), wa, ka, bool(ordered), bool(distinct))
    return res + (fa,) if with_fresh else res
