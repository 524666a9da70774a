# extremes.pxi: the min/max aggregate's step (extremes.h): probe, scan of a value trace, store.

def extremes_probe(table, keys, slots, KeyIndex ix):
    """A min/max aggregate's step, phase 1 (csrc/extremes.h): the groups of the indexed change `table` (a BatchView
    with weights and key hashes, in canonical order for the key columns `keys`), their old totals read from `ix`
    and their new ones for the kernel `slots` ((kind, column) pairs). Returns (group_row, gkh, old, nw, need):
    old and nw are (ng, V) int64 arrays (V = slots, then one "not null" flag per extreme), need a bool array of the
    groups whose extremes must be recomputed from their values. Reads only."""
    return probe_into(table, keys, slots, ix, NULL, 0)


cdef probe_into(table, keys, slots, KeyIndex ix, int64_t **held, int64_t held_cap):
    """extremes_probe, keeping in held (room for held_cap, NULL: not kept) where the index holds each group's values
    (csrc/extremes.h design note 5)."""
    cdef BatchView v = view_of(table)
    cdef Int32s k = Int32s(keys)
    cdef int32_t ns = len(slots), ne = sum(1 for kind, _ in slots if kind in ("min", "max"))
    cdef int32_t V = ns + ne
    if v.kh == NULL and v.c.nrows:
        raise ValueError("extremes_probe: the change needs its key hashes")
    if k.n != ix.nkeys or V != ix.nvals:
        raise ValueError(f"extremes_probe: {k.n} keys and {V} values for an index of {ix.nkeys} and {ix.nvals}")
    cdef int64_t n = v.c.nrows, ng = 0
    if held != NULL and held_cap < n:
        raise ValueError(f"extremes_probe: room for {held_cap} groups' slots, {n} rows")
    group_row = np.empty(max(n, 1), dtype=np.int64)
    gkh = np.empty(max(n, 1), dtype=np.uint64)
    old = np.empty((max(n, 1), V), dtype=np.int64)
    nw = np.empty((max(n, 1), V), dtype=np.int64)
    need = np.zeros(max(n, 1), dtype=np.uint8)
    if n == 0:
        return group_row[:0], gkh[:0], old[:0], nw[:0], need[:0].view(bool)
    cdef CAggSpec *specs = agg_specs(slots)
    cdef int64_t[::1] pg = group_row
    cdef uint64_t[::1] pk = gkh
    cdef int64_t[:, ::1] po = old
    cdef int64_t[:, ::1] pn = nw
    cdef uint8_t[::1] pe = need
    cdef int st
    with nogil:
        st = dbsp_extremes_probe(ix.ix, &v.c, v.kh, k.p, k.n, specs, ns, &pg[0], &pk[0], &po[0, 0], &pn[0, 0],
                                 &pe[0], &ng, held)
    free(specs)
    check_status(st, "extremes_probe")
    return group_row[:ng], gkh[:ng], old[:ng], nw[:ng], need[:ng].view(bool)


def extremes_probe_inserts(table, keys, slots, KeyIndex ix):
    """extremes_probe for a change of insertions only (every weight >= 0; ValueError otherwise) in any row order,
    not indexed (csrc/extremes.h): its groups by hash grouping, in key-hash order, with the same
    (group_row, gkh, old, nw, need) as extremes_probe over the indexed change (need all False: no deleted value
    reaches an extreme). Reads only."""
    cdef BatchView v = view_of(table)
    cdef Int32s k = Int32s(keys)
    cdef int32_t ns = len(slots), ne = sum(1 for kind, _ in slots if kind in ("min", "max"))
    cdef int32_t V = ns + ne
    if k.n != ix.nkeys or V != ix.nvals:
        raise ValueError(f"extremes_probe_inserts: {k.n} keys and {V} values for an index of {ix.nkeys} and "
                         f"{ix.nvals}")
    cdef CAggSpec *specs = agg_specs(slots)
    cdef int64_t *pg = NULL
    cdef uint64_t *pk = NULL
    cdef int64_t *po = NULL
    cdef int64_t *pn = NULL
    cdef int64_t ng = 0
    cdef int st
    with nogil:
        st = dbsp_extremes_probe_inserts(ix.ix, &v.c, k.p, k.n, specs, ns, &pg, &pk, &po, &pn, &ng)
    free(specs)
    check_status(st, "extremes_probe_inserts")
    group_row = own_array(pg, ng, np.int64)
    gkh = own_array(pk, ng, np.uint64)
    old = own_array(po, ng * V, np.int64).reshape(ng, V)
    nw = own_array(pn, ng * V, np.int64).reshape(ng, V)
    return group_row, gkh, old, nw, np.zeros(ng, dtype=bool)


def extremes_scan(table, keys, rows, khash, batches, vkeys, int32_t vcol):
    """Extremes recomputed from a value trace (csrc/extremes.h): for each row ``rows[i]`` of ``table`` (a Table or
    BatchView; key columns ``keys``, key hash ``khash[i]``), over the rows of ``batches`` (BatchViews with key
    hashes: a value trace's batches, key columns ``vkeys``) holding its key, equal values' weights summed across
    batches, the least and greatest value of column ``vcol`` with a positive sum. Returns (has, mn, mx): a bool
    array and two int64 arrays (0 where has is False)."""
    cdef BatchView v = view_of(table)
    cdef Int32s k = Int32s(keys)
    cdef Int32s vk = Int32s(vkeys)
    if vk.n != k.n:
        raise ValueError(f"extremes_scan: {k.n} key columns against {vk.n}")
    r = np.ascontiguousarray(rows, dtype=np.int64)
    kh = np.ascontiguousarray(khash, dtype=np.uint64)
    cdef int64_t n = r.shape[0]
    if kh.shape[0] != n:
        raise ValueError(f"extremes_scan: {kh.shape[0]} key hashes for {n} rows")
    views = [<BatchView?>b for b in batches]
    cdef int32_t nb = len(views), i
    for bv in views:
        if (<BatchView>bv).kh == NULL and (<BatchView>bv).c.nrows:
            raise ValueError("extremes_scan: every batch needs its key hashes")
    has = np.zeros(max(n, 1), dtype=np.uint8)
    mn = np.zeros(max(n, 1), dtype=np.int64)
    mx = np.zeros(max(n, 1), dtype=np.int64)
    if n == 0:
        return has[:0].view(bool), mn[:0], mx[:0]
    cdef const CBatch **pb = <const CBatch **>malloc(max(nb, 1) * sizeof(CBatch *))
    cdef const uint64_t **pk = <const uint64_t **>malloc(max(nb, 1) * sizeof(uint64_t *))
    cdef const uint64_t **pf = <const uint64_t **>malloc(max(nb, 1) * sizeof(uint64_t *))
    if pb == NULL or pk == NULL or pf == NULL:
        free(pb); free(pk); free(pf)
        raise MemoryError("extremes_scan: out of memory")
    for i in range(nb):
        pb[i] = &(<BatchView>views[i]).c
        pk[i] = (<BatchView>views[i]).kh
        pf[i] = (<BatchView>views[i]).fence  # (NULL for a small batch: galloping is as cheap, csrc/extremes.h note 6)
    cdef const int64_t[::1] pr = r
    cdef const uint64_t[::1] pkh = kh
    cdef uint8_t[::1] ph = has
    cdef int64_t[::1] pmn = mn
    cdef int64_t[::1] pmx = mx
    cdef int st
    with nogil:
        st = dbsp_extremes_scan(&v.c, k.p, k.n, &pr[0], &pkh[0], n, pb, pk, pf, nb, vk.p, vcol, &ph[0], &pmn[0],
                                &pmx[0])
    free(pb); free(pk); free(pf)
    check_status(st, "extremes_scan")
    return has[:n].view(bool), mn[:n], mx[:n]


def extremes_recompute(table, keys, group_row, gkh, need, nw, batches, vkeys, int32_t vcol, fill):
    """The extremes of the probe's groups ``need`` (positions into its groups: ``group_row``, rows of ``table``, and key
    hashes ``gkh``, ascending) recomputed from a value trace's ``batches`` (csrc/extremes.h design note 2, as
    :func:`extremes_scan`) and written into the probe's new values ``nw`` (int64, C-contiguous, a row per group): for
    each (j, is_min, f) of ``fill``, nw[g, j] the least (is_min) or greatest value with a positive weight, nw[g, f] 1,
    or both 0 when the group holds none. One call in place of the scan's arrays and their numpy fill-in."""
    cdef BatchView v = view_of(table)
    cdef Int32s k = Int32s(keys)
    cdef Int32s vk = Int32s(vkeys)
    if vk.n != k.n:
        raise ValueError(f"extremes_recompute: {k.n} key columns against {vk.n}")
    cdef const int64_t[::1] pg = np.ascontiguousarray(group_row, dtype=np.int64)
    cdef const uint64_t[::1] pkk = np.ascontiguousarray(gkh, dtype=np.uint64)
    cdef const int64_t[::1] pn = np.ascontiguousarray(need, dtype=np.int64)
    cdef int64_t[:, ::1] px = nw
    cdef int64_t n = pn.shape[0], ng = pg.shape[0], i, g
    if pkk.shape[0] != ng or px.shape[0] != ng:
        raise ValueError(f"extremes_recompute: {ng} groups, {pkk.shape[0]} key hashes, {px.shape[0]} rows of values")
    fills = [(int(j), bool(mn_), int(f)) for j, mn_, f in fill]
    for j, _, f in fills:
        if not (0 <= j < px.shape[1] and 0 <= f < px.shape[1]):
            raise ValueError(f"extremes_recompute: value {j} or {f} outside {px.shape[1]}")
    if n == 0:
        return
    views = [<BatchView?>b for b in batches]
    cdef int32_t nb = len(views), q
    for bv in views:
        if (<BatchView>bv).kh == NULL and (<BatchView>bv).c.nrows:
            raise ValueError("extremes_recompute: every batch needs its key hashes")
    cdef int64_t *rows = <int64_t *>malloc(n * 8)
    cdef uint64_t *kh = <uint64_t *>malloc(n * 8)
    cdef uint8_t *has = <uint8_t *>malloc(n)
    cdef int64_t *mn = <int64_t *>malloc(n * 8)
    cdef int64_t *mx = <int64_t *>malloc(n * 8)
    cdef const CBatch **pb = <const CBatch **>malloc(max(nb, 1) * sizeof(CBatch *))
    cdef const uint64_t **pk = <const uint64_t **>malloc(max(nb, 1) * sizeof(uint64_t *))
    cdef const uint64_t **pf = <const uint64_t **>malloc(max(nb, 1) * sizeof(uint64_t *))
    cdef int st = DBSP_OK
    try:
        if rows == NULL or kh == NULL or has == NULL or mn == NULL or mx == NULL or pb == NULL or pk == NULL \
                or pf == NULL:
            raise MemoryError("extremes_recompute: out of memory")
        for i in range(n):
            g = pn[i]
            if g < 0 or g >= ng:
                raise ValueError(f"extremes_recompute: group {g} outside {ng}")
            rows[i] = pg[g]
            kh[i] = pkk[g]
        for q in range(nb):
            pb[q] = &(<BatchView>views[q]).c
            pk[q] = (<BatchView>views[q]).kh
            pf[q] = (<BatchView>views[q]).fence  # (NULL for a small batch, csrc/extremes.h note 6)
        with nogil:
            st = dbsp_extremes_scan(&v.c, k.p, k.n, rows, kh, n, pb, pk, pf, nb, vk.p, vcol, has, mn, mx)
        check_status(st, "extremes_recompute")
        for j, is_min, f in fills:
            for i in range(n):
                g = pn[i]
                px[g, <int>j] = (mn[i] if is_min else mx[i]) if has[i] else 0
                px[g, <int>f] = has[i]
    finally:
        free(rows); free(kh); free(has); free(mn); free(mx); free(pb); free(pk); free(pf)


def extremes_store(table, keys, group_row, gkh, old, nw, KeyIndex ix):
    """Phase 2 (csrc/extremes.h): the rows of the groups whose totals changed, -old then +new, as (grp, w), with
    `ix` left holding the new totals `nw`. A MemoryError or ValueError (past its size limit) leaves it broken."""
    cdef BatchView v = view_of(table)
    cdef Int32s k = Int32s(keys)
    gr = np.ascontiguousarray(group_row, dtype=np.int64)
    kh = np.ascontiguousarray(gkh, dtype=np.uint64)
    o = np.ascontiguousarray(old, dtype=np.int64)
    x = np.ascontiguousarray(nw, dtype=np.int64)
    cdef int64_t ng = gr.shape[0], n = 0
    cdef int32_t nv = ix.nvals
    if o.ndim != 2 or o.shape != x.shape or o.shape[0] != ng or kh.shape[0] != ng or o.shape[1] != ix.nvals:
        raise ValueError("extremes_store: group rows, hashes, old and new totals do not match")
    grp = np.empty(max(2 * ng, 1), dtype=np.int64)
    w = np.empty(max(2 * ng, 1), dtype=np.int64)
    if ng == 0:
        return grp[:0], w[:0]
    cdef const int64_t[::1] pg = gr
    cdef const uint64_t[::1] pk = kh
    cdef const int64_t[:, ::1] po = o
    cdef const int64_t[:, ::1] px = x
    cdef int64_t[::1] pgo = grp
    cdef int64_t[::1] pw = w
    cdef int st
    with nogil:
        st = dbsp_extremes_store(ix.ix, &v.c, k.p, ng, nv, &pg[0], &pk[0], &po[0, 0], &px[0, 0],
                                 &pgo[0], &pw[0], &n)
    check_status(st, "extremes_store")
    return grp[:n], w[:n]


cdef class ExtremesEmit:
    """A min/max aggregate's step, phase 2 and its outputs in one C call (csrc/extremes.h design note 4), configured
    once: ``keys`` (the key positions in the change), ``ns`` slots of ``nv`` index values, per slot ``snull[j]`` (its
    "not null" flag's position among the values, or -1) and the byte width ``swidth[j]`` of its totals column; per
    output column ``shown[o]`` (a value's position), ``nonnull[o]`` (the position of the value whose 0 makes it null,
    or -1) and ``owidth[o]``; ``bschema`` (the totals: keys, then the slots) and ``oschema`` (the output: keys, then
    the output columns). ``step(table, group_row, gkh, old, nw, ix)`` takes phase 1's arrays (extremes_probe's, the
    recomputed extremes filled in) and returns ``(batch, w, kh, rh, ordered, out, ow)``: the totals trace batch as a
    one-chunk Table with its weights, key hashes and row hashes (in canonical order unless ``ordered`` is False), and
    the output Table with its weights (its rows distinct: a group's equal old and new rows dropped); all None when
    no group's totals changed. ``keyorder``: the batch is wanted in key-hash order only (extremes.h: no row hashes,
    ``rh`` None, ``ordered`` False only for a key-hash tie). ``ix`` then holds the new totals; a MemoryError or ValueError from its store leaves it
    as it was with a refusal counted (design note 5), one before the store changes nothing. ``lazy``: the batch is not
    built (None; its ``w``, ``kh`` and ``rh`` are returned: design note 7), ``batch(...)`` over the same arrays builds
    it later. ``probe(table, slots,
    ix)`` is extremes_probe (over this emit's keys) that keeps where ``ix`` holds each group's values: a ``step``
    that follows it over the same groups (its ``gkh``, the very array, and ``ix``, with nothing stored in between)
    writes those groups' new values in place (design note 5: one probe per group); ``in_place`` counts such steps."""
    cdef Int32s keys, snull, swidth, shown, nonnull, owidth
    cdef int32_t ns, nv, nout
    cdef readonly object bschema, oschema
    cdef readonly int64_t steps  # steps served (a counter for tests: the C path ran)
    cdef readonly int64_t in_place  # of them, steps that stored in place after this object's probe
    cdef int64_t **held  # the last probe's slots (design note 5), room for held_cap
    cdef int64_t held_cap
    cdef object held_ix, held_gkh  # the index and the groups' key hashes they belong to (None: none held)
    cdef object pykeys

    def __dealloc__(self):
        free(self.held)

    def probe(self, table, slots, KeyIndex ix):
        cdef BatchView v = view_of(table)
        cdef int64_t n = v.c.nrows
        cdef int64_t **grown
        self.held_ix = self.held_gkh = None
        if n > self.held_cap:
            grown = <int64_t **>realloc(self.held, max(n, 1) * sizeof(int64_t *))
            if grown == NULL:
                raise MemoryError("ExtremesEmit.probe: out of memory")
            self.held, self.held_cap = grown, max(n, 1)
        out = probe_into(v, self.pykeys, slots, ix, self.held, self.held_cap)
        self.held_ix, self.held_gkh = ix, out[1]
        return out

    def __init__(self, keys, int32_t nv, snull, swidth, shown, nonnull, owidth, bschema, oschema):
        if len(snull) != len(swidth) or not snull or len(shown) != len(nonnull) or len(shown) != len(owidth):
            raise ValueError("ExtremesEmit: one flag and width per slot, one slot, flag and width per output column")
        if len(snull) + len(shown) > 128 or nv < len(snull):
            raise ValueError("ExtremesEmit: at most 128 columns, and no fewer values than slots")
        for x in list(snull) + list(nonnull):
            if not -1 <= x < nv:
                raise ValueError("ExtremesEmit: a flag outside the values")
        for x in shown:
            if not 0 <= x < nv:
                raise ValueError("ExtremesEmit: a shown value outside the values")
        for x in list(swidth) + list(owidth):
            if x not in (1, 2, 4, 8):
                raise ValueError("ExtremesEmit: a width other than 1, 2, 4 or 8 bytes")
        self.keys, self.snull, self.swidth = Int32s(keys), Int32s(snull), Int32s(swidth)
        self.pykeys = list(keys)
        self.shown, self.nonnull, self.owidth = Int32s(shown), Int32s(nonnull), Int32s(owidth)
        self.ns, self.nv, self.nout = len(snull), nv, len(shown)
        self.bschema, self.oschema = bschema, oschema
        self.steps = 0
        self.in_place = 0

    def _arrays(self, BatchView v, group_row, gkh, old, nw):
        """The phase-1 arrays as contiguous arrays, checked against each other and the change ``v``."""
        gr = np.ascontiguousarray(group_row, dtype=np.int64)
        kk = np.ascontiguousarray(gkh, dtype=np.uint64)
        o = np.ascontiguousarray(old, dtype=np.int64)
        x = np.ascontiguousarray(nw, dtype=np.int64)
        cdef int64_t ng = gr.shape[0], i
        if o.ndim != 2 or o.shape != x.shape or o.shape[0] != ng or kk.shape[0] != ng or o.shape[1] != self.nv:
            raise ValueError("ExtremesEmit: group rows, hashes, old and new totals do not match")
        cdef const int64_t[::1] pg = gr
        for i in range(ng):
            if pg[i] < 0 or pg[i] >= v.c.nrows:
                raise IndexError(f"ExtremesEmit: group row {pg[i]} outside the change's {v.c.nrows}")
        return gr, kk, o, x

    def batch(self, table, group_row, gkh, old, nw, bint keyorder=False):
        """The totals batch ``step`` over the same arguments builds (or would have built: ``lazy``), as ``(batch, w,
        kh, rh, ordered)``, all None but ``ordered`` when no group's totals changed (csrc/extremes.h design note 7);
        stores nothing."""
        cdef BatchView v = view_of(table)
        gr, kk, o, x = self._arrays(v, group_row, gkh, old, nw)
        cdef int64_t ng = gr.shape[0]
        if ng == 0:
            return None, None, None, None, True
        cdef const int64_t[::1] pg = gr
        cdef const uint64_t[::1] pk = kk
        cdef const int64_t[:, ::1] po = o
        cdef const int64_t[:, ::1] px = x
        cdef ArrowArray batch
        cdef int64_t *w = NULL
        cdef uint64_t *kh = NULL
        cdef uint64_t *rh = NULL
        cdef int64_t n = 0
        cdef int ordered = 1, st
        with nogil:
            st = dbsp_extremes_batch(&v.c, self.keys.p, self.keys.n, self.ns, self.nv, ng, &pg[0], &pk[0], &po[0, 0],
                                     &px[0, 0], self.snull.p, self.swidth.p, 1 if keyorder else 0, &batch, &w, &kh,
                                     &rh, &n, &ordered)
        check_status(st, "extremes_batch")
        if n == 0:
            return None, None, None, None, True
        wa = own_array(w, n, np.int64)
        ka = own_array(kh, n, np.uint64)
        ra = own_array(rh, n, np.uint64) if rh != NULL else None
        return import_batch(&batch, self.bschema), wa, ka, ra, bool(ordered)

    def step(self, table, group_row, gkh, old, nw, KeyIndex ix, bint keyorder=False, bint lazy=False):
        cdef int64_t *const *held = self.held if self.held_ix is ix and self.held_gkh is gkh else NULL
        self.held_ix = self.held_gkh = None  # (one use: the step stores)
        cdef BatchView v = view_of(table)
        if self.keys.n != ix.nkeys or self.nv != ix.nvals:
            raise ValueError(f"ExtremesEmit: {self.keys.n} keys and {self.nv} values for an index of {ix.nkeys} and "
                             f"{ix.nvals}")
        gr, kk, o, x = self._arrays(v, group_row, gkh, old, nw)
        cdef int64_t ng = gr.shape[0]
        cdef const int64_t[::1] pg = gr
        self.steps += 1
        if ng == 0:
            return None, None, None, None, True, None, None
        cdef const uint64_t[::1] pk = kk
        cdef const int64_t[:, ::1] po = o
        cdef const int64_t[:, ::1] px = x
        cdef ArrowArray batch, out
        cdef int64_t *w = NULL
        cdef int64_t *ow = NULL
        cdef uint64_t *kh = NULL
        cdef uint64_t *rh = NULL
        cdef int64_t n = 0, on = 0
        cdef int ordered = 1, st
        with nogil:
            st = dbsp_extremes_emit(ix.ix, &v.c, self.keys.p, self.keys.n, self.ns, self.nv, ng, &pg[0], &pk[0],
                                    &po[0, 0], &px[0, 0], self.snull.p, self.swidth.p, self.nout, self.shown.p,
                                    self.nonnull.p, self.owidth.p, NULL if lazy else &batch, &out, &w, &kh, &rh, &n,
                                    &ordered, &ow, &on, held, 1 if keyorder else 0)
        check_status(st, "extremes_emit")
        self.in_place += held != NULL
        if n == 0:
            return None, None, None, None, True, None, None
        wa = own_array(w, n, np.int64)
        ka = own_array(kh, n, np.uint64)
        ra = own_array(rh, n, np.uint64) if rh != NULL else None
        owa = own_array(ow, on, np.int64)
        if lazy:  # (design note 7: no batch built)
            return None, wa, ka, ra, bool(ordered), import_batch(&out, self.oschema), owa
        try:
            bt = import_batch(&batch, self.bschema)
        except BaseException:
            out.release(&out)  # not imported: the first import failed
            raise
        return bt, wa, ka, ra, bool(ordered), import_batch(&out, self.oschema), owa
