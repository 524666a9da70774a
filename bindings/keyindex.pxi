# keyindex.pxi: KeyIndex (keyindex.h): a hash index from keys to int64 sums, and the process-wide budget.

cdef class KeyIndex:
    """A hash index from a key of fixed-width and string/binary columns to int64 sums (csrc/keyindex.h): ``get`` adds each probed
    key's sums to an accumulator with one probe per key, ``add`` folds a batch's rows into the sums (weight times
    int64 columns, or the weight alone for a column position of -1). ``token`` is free for the owner's use (a
    Trace records which state of its batches the sums match)."""
    cdef CKeyIndex *ix
    cdef readonly int32_t nkeys
    cdef readonly int32_t nvals
    cdef readonly tuple types
    cdef public object token

    def __cinit__(self, types, int32_t nvals, int64_t max_bytes=0):
        cdef Int32s t = Int32s([type_code(x) if type_code(x) is not None else -1 for x in types])
        self.ix = NULL
        self.nkeys = t.n
        self.nvals = nvals
        self.types = tuple(types)
        self.token = None
        check_status(dbsp_keyindex_new(t.p, t.n, nvals, max_bytes, &self.ix), "KeyIndex")

    def __dealloc__(self):
        dbsp_keyindex_free(self.ix)

    def __len__(self):
        return dbsp_keyindex_len(self.ix)

    @property
    def nbytes(self):
        """Bytes of the slot tables (the new and the old one while growing), of the entries and of the arena of
        string keys (csrc/keyindex.h invariant 8)."""
        return dbsp_keyindex_bytes(self.ix)

    @property
    def regions(self):
        """[(address, bytes)] of the mapped regions (the large slot tables, entries and arena of string keys;
        csrc/keyindex.h invariants 7 and 8): where /proc/self/smaps shows what of them the process holds."""
        cdef void *at[4]
        cdef size_t ln[4]
        cdef int n = dbsp_keyindex_regions(self.ix, at, ln)
        return [(<uintptr_t>at[i], ln[i]) for i in range(n)]

    def set_dir(self, directory):
        """Keep the large regions in unlinked files of ``directory`` from now on (None: anonymous memory), moving
        those held now (csrc/keyindex.h invariant 7)."""
        cdef bytes d = b""
        cdef const char *p = NULL
        if directory is not None:
            d = os.fsencode(directory)
            p = d
        check_status(dbsp_keyindex_set_dir(self.ix, p), "KeyIndex.set_dir")

    def drop_pages(self):
        """Return the pages of the file regions to the page cache (invariant 7); their bytes (0 without files)."""
        return dbsp_keyindex_drop_pages(self.ix)

    @property
    def growing(self):
        """True while the index moves its entries into a table of twice the slots, a few per new entry
        (csrc/keyindex.h invariant 5)."""
        return bool(dbsp_keyindex_growing(self.ix))

    @property
    def spills(self):
        """New keys that spilled into the new table while growing, ever (csrc/keyindex.h invariant 5; for tests)."""
        return dbsp_keyindex_spills(self.ix)

    @property
    def refusals(self):
        """Steps whose store failed (memory, size limit) and was undone, the index left whole and as it was
        (csrc/linrun.h invariant 4), ever."""
        return dbsp_keyindex_refusals(self.ix)

    @property
    def broken(self):
        """True after an update failed (overflow, memory): the sums are partly updated and must not be read."""
        return bool(dbsp_keyindex_broken(self.ix))

    def get(self, table, keys, khash, acc, sel=None):
        """acc[i, v] += sum v of the key of row ``sel[i]`` (or row i) of ``table`` (a Table or BatchView) over the
        key columns ``keys``, whose key hash is ``khash[i]``; ``acc`` is a C-contiguous int64 (n, nvals) array."""
        cdef BatchView b = view_of(table)
        cdef Int32s k = Int32s(keys)
        kh = np.ascontiguousarray(khash, dtype=np.uint64)
        cdef int64_t n = kh.shape[0]
        if k.n != self.nkeys:
            raise ValueError(f"KeyIndex.get: {k.n} key columns for an index of {self.nkeys}")
        if acc.dtype != np.int64 or acc.ndim != 2 or acc.shape[0] != n or acc.shape[1] != self.nvals \
                or not acc.flags.c_contiguous:
            raise ValueError(f"KeyIndex.get: acc must be a C-contiguous int64 array of shape ({n}, {self.nvals})")
        cdef const int64_t[::1] ps
        cdef const int64_t *psel = NULL
        if sel is not None:
            sl = np.ascontiguousarray(sel, dtype=np.int64)
            if sl.shape[0] != n:
                raise ValueError(f"KeyIndex.get: {sl.shape[0]} selected rows for {n} key hashes")
            ps = sl
            psel = &ps[0] if n else NULL
        elif n != b.c.nrows:
            raise ValueError(f"KeyIndex.get: {n} key hashes for {b.c.nrows} rows")
        cdef const uint64_t[::1] pk = kh
        cdef int64_t[:, ::1] out = acc
        cdef int st
        if n == 0:
            return acc
        with nogil:
            st = dbsp_keyindex_get(self.ix, &b.c, k.p, psel, &pk[0], n, &out[0, 0])
        check_status(st, "KeyIndex.get")
        return acc

    def add(self, table, weights, keys, khash, cols, int64_t sign=1, before=None):
        """Fold every row of ``table`` (weights int64 or None for +1) into the sums of its key (columns ``keys``,
        key hash ``khash[i]``): sum v += weight * sign * table[cols[v]] (an integer column), weight * sign where
        cols[v] is -1, weight * sign where column -2 - cols[v] is not null for cols[v] <= -2. With ``before`` (a
        C-contiguous int64 (n, nvals) array), also the sums of each row's key just before that row (the sums before
        the call, for rows with distinct keys). Raises WeightOverflowError, MemoryError, or ValueError past
        ``max_bytes`` (the index is then broken)."""
        cdef BatchView b = view_of(table, weights)
        cdef Int32s k = Int32s(keys)
        cdef Int32s c = Int32s(cols)
        kh = np.ascontiguousarray(khash, dtype=np.uint64)
        if k.n != self.nkeys or c.n != self.nvals:
            raise ValueError(f"KeyIndex.add: {k.n} keys and {c.n} columns for an index of {self.nkeys} and "
                             f"{self.nvals}")
        if kh.shape[0] != b.c.nrows:
            raise ValueError(f"KeyIndex.add: {kh.shape[0]} key hashes for {b.c.nrows} rows")
        cdef const uint64_t[::1] pk = kh
        cdef int64_t[:, ::1] pb
        cdef int64_t *pbefore = NULL
        cdef int st
        if before is not None:
            if before.dtype != np.int64 or before.ndim != 2 or before.shape[0] != b.c.nrows \
                    or before.shape[1] != self.nvals or not before.flags.c_contiguous:
                raise ValueError(f"KeyIndex.add: before must be a C-contiguous int64 array of shape "
                                 f"({b.c.nrows}, {self.nvals})")
            if b.c.nrows:
                pb = before
                pbefore = &pb[0, 0]
        if b.c.nrows == 0:
            return
        with nogil:
            st = dbsp_keyindex_add_before(self.ix, &b.c, k.p, &pk[0], c.p, sign, pbefore)
        check_status(st, "KeyIndex.add")

    def take_back(self, table, weights, keys, khash, cols, int64_t sign=1):
        """Take back an earlier :meth:`add` of the same rows and sign (a rollback's undo, after the changes made since
        it were taken back): every product and sum wraps, so the sums return exactly to those the index held, though
        a row's own product or a sum halfway lies outside int64 (csrc/keyindex.h). Raises MemoryError or ValueError
        when a key the add removed finds no room again (the index is then broken)."""
        cdef BatchView b = view_of(table, weights)
        cdef Int32s k = Int32s(keys)
        cdef Int32s c = Int32s(cols)
        kh = np.ascontiguousarray(khash, dtype=np.uint64)
        if k.n != self.nkeys or c.n != self.nvals:
            raise ValueError(f"KeyIndex.take_back: {k.n} keys and {c.n} columns for an index of {self.nkeys} and "
                             f"{self.nvals}")
        if kh.shape[0] != b.c.nrows:
            raise ValueError(f"KeyIndex.take_back: {kh.shape[0]} key hashes for {b.c.nrows} rows")
        if b.c.nrows == 0:
            return
        cdef const uint64_t[::1] pk = kh
        cdef int st
        with nogil:
            st = dbsp_keyindex_take_back(self.ix, &b.c, k.p, &pk[0], c.p, sign)
        check_status(st, "KeyIndex.take_back")

    def check(self):
        """Raise AssertionError unless csrc/keyindex.h invariants 1-3 hold (tests)."""
        assert dbsp_keyindex_check(self.ix) == DBSP_OK, "KeyIndex invariants violated"


def keyindex_budget(bytes=None):
    """The process-wide budget on the slot tables of every KeyIndex (csrc/keyindex.h invariant 6), in bytes (0:
    none); with ``bytes``, set it first (an int >= 0). A growth that would pass it fails as one past the index's
    own ``max_bytes`` does."""
    if bytes is not None:
        if isinstance(bytes, bool) or not isinstance(bytes, int) or bytes < 0:
            raise ValueError(f"keyindex_budget: bytes must be an int >= 0, got {bytes!r}")
        dbsp_keyindex_set_budget(bytes)
    return dbsp_keyindex_budget()


def keyindex_total_bytes():
    """Bytes held by the slot tables of every KeyIndex in the process now (csrc/keyindex.h invariant 6)."""
    return dbsp_keyindex_total_bytes()


def keyindex_test_hash_bits(int bits):
    """Tests only (csrc/keyindex.h invariant 8): from now on every KeyIndex keeps only the low ``bits`` bits of
    each key hash in its slot tags (0: all 28), so distinct keys share tags and only their words and bytes tell
    them apart. Set it before making the indexes it is for, and back to 0 after: an index must not be used under
    a setting other than the one it was made under."""
    dbsp_keyindex_test_hash_bits(bits)


def keyindex_supports(types):
    """Whether a KeyIndex can key on columns of these Arrow types (the C constructor's rule: fixed width, strings
    and binaries, at most DBSP_KEYINDEX_MAX_KEYS columns)."""
    try:
        KeyIndex(types, 1)
    except (SchemaError, ValueError):
        return False
    return True
