# joinlin.pxi: an inner join folded into its linear group-by's totals in one C call (csrc/joinlin.h).


cdef class JoinLinearRun:
    """An inner equi-join whose one consumer is a linear group-by, its step in one C call that releases the GIL once
    (csrc/joinlin.h; dbsp_core/runtime/plan.py design note 4): ``step(lt, lw, lviews, rt, rw, rviews, ix)`` indexes
    each side's change (``lt``, ``lw`` / ``rt``, ``rw``: rows of ``lschema`` / ``rschema`` and their weights, or None
    when that side did not change) by its join keys (``lkeys`` / ``rkeys``) as ``ZSet.index_by`` does, joins the
    right change with ``lviews`` (the left trace's batches, ``IndexedZSet._view()``) and the left change with
    ``rviews`` (the right trace's) and the indexed right change, and folds the pairs' ``gathered`` columns
    (``(side, column)``: 0 left, 1 right; fixed-width, not bool) into ``ix`` as ``LinearRun`` folds rows of those
    columns (``keys``, ``specs``, ``shown``, ``nonnull``, ``out_keys``, ``bschema``, ``oschema``: positions in the
    gathered columns; LinearRun's meaning). Returns None, having changed nothing, when a weight product leaves
    int64 (the join's own step raises it) or one of the gathered columns ``nonulls`` has a null; else ``(left,
    right, linear)``: per side None (unchanged, or consolidated to nothing) or ``(change, w, kh, rh)`` as JoinRun
    returns its indexed change, and ``linear`` as ``LinearRun.step`` returns (``dirty``, ``found_dirty`` and
    ``keyorder`` too: csrc/linrun.h invariants 5, 6 and 8). Errors as LinearRun's."""
    cdef CLinRun s
    cdef Int32s lkeys, rkeys, gside, gcol, gtype, nonulls, keys, shown, nonnull, avg, avg_lo
    cdef CAggSpec *specs
    cdef int32_t ns, nout
    cdef int out_keys
    cdef readonly object lschema, rschema, bschema, oschema
    cdef readonly int64_t steps  # steps served (a counter for tests: the C path ran)

    def __cinit__(self):
        memset(&self.s, 0, sizeof(self.s))
        self.specs = NULL

    def __dealloc__(self):
        dbsp_linrun_free(&self.s)
        free(self.specs)

    def __init__(self, lkeys, rkeys, gathered, nonulls, lschema, rschema, keys, specs, shown, nonnull, out_keys,
                 bschema, oschema):
        if len(lkeys) != len(rkeys) or not lkeys:
            raise ValueError(f"JoinLinearRun: {len(lkeys)} left keys but {len(rkeys)} right keys")
        if not gathered or len(gathered) > 64 or len(shown) != len(nonnull) or not specs \
                or len(specs) + len(shown) > 64:
            raise ValueError("JoinLinearRun: 1 to 64 gathered columns, 1 to 64 slots and outputs, one non-null slot "
                             "per shown slot")
        codes = []
        for side, c in gathered:
            t = (lschema if side == 0 else rschema).field(c).type
            code = type_code(t)
            if code is None or code == DBSP_BOOL or code >= DBSP_UTF8:
                raise TypeError(f"JoinLinearRun: gathered column {c} of side {side} is {t}, not fixed-width")
            codes.append(code)
        if any(not 0 <= g < len(gathered) for g in list(keys) + list(nonulls)):
            raise ValueError("JoinLinearRun: a key or checked column outside the gathered columns")
        if any(not 0 <= j < len(specs) for j in shown) or any(not -1 <= j < len(specs) for j in nonnull):
            raise ValueError("JoinLinearRun: a shown or non-null slot outside the slots")
        self.lkeys, self.rkeys = Int32s(lkeys), Int32s(rkeys)
        self.gside, self.gcol = Int32s([s for s, _ in gathered]), Int32s([c for _, c in gathered])
        self.gtype, self.nonulls = Int32s(codes), Int32s(nonulls)
        self.keys, self.shown, self.nonnull = Int32s(keys), Int32s(shown), Int32s(nonnull)
        self.avg, self.avg_lo = Int32s([0] * len(shown)), Int32s([-1] * len(shown))
        self.ns, self.nout, self.out_keys = len(specs), len(shown), 1 if out_keys else 0
        self.specs = agg_specs(specs)
        self.lschema, self.rschema, self.bschema, self.oschema = lschema, rschema, bschema, oschema
        self.steps = 0

    def step(self, lt, lw, list lviews, rt, rw, list rviews, KeyIndex ix, KeyIndex dirty=None, bint found_dirty=False,
             bint keyorder=False):
        if self.keys.n != ix.nkeys or self.ns != ix.nvals:
            raise ValueError(f"JoinLinearRun: {self.keys.n} keys and {self.ns} slots for an index of {ix.nkeys} and "
                             f"{ix.nvals}")
        check_dirty(dirty, self.keys.n)
        cdef uint8_t *fresh = NULL
        cdef const CKeyIndex *dix = NULL if dirty is None else dirty.ix
        cdef CJoinLin j
        j.lkeys, j.rkeys, j.nkeys = self.lkeys.p, self.rkeys.p, self.lkeys.n
        j.gside, j.gcol, j.gtype, j.ng = self.gside.p, self.gcol.p, self.gtype.p, self.gside.n
        j.nonulls, j.nnn = self.nonulls.p, self.nonulls.n
        cdef CJoinLinSide sides[2]
        memset(sides, 0, sizeof(sides))
        cdef BatchView cv
        cdef list changes = [None, None]
        cdef int k, m
        cdef Int32s kk
        cdef int32_t nb
        cdef BatchView b
        cdef const CBatch **bs[2]
        cdef const uint64_t **bkh[2]
        cdef const uint64_t **bf[2]
        cdef const CDir **bd[2]
        bs[0] = bs[1] = NULL
        bkh[0] = bkh[1] = NULL
        bf[0] = bf[1] = NULL
        bd[0] = bd[1] = NULL
        cdef ArrowArray batch, out
        cdef int64_t *w = NULL
        cdef uint64_t *kh = NULL
        cdef int64_t n = 0
        cdef int ordered = 1, distinct = 1, served = 1, st
        self.s.found_dirty = 1 if found_dirty and dix != NULL else 0
        self.s.keyorder = 1 if keyorder else 0
        try:
            for k, (t, wt, views, schema, kk) in enumerate(((lt, lw, rviews, self.lschema, self.lkeys),
                                                               (rt, rw, lviews, self.rschema, self.rkeys))):
                if t is None:
                    continue
                cv = view_of(t, wt)
                if not cv.pyschema.equals(schema):
                    raise TypeError(f"JoinLinearRun: side {k}'s change has schema {cv.pyschema}, not {schema}")
                for m in range(kk.n):
                    if kk.p[m] < 0 or kk.p[m] >= cv.c.ncols:
                        raise IndexError(f"JoinLinearRun: key column {kk.p[m]} outside side {k}'s {cv.c.ncols}")
                changes[k] = cv
                nb = len(views)
                bs[k] = <const CBatch **>malloc(max(nb, 1) * sizeof(CBatch *))
                bkh[k] = <const uint64_t **>malloc(max(nb, 1) * sizeof(uint64_t *))
                bf[k] = <const uint64_t **>malloc(max(nb, 1) * sizeof(uint64_t *))
                bd[k] = <const CDir **>malloc(max(nb, 1) * sizeof(CDir *))
                if bs[k] == NULL or bkh[k] == NULL or bf[k] == NULL or bd[k] == NULL:
                    raise MemoryError()
                for m in range(nb):
                    b = <BatchView?>views[m]
                    if b.kh == NULL and b.c.nrows:
                        raise ValueError("JoinLinearRun: a batch view without key hashes")
                    bs[k][m] = &b.c
                    bkh[k][m] = b.kh
                    bf[k][m] = b.fence
                    bd[k][m] = b.seek_dir() if cv.c.nrows * 4 <= b.c.nrows else NULL  # (as JoinRun.step's)
                sides[k].c = &cv.c
                sides[k].cs = cv.cs
                sides[k].nb = nb
                sides[k].bs = bs[k]
                sides[k].bkh = bkh[k]
                sides[k].bfence = bf[k]
                sides[k].bdir = bd[k]
            with nogil:
                st = dbsp_join_linear_run(&j, sides, &self.s, self.keys.p, self.keys.n, self.specs, self.ns, ix.ix,
                                          self.shown.p, self.nonnull.p, self.avg.p, self.avg_lo.p, self.nout,
                                          self.out_keys, &batch, &out, &w, &kh, &n, &ordered, &distinct, dix,
                                          &fresh if dix != NULL else NULL, &served)
            check_status(st, "join_linear_run")
        finally:
            for k in range(2):
                free(bs[k]); free(bkh[k]); free(bf[k]); free(bd[k])
        if not served:
            return None
        self.steps += 1
        cdef list got = [None, None]
        try:
            for k in range(2):
                if sides[k].out.n == 0:
                    continue
                cw = own_array(sides[k].out.w, sides[k].out.n, np.int64)
                sides[k].out.w = NULL
                ckh = own_array(sides[k].out.kh, sides[k].out.n, np.uint64)
                sides[k].out.kh = NULL
                crh = None
                if sides[k].out.rh != NULL:
                    crh = own_array(sides[k].out.rh, sides[k].out.n, np.uint64)
                    sides[k].out.rh = NULL
                got[k] = (import_batch(&sides[k].out.change, self.lschema if k == 0 else self.rschema), cw, ckh, crh)
        except BaseException:
            if n:
                batch.release(&batch)
                out.release(&out)
                free(w); free(kh); free(fresh)
            raise
        finally:
            for k in range(2):
                dbsp_join_run_free(&sides[k].out, 0)
        return got[0], got[1], linear_result(self.bschema, self.oschema, &batch, &out, w, kh, n, ordered, distinct,
                                             fresh, dirty is not None)
