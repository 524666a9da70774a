# join.pxi: the equi-joins (join.h): the merge join of indexed batches and the hash join.

def join(ta, wa, kha, akeys, tb, wb, khb, bkeys, bint left_outer=False):
    """(li, ri, w): matching row pairs of two indexed batches (ri = -1 for unmatched left rows if left_outer)."""
    if len(akeys) != len(bkeys):
        raise ValueError(f"join: {len(akeys)} left keys but {len(bkeys)} right keys")
    cdef BatchView a = view_of(ta, wa, kha)
    cdef BatchView b = view_of(tb, wb, khb)
    cdef Int32s ak = Int32s(akeys)
    cdef Int32s bk = Int32s(bkeys)
    cdef CPairs p
    cdef int st
    with nogil:
        st = dbsp_join_fenced(&a.c, a.kh, a.fence, ak.p, &b.c, b.kh, b.fence, bk.p, ak.n, left_outer, &p)
    check_status(st, "join")
    return pairs_result(&p)


def hash_join(ta, wa, akeys, tb, wb, bkeys, bint left_outer=False):
    """(li, ri, w): matching row pairs of any two batches, by hashing (no index needed)."""
    if len(akeys) != len(bkeys):
        raise ValueError(f"join: {len(akeys)} left keys but {len(bkeys)} right keys")
    cdef BatchView a = view_of(ta, wa)
    cdef BatchView b = view_of(tb, wb)
    cdef Int32s ak = Int32s(akeys)
    cdef Int32s bk = Int32s(bkeys)
    cdef CPairs p
    cdef int st
    with nogil:
        st = dbsp_hash_join(&a.c, ak.p, &b.c, bk.p, ak.n, left_outer, &p)
    check_status(st, "hash_join")
    return pairs_result(&p)


cdef object pairs_result(CPairs *p):
    """Hand a DbspPairs' arrays to numpy (ownership moves) as (li, ri, w)."""
    li = own_array(p.li, p.n, np.int64)
    ri = own_array(p.ri, p.n, np.int64)
    w = own_array(p.w, p.n, np.int64)
    p.li = NULL; p.ri = NULL; p.w = NULL
    return li, ri, w


cdef class JoinRun:
    """An inner equi-join's step over one side's change in one C call that releases the GIL once (csrc/joinrun.h;
    dbsp_core/runtime/plan.py design note 2): ``step(table, weights, views)`` indexes the change (``table``, ``weights``:
    rows of ``cschema``) by its key columns ``ckeys`` as ``ZSet.index_by`` does, joins it with each batch of
    ``views`` (the other side's trace batches, ``IndexedZSet._view()``: rows, weights, key hashes, fence, and the
    directory each large one builds at its first seek, BatchView.seek_dir; keys ``bkeys``) and gathers each meeting's output rows: the left side's columns ``lcols`` then the right side's
    ``rcols`` (None: every column), the change being the left side when ``change_left``. Returns None when the
    change consolidates to nothing, else ``(change, w, kh, rh, parts, view)``: the indexed change's rows (a Table of
    ``cschema``), weights, key hashes and row hashes (None: not computed), per batch with pairs
    ``(k, rows, w)``, rows a Table of ``oschema``, and a BatchView of the indexed change (its rows, weights and key
    hashes: the columns the call viewed, joinrun.h invariant 5, not exported again; IndexedZSet._view's). With ``pad`` (a left outer join's left side, csrc/joinrun.h
    invariant 4: a one-row Table of nulls in the right side's schema, the batches' columns), one more part
    ``(len(views), rows, w)``: the change's rows without a right row (its key's right weights sum to at most 0 over the batches),
    their right columns null; ``pad_met`` then says whether one of them met a right row too (joinrun.h invariant 4:
    when not, and at most one batch gave pairs, the parts together are distinct rows). Errors as join's and
    take_pairs'."""
    cdef Int32s ckeys, bkeys, lcols, rcols
    cdef int change_left, all_l, all_r
    cdef readonly object cschema, oschema
    cdef readonly int64_t steps  # steps served (a counter for tests: the C path ran)
    cdef object checked  # the batch schema whose output types were checked last
    cdef BatchView pad  # invariant 4's row of nulls, or None
    cdef bint pad_checked
    cdef readonly bint pad_met  # the last step's (invariant 4)

    def __init__(self, ckeys, bkeys, bint change_left, lcols, rcols, cschema, oschema, pad=None):
        if len(ckeys) != len(bkeys) or not ckeys:
            raise ValueError(f"JoinRun: {len(ckeys)} change keys but {len(bkeys)} batch keys")
        self.ckeys, self.bkeys = Int32s(ckeys), Int32s(bkeys)
        self.all_l, self.all_r = lcols is None, rcols is None
        self.lcols = Int32s([] if lcols is None else lcols)
        self.rcols = Int32s([] if rcols is None else rcols)
        self.change_left = change_left
        self.cschema, self.oschema = cschema, oschema
        self.steps = 0
        self.checked = None
        self.pad = None
        self.pad_checked = False
        if pad is not None:
            if not change_left or pad.num_rows != 1:
                raise ValueError("JoinRun: a pad is one row, for a change on the join's left side")
            self.pad = view_of(pad)
            for j in range(self.rcols.n):
                if self.rcols.p[j] < 0 or self.rcols.p[j] >= self.pad.c.ncols:
                    raise IndexError(f"JoinRun: column {self.rcols.p[j]} outside the pad's {self.pad.c.ncols}")

    def step(self, table, weights, list views):
        cdef BatchView c = view_of(table, weights)
        cdef int32_t nb = len(views), k, j
        cdef int32_t np_ = nb + (self.pad is not None)  # the parts: one per batch, then the padded rows'
        cdef BatchView b
        if not c.pyschema.equals(self.cschema):
            raise TypeError(f"JoinRun: the change's schema {c.pyschema} is not {self.cschema}")
        for j in range(self.ckeys.n):
            if self.ckeys.p[j] < 0 or self.ckeys.p[j] >= c.c.ncols:
                raise IndexError(f"JoinRun: key column {self.ckeys.p[j]} outside the change's {c.c.ncols}")
        cdef const int32_t *lp = NULL if self.all_l else self.lcols.p
        cdef const int32_t *rp = NULL if self.all_r else self.rcols.p
        cdef const CBatch *padc = NULL
        if self.pad is not None:
            if not self.pad_checked:  # the padded part's columns: the change's lcols, the pad's rcols
                check_types(self.oschema, c, lp, c.c.ncols if self.all_l else self.lcols.n, self.pad, rp,
                            self.pad.c.ncols if self.all_r else self.rcols.n)
                self.pad_checked = True
            padc = &self.pad.c
        cdef const CBatch **bs = <const CBatch **>malloc(max(nb, 1) * sizeof(CBatch *))
        cdef const uint64_t **bkh = <const uint64_t **>malloc(max(nb, 1) * sizeof(uint64_t *))
        cdef const uint64_t **bf = <const uint64_t **>malloc(max(nb, 1) * sizeof(uint64_t *))
        cdef const CDir **bd = <const CDir **>malloc(max(nb, 1) * sizeof(CDir *))
        cdef ArrowArray *parts = <ArrowArray *>calloc(max(np_, 1), sizeof(ArrowArray))
        cdef int64_t **pw = <int64_t **>calloc(max(np_, 1), sizeof(int64_t *))
        cdef int64_t *pn = <int64_t *>calloc(max(np_, 1), sizeof(int64_t))
        cdef CJoinRunOut o
        cdef int st
        try:
            if bs == NULL or bkh == NULL or bf == NULL or bd == NULL or parts == NULL or pw == NULL or pn == NULL:
                raise MemoryError()
            for k in range(nb):
                b = <BatchView?>views[k]
                if b.kh == NULL and b.c.nrows:
                    raise ValueError("JoinRun: a batch view without key hashes")
                for j in range(self.bkeys.n):
                    if self.bkeys.p[j] < 0 or self.bkeys.p[j] >= b.c.ncols:
                        raise IndexError(f"JoinRun: key column {self.bkeys.p[j]} outside the batch's {b.c.ncols}")
                if self.checked is not b.pyschema:  # (the change's schema is cschema, checked above)
                    if self.change_left:  # the output's columns: the change's lcols, the batch's rcols
                        check_types(self.oschema, c, lp, c.c.ncols if self.all_l else self.lcols.n, b, rp,
                                    b.c.ncols if self.all_r else self.rcols.n)
                    else:
                        check_types(self.oschema, b, lp, b.c.ncols if self.all_l else self.lcols.n, c, rp,
                                    c.c.ncols if self.all_r else self.rcols.n)
                    self.checked = b.pyschema
                bs[k] = &b.c
                bkh[k] = b.kh
                bf[k] = b.fence
                # (a directory serves the seeks of a change of at most a quarter of the batch's rows, csrc/join.c:
                # a larger one walks the batch beside it; none is built for it)
                bd[k] = b.seek_dir() if c.c.nrows * 4 <= b.c.nrows else NULL
            o.parts, o.pw, o.pn = parts, pw, pn
            with nogil:
                st = dbsp_join_run(&c.c, c.cs, self.ckeys.p, self.ckeys.n, self.change_left, nb, bs, bkh, bf,
                                   bd, self.bkeys.p, lp, self.lcols.n, rp, self.rcols.n, padc, &o)
            check_status(st, "join")
            self.steps += 1
            self.pad_met = o.pad_met
            if o.n == 0:
                return None
            try:
                w = own_array(o.w, o.n, np.int64)
                o.w = NULL
                kh = own_array(o.kh, o.n, np.uint64)
                o.kh = NULL
                rh = None
                if o.rh != NULL:
                    rh = own_array(o.rh, o.n, np.uint64)
                    o.rh = NULL
                change = import_batch(&o.change, self.cschema)
                view = view_over(o.cols, c.c.ncols, o.n, change, self.cschema, w, kh)  # (joinrun.h invariant 5)
                o.cols = NULL
                out = []
                for k in range(np_):
                    if pn[k] == 0:
                        continue
                    pwk = own_array(pw[k], pn[k], np.int64)
                    pw[k] = NULL
                    out.append((k, import_batch(&parts[k], self.oschema), pwk))
                return change, w, kh, rh, out, view
            finally:
                dbsp_join_run_free(&o, np_)
        finally:
            free(bs); free(bkh); free(bf); free(bd); free(parts); free(pw); free(pn)
