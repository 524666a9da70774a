"""The key-index cache of a trace: per key, the sums over the trace's content kept beside its batches, so a read
probes once per key instead of walking every batch.

Invariant (trace invariant 11, enforced here):
 11. A trace may keep a key index (:meth:`Trace.keep_index`, csrc/keyindex.h): per key (the trace key, or the whole
     row), the sums over the trace's content of weight times some int64 columns (or of the weight alone). It is a
     cache: the batches stay the state (checkpoints, shard cuts, rollback and merges never read it). Every change of
     content takes a fresh token (``_token``, from one process-wide counter); the index holds the token of the
     content its sums match, so it is read only while the two are equal. An insert adds the batch to the sums, a
     shard cut subtracts the moved rows; anything else (clear, drop_below, a rollback that puts back an earlier
     token) leaves the index stale. A stale index is rebuilt from the batches, O(rows) once, by the third read
     that wants it (the first two walk the batches), so a trace that is loaded afresh for every job (a stage task
     without its cache) never pays for an index it would not keep; a stale index of an empty trace (a restore of
     no rows: every new durable pipeline's first load) is rebuilt by the first read, which reads nothing. Reads
     through a current index give exactly what the walk over the batches gives.
     A whole-row index (``on="row"``: a distinct's, a count distinct's) past INDEX_FLOOR bytes whose entries (at
     3/4 full) hold more than INDEX_RATIO times its trace's rows (their data, weight and key hash) costs more memory
     than the state it serves for little speed (the walk over the batches reads a consolidated change in key-hash
     order, as they are) and is dropped for good, quietly: the trace walks its batches. It always passes (a copy of
     every column and the weight, and a slot word), so a large distinct keeps its rows only. A key index (an
     aggregate's, a join's) is about as large as its trace's rows when each key has one row, and is kept: it serves
     an aggregate's one-pass step, several times faster than the walk. Under a memory budget (a BatchStore) any
     index past ``BatchStore.INDEX_MAX_SHARE`` times the cache share (and past ``BatchStore.INDEX_KEEP_BYTES``) is
     dropped for good, quietly, the same way
     (trace/spill.py invariant 17: the cache could not hold it, and every step would fault its pages back).
     A deferred change (trace invariant 14) parks the index instead of folding: the trace holds it aside
     (``_kix_parked``) with the folds it is owed, in order (``_kix_owed``: (batch, sign)); while parked, every
     change that would fold appends to them instead, anything else drops the index as above, and reads walk the
     batches (it is neither read nor rebuilt). Inserts pay the folds in bounded pieces; when none is owed it is
     current again. A payment gives the parked index and the trace a fresh common marker (``_kix_ptoken``), so a
     rollback to before it (which puts back owed folds the index already holds) is seen and drops it.

The index's state lives in the trace's own attributes (``_token``, ``_kix*``), so a rollback's capture of a trace's
attributes (dbsp_core/runtime/rollback.py invariant 1) holds it too. Its size limits come from
dbsp_core/trace/sizing.py, computed when the first index is built.
"""

from __future__ import annotations

import itertools
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from dbsp_core.envvars import settings
from dbsp_core.errors import DbspError, IndexDroppedWarning, WeightOverflowError
from dbsp_core.trace.sizing import key_index_sizing

if TYPE_CHECKING:
    from dbsp_core.zset import IndexedZSet

__all__ = ["KeyIndexed", "PendingBatch", "PerKeyTotals", "summable"]

_TOKENS = itertools.count(1)  # content tokens (invariant 11): unique in the process, never reused


def _bytes_type(t: pa.DataType) -> bool:
    """Whether ``t`` is a string or binary type (a key index keeps such values in its arena: csrc/keyindex.h
    invariant 8)."""
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or \
        pa.types.is_large_binary(t)


def _canonical(batch: "IndexedZSet") -> "IndexedZSet":
    """``batch`` (consolidated, in key-hash order only: a key's rows in any order) in canonical order (csrc/rows.h
    invariant 2), for an insert."""
    return batch.zset.index_by(list(batch.key))


def summable(t: pa.DataType) -> bool:
    """Whether a key index can sum a column of type ``t`` as int64 (csrc/keyindex.h): integers other than uint64,
    dates (date32) and timestamps.

    >>> summable(pa.int32()), summable(pa.timestamp("ms")), summable(pa.uint64()), summable(pa.float64())
    (True, True, False, False)
    """
    return ((pa.types.is_integer(t) and not pa.types.is_uint64(t)) or pa.types.is_date32(t)
            or pa.types.is_timestamp(t))


class KeyIndexed:
    """The key-index half of :class:`~dbsp_core.trace.Trace` (invariant 11): keeping, updating, reading and
    dropping its key index. It uses the trace's ``schema``, ``key``, ``pending``, ``_by_level``, ``_read()``,
    ``_read_for()``, ``_check_files()`` and ``_levels()``; the trace calls :meth:`_changed` at every change of content and
    :meth:`_init_key_index` when it is made."""

    INDEX_WAIT = 2  # reads that walk the batches before a stale key index is rebuilt (invariant 11)
    INDEX_FLOOR = 64 << 20  # bytes of whole-row index any trace may keep, whatever its rows (invariant 11)
    INDEX_RATIO = 1.0  # past the floor, a whole-row index may hold this times its trace's row bytes (invariant 11)
    # (bench/RESULTS.md "State memory per row": 1k-row steps on a 3.2M-row distinct took p50 1.73-2.50 ms with its
    # whole-row index, 80.5 B/row beside 40 B of row, and 0.74-1.34 ms without; a 5M-row group-by, p50 1.5 ms
    # with its key index and 7.6 without, under load)

    def _init_key_index(self) -> None:
        """A new trace's content token; no key index kept."""
        self._token = next(_TOKENS)  # the content's token (invariant 11)
        self._kix_spec: tuple | None = None  # ("key" | "row", sum columns) of the key index kept, if any
        self._kix = None  # the key index (a _zset.KeyIndex), current while its token is self._token
        self._kix_off = False  # the index failed (overflow, memory, size): this trace walks its batches
        self._kix_wait = 0  # reads that walk the batches before a stale index is rebuilt (invariant 11)
        self._kix_seen = 0  # the index's bytes when last weighed against the rows (invariant 11)
        self._kix_parked = None  # the index while a deferred change owes it folds (trace invariant 14)
        self._kix_owed: tuple = ()  # those folds, in order: (batch, +1 inserted | -1 removed)
        self._kix_ptoken = 0  # the parked index's marker as of the last payment (a rollback past one drops it)

    def keep_index(self, columns: tuple, on: str = "key") -> bool:
        """Keep a key index of the sums of weight times each column of ``columns`` (an integer column other than
        uint64, a date or a timestamp, summed as int64; None: the weight alone; ``("valid", c)``: the weight where
        column ``c`` is not null), per trace key (``on="key"``: serves :meth:`key_sums` of int64 columns, and
        :meth:`index_for_update`) or per whole row (``on="row"`` with ``(None,)``: serves :meth:`match_weights`).
        Returns whether the index is kept: for keys of fixed-width, string and binary columns (strings are compared
        byte for byte in the index, never by hash: csrc/keyindex.h invariant 8), whole rows of fixed-width columns
        only (a whole-row index over strings would copy every string of a distinct's rows), and not when
        ``DBSP_KEY_INDEX=0``. Costs memory beside the batches (per key, 8 bytes per key column and sum, a slot
        word of 8 in a table at most 3/4 full, and per string value a record of 8 bytes and its bytes rounded up
        to 8); a trace whose index would pass ``DBSP_KEY_INDEX_MB`` (by default an
        eighth of the memory, at least 512 MiB: dbsp_core/trace/sizing.py), or take the indexes of the process past
        ``DBSP_KEY_INDEX_TOTAL_MB`` together, drops it with an IndexDroppedWarning and walks its batches as without
        one."""
        from dbsp_core import _zset

        if on not in ("key", "row"):
            raise ValueError(f"keep_index: on must be 'key' or 'row', got {on!r}")
        if on == "row" and tuple(columns) != (None,):
            raise ValueError("keep_index: a whole-row index keeps the weights only (columns=(None,))")
        names = list(self.key) if on == "key" else list(self.schema.names)
        for c in columns:
            if isinstance(c, tuple):
                if len(c) != 2 or c[0] != "valid" or self.schema.get_field_index(c[1]) < 0:
                    raise ValueError(f"keep_index: {c!r} is not ('valid', <column>)")
            elif c is not None and not summable(self.schema.field(c).type):
                raise ValueError(f"keep_index: column {c!r} is {self.schema.field(c).type}, which does not sum as int64")
        types = [self.schema.field(n).type for n in names]
        if not settings().key_index or not columns or not _zset.keyindex_supports(types) or (
                on == "row" and any(_bytes_type(t) for t in types)):
            return False
        self._kix_spec = (on, tuple(columns))
        self._kix = None  # built from the batches at the first read that wants it
        self._kix_parked, self._kix_owed = None, ()
        if not self._by_level and not self.pending:  # empty: an empty index is current, inserts keep it so
            self._kix = self._new_index()
        return True

    @property
    def index_spec(self) -> tuple | None:
        """``(on, columns)`` of the key index this trace keeps (:meth:`keep_index`), None when it keeps none (not
        asked for, not supported for its key, or turned off after a failure)."""
        return None if self._kix_off else self._kix_spec

    def _changed(self) -> int:
        """The content changes: take a fresh token (invariant 11); returns the previous one."""
        prev, self._token = self._token, next(_TOKENS)
        return prev

    def _stale_index(self) -> None:
        """Drop the key index: the third read that wants it rebuilds it from the batches (invariant 11)."""
        if self._pk_rec and not self._pk_syncing:  # totals per key: the index holds state the batches lack
            self._pk_sync()
        self._kix, self._kix_wait = None, self.INDEX_WAIT
        self._kix_parked, self._kix_owed = None, ()

    @property
    def index_bytes(self) -> int:
        """Memory held by the key index (its slot table), 0 without one."""
        ix = self._kix if self._kix is not None else self._kix_parked
        return int(ix.nbytes) if ix is not None else 0

    def _new_index(self) -> Any:
        from dbsp_core import _zset

        on, cols = self._kix_spec
        names = self.key if on == "key" else self.schema.names
        limit = int(key_index_sizing().index_mb * 2**20)  # the first index built sizes them all (sizing.py)
        ix = _zset.KeyIndex([self.schema.field(n).type for n in names], len(cols), limit)
        ix.token = self._token
        if self._store is not None:  # under a memory budget: its large regions are files (spill.py invariant 17)
            ix.set_dir(self._store.directory)
        return ix

    def _index_to_files(self, directory: str) -> None:
        """The trace joins a BatchStore: its key index, if any, keeps its large regions in files of ``directory``
        (csrc/keyindex.h invariant 7, spill.py invariant 17)."""
        if self._pk_on:  # totals per key only without a store (trace invariant 19): into the batches first
            self._pk_off()
        for ix in (self._kix, self._kix_parked):
            if ix is not None:
                try:
                    ix.set_dir(directory)
                except MemoryError as exc:  # as a failed fold: this trace walks its batches from now on
                    self._drop_index(exc)
                    return

    @property
    def held_index(self) -> Any:
        """The key index held (current or parked), None without one: what a BatchStore's cache evicts (spill.py
        invariant 17)."""
        return self._kix if self._kix is not None else self._kix_parked

    def _index_args(self, b: "IndexedZSet") -> tuple:
        """(view, key positions, key hashes, sum positions) of a batch for the key index."""
        on, cols = self._kix_spec
        ncols = len(b.schema)
        cpos = [-1 if c is None else -2 - b.schema.get_field_index(c[1]) if isinstance(c, tuple)
                else b.schema.get_field_index(c) for c in cols]
        if on == "key":
            return b._view(), b._keypos, b._kh, cpos
        return b._view(), list(range(ncols)), b._row_hashes(), cpos

    def _index_fold(self, batches: list["IndexedZSet"], sign: int, prev: int) -> None:
        """Fold ``batches`` into the index (sign +1: inserted, -1: removed) if it matched the content of token
        ``prev``; the content is now at ``self._token``. A stale index is dropped; a failing one turns it off."""
        ix = self._kix
        if ix is None:
            return
        if ix.token != prev:
            self._stale_index()
            return
        ix.token = None  # a failure half way leaves it stale
        try:
            for b in batches:
                if len(b):
                    view, keys, kh, cpos = self._index_args(b)
                    self._ix_add(ix, view, keys, kh, cpos, sign)
        except (ArithmeticError, MemoryError, ValueError) as exc:  # WeightOverflowError, SchemaError included: walk
            self._drop_index(exc)  # instead
            return
        ix.token = self._token
        self._weigh_index()

    def _owe_folds(self, batches: list["IndexedZSet"], sign: int, prev: int) -> None:
        """A deferred change (trace invariant 14): park the index, if it matched the content of token ``prev``, owing
        the fold of ``batches``; an index parked already is owed them after its other folds."""
        ix = self._kix
        if ix is not None:
            if ix.token != prev:
                self._stale_index()
                return
            self._kix, self._kix_parked, self._kix_owed = None, ix, ()
            ix.token = self._kix_ptoken = next(_TOKENS)
        elif self._kix_parked is None:
            return  # no index kept, or a stale one: nothing to fold
        self._kix_owed = self._kix_owed + tuple((b, sign) for b in batches if len(b))

    def _pay_folds(self, rows: int) -> None:
        """Fold up to ``rows`` owed rows into the parked index, oldest first (a batch in zero-copy slices); once none is
        owed, it is the current index again (trace invariant 14)."""
        ix = self._kix_parked
        if ix.token != self._kix_ptoken:  # a rollback put back folds it holds already
            self._stale_index()
            return
        owed = list(self._kix_owed)
        ix.token = None  # a failure half way leaves it stale
        try:
            while owed and rows > 0:
                b, sign = owed[0]
                part = b if len(b) <= rows else b.slice(0, rows)
                view, keys, kh, cpos = self._index_args(part)
                self._ix_add(ix, view, keys, kh, cpos, sign)
                rows -= len(part)
                owed[0:1] = [] if part is b else [(b.slice(len(part), len(b)), sign)]
        except (ArithmeticError, MemoryError, ValueError) as exc:  # as _index_fold: the trace walks its batches
            self._kix, self._kix_parked, self._kix_owed = ix, None, ()
            self._drop_index(exc)
            return
        if owed:
            self._kix_owed = tuple(owed)
            ix.token = self._kix_ptoken = next(_TOKENS)
        else:
            self._kix, self._kix_parked, self._kix_owed = ix, None, ()
            ix.token = self._token
            self._weigh_index()

    def _row_bytes(self) -> int:
        """Bytes of one trace row for the lean-state rule (invariant 11): its fixed-width columns, 8 for each other
        one (a lower bound: an offset and a little data), its weight and its key hash."""
        return 16 + sum(max(f.type.bit_width // 8, 1) if pa.types.is_primitive(f.type) and f.type.bit_width
                        else 8 for f in self.schema)

    def _weigh_index(self) -> None:
        """Drop the index for good when the trace is under a BatchStore and the index passes the store's
        ``INDEX_MAX_SHARE`` times its cache share and its ``INDEX_KEEP_BYTES`` (by its bytes, at every weighing); drop a whole-row index for good
        when it is past INDEX_FLOOR and its entries, with their slot words at the table's fullest (an entry of key
        columns + sums words and a slot word at 3/4 full per key, csrc/keyindex.h invariant 3), hold more than
        INDEX_RATIO times the bytes of the trace's rows (invariant 11). Weighed when the index's size changes; by
        its entries, not by its table, so a table just doubled (or its old half still beside it, while it grows)
        does not count against it."""
        ix = self._kix
        if ix is None:
            return
        size = int(ix.nbytes)
        store = self._store
        if store is not None and store.INDEX_MAX_SHARE is not None and size > max(
                store.INDEX_KEEP_BYTES, store.INDEX_MAX_SHARE * store.memory_limit * store.CACHE_SHARE):  # too big
            self._kix, self._kix_off = None, True  # a choice, not a failure: no warning
            return
        if self._kix_spec[0] != "row" or size <= self.INDEX_FLOOR or size == self._kix_seen:
            return
        self._kix_seen = size
        entries = len(ix) * ((ix.nkeys + ix.nvals) * 8 + 8 * 4 // 3)
        if entries > self.INDEX_RATIO * self.num_rows * self._row_bytes():
            self._kix, self._kix_off = None, True  # a choice, not a failure: no warning

    def _index_sums(self, spec: tuple, batches: list["IndexedZSet"], view: Any, ppos: list[int], khash: np.ndarray,
                    rows: np.ndarray | None, acc: np.ndarray) -> bool:
        """Add the sums of the key index for ``spec`` to ``acc`` (one row per probed row: ``rows[i]`` of ``view``,
        or row i without ``rows``; key columns ``ppos``, key hashes ``khash``); False, with ``acc`` untouched, when
        the index cannot serve: none kept for ``spec``, stale and not rebuilt yet, or probe key types that differ
        from the trace's (the caller then walks the batches)."""
        if self._kix_spec != spec or self._kix_off:
            return False
        names = self.key if spec[0] == "key" else self.schema.names
        probe = view.pyschema
        if len(ppos) != len(names) or not all(probe.field(p).type.equals(self.schema.field(n).type)
                                              for p, n in zip(ppos, names)):
            return False
        ix = self._index(spec, batches)
        if ix is None:
            return False
        ix.get(view, ppos, khash, acc, sel=rows)
        return True

    def _index(self, spec: tuple, batches: list["IndexedZSet"]) -> Any:
        """The key index for ``spec`` matching the content (``batches``: every batch, as read), rebuilt if stale;
        None when the trace keeps no such index."""
        if self._kix_spec != spec or self._kix_off or self._kix_parked is not None:
            return None  # parked: owed folds first (trace invariant 14)
        ix = self._kix
        if ix is not None and ix.token == self._token:
            return ix
        if self._kix_wait > 0 and any(len(b) for b in batches):  # an empty trace's build reads nothing: at once
            self._kix_wait -= 1
            return None
        self._check_files()  # the build reads every row (trace/spill.py invariant 14)
        self._kix = self._new_index()
        self._index_fold(batches, 1, self._token)
        return self._kix

    def index_for_update(self, spec: tuple) -> Any:
        """The key index kept for ``spec`` (invariant 11), current with the content, for a caller that stores a
        batch's effect in it itself (the linear aggregate's one-pass step, ``_zset.linear_step``) and then inserts
        that batch with ``insert(batch, indexed=ix)``, or calls :meth:`index_done` when it inserts nothing. Until
        then the index counts as stale, so a failure in between leaves it to be rebuilt, never read. None when the
        trace keeps no such index, or it is stale and not rebuilt yet: the caller then reads with :meth:`key_sums`
        and inserts plainly."""
        if self._kix_spec != spec or self._kix_off:
            return None
        ix = self._kix
        if ix is None or ix.token != self._token:
            ix = self._index(spec, self._read())  # a stale index: the third read that wants it rebuilds it
            if ix is None:
                return None
        else:
            store = self._store if self._store is not None else self._attach()
            if store is not None:  # no batch is read, but the index is: its pages count as used (spill.py inv. 17)
                store.note_read(self, whole=False)
        ix.token = None
        return ix

    def index_done(self, ix: Any, failed: BaseException | None = None) -> None:
        """The caller of :meth:`index_for_update` left ``ix`` as it found it (nothing to insert), or broke it half
        way with the error ``failed`` (memory, size limit): the trace then walks its batches from now on."""
        if ix is not self._kix:
            return
        if failed is not None:
            self._drop_index(failed)
        else:
            ix.token = self._token

    def _drop_index(self, exc: BaseException | None) -> None:
        """Turn the key index off for good (it failed with ``exc``; None: a size limit met half way): this trace
        walks its batches from now on, and says so once with an IndexDroppedWarning."""
        ix = self._kix
        if self._pk_rec and ix is not None and not ix.broken and ix.token == self._token:
            _PK_COUNTS["pk_fallbacks"] += 1
            self._pk_sync()  # totals per key (trace invariant 19), the index whole: its totals into the batches first
        if self._pk_rec:  # the broken index held state the batches lack (an overflow half way; or a string key that
            # an undone store could not put back: csrc/keyindex.h invariant 4)
            raise DbspError(f"a trace on key {list(self.key)} keeping its totals per key lost its key index half way "
                            f"through a step ({exc!r}); its state since its last sync is lost. Run with "
                            f"DBSP_TOTALS_PER_KEY=0 and recover from the last checkpoint")
        self._pk_on = False
        ix, self._kix, self._kix_off = self._kix, None, True
        self._kix_parked, self._kix_owed = None, ()
        from dbsp_core import _zset

        if isinstance(exc, ArithmeticError):
            why = f"a sum leaves int64 ({exc})"
        elif isinstance(exc, MemoryError):
            why = f"out of memory ({exc})"
        elif exc is None or (type(exc) is ValueError and ix is not None and (ix.broken or ix.refusals)):  # the limits
            sizing = key_index_sizing()
            why = (f"growing past {int(ix.nbytes if ix is not None else 0) / 2**20:.1f} MiB would pass "
                   f"DBSP_KEY_INDEX_MB ({sizing.index_mb:.0f}) or the budget of all indexes together, "
                   f"DBSP_KEY_INDEX_TOTAL_MB ({sizing.total_mb:.0f}; {_zset.keyindex_total_bytes() / 2**20:.0f} MiB "
                   f"held now)")
        else:
            why = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"a trace on key {list(self.key)} dropped its key index ({len(ix) if ix is not None else 0} "
                      f"keys): {why}. Its results stay exact; its steps walk the batches from now on, slower on a "
                      f"large state", IndexDroppedWarning, stacklevel=2)

    def through_index(self, spec: tuple, fn: Any) -> Any:
        """``fn(ix)`` with the key index for ``spec`` handed out by :meth:`index_for_update` (``fn`` reads and stores
        through it, then inserts with ``insert(batch, indexed=ix)`` or calls :meth:`index_done`, or returns None
        having called it); None when no current index serves. A WeightOverflowError is raised with the index left
        as found when the failed call stored nothing, else stale; a failure on the index's memory or size limit that
        broke it, or whose stores were undone (``ix.refusals``: csrc/linrun.h invariant 4; a per-key trace then syncs
        from the whole index first), turns it off (the trace walks its batches from then on) and returns None, so
        the caller takes the path without it. Another MemoryError or ValueError is raised with the index as found."""
        ix = self.index_for_update(spec)
        if ix is None:
            return None
        refused = ix.refusals
        try:
            out = fn(ix)
            self._weigh_index()
            return out
        except WeightOverflowError:
            if not ix.broken:  # refused before anything was stored
                self.index_done(ix)
            raise  # else broken half way, and stale since index_for_update: a later read rebuilds it
        except (MemoryError, ValueError) as exc:
            if ix.broken:
                self.index_done(ix, failed=exc)
                return None
            self.index_done(ix)  # as found: failed before storing, or its stores undone (csrc/linrun.h invariant 4)
            if ix.refusals == refused:
                raise
            self._drop_index(exc)  # it could not grow: as a broken one, the batches from now on (synced first)
            return None

    def key_weights(self, probe: pa.Table, probe_keys: list[str], khash: np.ndarray, rows: np.ndarray,
                    view: object = None) -> np.ndarray | None:
        """The trace's summed weight per probed key (row ``rows[i]`` of ``probe``, key hash ``khash[i]``) through
        the key index kept with ``keep_index((None,))`` (invariant 11): one probe per key. None when the trace
        keeps no such index, or its index is stale and not rebuilt yet, or the probe's key types differ from the
        trace's: the caller then reads the batches."""
        from dbsp_core import _zset
        from dbsp_core.zset import _column_positions

        spec = ("key", (None,))
        batches = self._read_for(spec)  # rows are read only through the index (trace/spill.py invariant 14)
        acc = np.zeros((len(rows), 1), dtype=np.int64)
        if not batches or not len(rows):
            return acc[:, 0] if self.index_spec == spec else None
        ppos = _column_positions(probe.schema, probe_keys, "key_weights (probe)")
        if not self._index_sums(spec, batches, view if view is not None else _zset.BatchView(probe), ppos, khash,
                                rows, acc):
            return None
        return acc[:, 0]

    def _check_index(self) -> None:
        """Raise AssertionError unless a current key index holds the sums of the batches, or a parked one (trace
        invariant 14) those sums less the folds it is owed (invariant 11; tests)."""
        ix, owed = self._kix, ()
        if ix is None and self._kix_parked is not None and self._kix_parked.token == self._kix_ptoken:
            ix, owed = self._kix_parked, self._kix_owed
        elif ix is None or ix.token != self._token:
            return
        ix.check()
        fresh = self._new_index()
        for b in self._levels() + self.pending:
            view, keys, kh, cpos = self._index_args(b)
            fresh.add(view, None, keys, kh, cpos)
        for b, sign in owed:  # what the parked index has not folded yet
            view, keys, kh, cpos = self._index_args(b)
            fresh.add(view, None, keys, kh, cpos, -sign)
        if not owed:  # (with owed folds, entries whose sums went to zero may differ in number)
            assert len(fresh) == len(ix), ("key index entries", len(ix), len(fresh))
        for b in self._levels() + self.pending + [b for b, _ in owed]:
            view, keys, kh, _ = self._index_args(b)
            got, want = (np.zeros((len(b), ix.nvals), dtype=np.int64) for _ in range(2))
            ix.get(view, keys, kh, got)
            fresh.get(view, keys, kh, want)
            assert np.array_equal(got, want), "key index sums differ from the batches'"


class _Marks:
    """How many rollback captures of one trace are alive (``_Mark`` objects not yet freed)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class _NoMarks:
    """The class default of ``_pk_marks`` (a trace made without ``_init_per_key``): no capture, ever."""

    __slots__ = ()
    n = 0


# the per-key counters of the process (PerKeyTotals.pk_steps and the others read them): kept here, not as class
# attributes written in place, since writing an attribute of a class every step invalidates the method cache of the
# class and its subclasses (Trace): every lookup of a trace's method then walked the MRO again and the interpreter's
# inline caches of them were dropped (a group-by step: ~40k instructions, find_name_in_mro and _PyType_Lookup)
_PK_COUNTS = {"pk_steps": 0, "pk_syncs": 0, "pk_fallbacks": 0, "pk_found_dirty_steps": 0}


class _ProcessCount:
    """A read-only class attribute whose value is ``_PK_COUNTS[name]`` (read as ``PerKeyTotals.pk_steps``)."""

    __slots__ = ("name",)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, owner: type | None = None) -> int:
        return _PK_COUNTS[self.name]


class PerKeyTotals:
    """Totals kept per key (runtime/plan.py design note 5; trace invariant 19): a linear or min/max aggregate's steps
    store their groups' totals in the trace's key index only, and the trace's batches are brought up to date from it
    when something reads them. It uses :class:`KeyIndexed`'s index and the trace's ``insert`` and ``_changed``.

    State (attributes of the trace, so a rollback's capture holds them; their lists are copied by it):
      ``_pk_on``: the mode is on (:meth:`keep_totals_per_key`; off for good once the trace joins a batch store or its
      index is dropped, each after a sync). ``_pk_rec``: per dirty key (a key whose totals changed since the last
      sync), once, the totals the batches hold for it: tuples (table of key and total columns, key hashes, whether
      the batches hold a row for it); ``_pk_dirty``: a KeyIndex of one count per dirty key (1), which tells a key
      already recorded from a new one. The content is the batches plus, per dirty key, (index totals) - (recorded
      totals). ``_pk_undo``: while a rollback capture is alive (``_pk_marks``), every change made to a key index
      object in place since the oldest one: (index, view of rows, key positions, key hashes, columns, sign), undone in
      reverse by :meth:`_pk_rollback` (rollback.py invariant 3): the index is the state, a capture cannot rebuild it.
      A step's own store is logged as (index, its IndexedZSet batch, ..., None, 1): the view and columns are made
      by the rollback (a view costs ~50k instructions, a step without a rollback never needs it); the batch may be a
      :class:`PendingBatch`, built then too (a step that reads none of its rows need not build them at all).
    """

    pk_steps = _ProcessCount()  # steps stored per key, in the process (counts, for tests: the new path ran)
    pk_syncs = _ProcessCount()  # syncs that inserted a batch, in the process
    pk_fallbacks = _ProcessCount()  # per-key traces whose index could not grow (a store undone), synced, to batches
    pk_found_dirty_steps = _ProcessCount()  # steps told every key of the index is dirty (pk_found_dirty)
    _pk_on = False  # (class defaults: a trace made without __init__, as a restore may make one)
    _pk_rec: Any = ()
    _pk_dirty: Any = None
    _pk_undo: Any = None
    _pk_marks: Any = _NoMarks()  # (a _Marks from _init_per_key)
    _pk_syncing = False
    _pk_clean = -1
    _pk_clean_at = 0

    def _init_per_key(self) -> None:
        self._pk_clean = -1  # keys of the index not dirty, as of content token _pk_clean_at (-1: not known)
        self._pk_clean_at = 0
        self._pk_on = False
        self._pk_rec: list = []
        self._pk_dirty = None
        self._pk_undo = _UndoLog()  # not a list: a capture keeps this object, not a copy
        self._pk_marks = _Marks()  # the captures alive: a count their _Marks keep (a WeakSet's len, add and removal
        # are calls of Python, ~5 a step a trace)
        self._pk_syncing = False

    def keep_totals_per_key(self) -> bool:
        """Keep the totals per key (trace invariant 19) when the trace keeps a key index on its key of every non-key
        column, in order, each an integer-like column (a linear aggregate's totals), then maybe "valid" flags of some
        of them (a min/max's totals: an extreme's column null where its flag is 0), and no batch store holds it;
        returns whether it does."""
        if self._kix_spec is None or self._kix_off or self._kix_spec[0] != "key" or self._store is not None:
            return False
        cols = list(self._kix_spec[1])
        names = [c for c in cols if not isinstance(c, tuple)]
        if list(self.key) + names != list(self.schema.names) or cols[:len(names)] != names:
            return False
        if any(c[0] != "valid" or c[1] not in names for c in cols[len(names):]):
            return False
        if not all(pa.types.is_integer(t) or pa.types.is_timestamp(t) or pa.types.is_date32(t)
                   for t in self.schema.types[len(self.key):]):
            return False
        self._pk_on = True
        return True

    @property
    def totals_per_key(self) -> bool:
        return self._pk_on

    def unsynced_size(self) -> tuple[int, int, list]:
        """What a size figure adds to the batches' rows and bytes for the totals the batches lack (invariant 19), as
        ``(rows, bytes, [(key hashes, bytes per key)])``: the rows the next sync would insert at most (per dirty key
        its recorded row, when the batches hold one, and its row of index totals; fewer when a key's totals came
        back to the recorded ones or its group is gone), and the bytes a batch of them takes (data, weight, key
        hash), by the recorded rows' widths; the key hashes split the bytes per shard. (0, 0, []) when nothing is
        unsynced (per key off, or synced).

        Syncs nothing, probes no index (a step may be storing into it on another thread: it releases the GIL in
        C): it reads a snapshot of the records only, a list a step only extends (under the GIL) and a sync replaces
        by a new one, of tuples never changed, copied here in one ``list()`` under the GIL. A reader that runs
        beside steps (metrics, the profile, the autoscaler) holds the pipeline's step lock besides, so no step or
        sync runs between this and its read of the batches (without it, a sync between the two would count the
        synced keys twice or not at all: an estimate)."""
        recs = list(self._pk_rec)
        rows = nbytes = 0
        hashes = []
        for part, pkh, old in recs:
            n = len(pkh)
            if not n:
                continue
            per = part.nbytes / n + 16.0  # its data, and a weight and a key hash per row
            k = 2 if old else 1  # an old row's key: its recorded row (-1) and its row of index totals (+1)
            rows += k * n
            nbytes += k * n * per
            hashes.append((pkh, k * per))
        return rows, int(round(nbytes)), hashes

    def _ix_add(self, ix: Any, view: Any, keys: Any, kh: np.ndarray, cpos: Any, sign: int) -> None:
        """``ix.add`` that, while a capture is alive, records the change for its undo (invariant 19)."""
        ix.add(view, None, keys, kh, cpos, sign)
        if self._pk_marks.n:
            self._pk_undo.entries.append((ix, view, keys, kh, cpos, sign))

    def pk_dirty(self, ix: Any) -> Any:
        """The index of the dirty keys (invariant 19) that :meth:`store_totals` will probe for a step storing through
        ``ix``, for a C step to probe it first (csrc/linrun.h invariant 5); None when it has none (or ``ix`` is not
        this trace's key index)."""
        return self._pk_dirty if self._pk_on and ix is self._kix else None

    def pk_found_dirty(self) -> bool:
        """Whether every key of the key index is dirty (invariant 19): none is clean as of the present content, so a C
        step need not probe the dirty index for a key the key index holds (csrc/linrun.h invariant 6). The count of
        clean keys is kept by :meth:`store_totals` from step to step under one content token: any other change of
        content (an insert, a cut, a rollback to another token) leaves it unknown until the dirty index is next
        started afresh (after a sync), when every key of the index is clean but the step's."""
        if self._pk_clean == 0 and self._pk_clean_at == self._token:
            _PK_COUNTS["pk_found_dirty_steps"] += 1
            return True
        return False

    def pk_keyorder(self, ix: Any) -> bool:
        """Whether a step storing through ``ix`` may hand :meth:`store_totals` its batch in key-hash order only (a
        key's rows in any order, csrc/linrun.h invariant 8): the batch is then recorded per key, not inserted as it
        stands (a batch that is inserted after all, on a fallback, is put in canonical order first)."""
        return self._pk_on and ix is self._kix and (self._store is None or bool(self._pk_rec))

    def store_totals(self, batch: "IndexedZSet", ix: Any, probed: "tuple | None" = None, canonical: bool = True
                     ) -> None:
        """The step's rows of old (-1) and new (+1) totals of its changed groups, which the caller already stored in
        ``ix`` (from :meth:`index_for_update`): inserted as any batch, or with totals per key only recorded: each of
        its keys not dirty yet is recorded with the totals the batches hold for it (its -1 row, or none).
        ``probed``: ``(dirty, fresh)``, the answers of a probe of the dirty index ``dirty`` per row of ``batch`` made
        since the step began (:meth:`pk_dirty`, csrc/linrun.h invariant 5), used while ``dirty`` is still the dirty
        index (a sync since replaced it). ``canonical`` False: ``batch`` is in key-hash order only (:meth:`pk_keyorder`),
        put in canonical order before any insert. ``batch`` may be a :class:`PendingBatch`: built here only where its
        rows are read (an insert, a probe of the dirty index, a record of fresh keys), else logged for a rollback as
        it stands."""
        if self._pk_on and self._store is not None and not self._pk_rec:  # joined a batch store (the executor's
            self._pk_on = False  # spill()) with nothing recorded: the batches are up to date, kept from now on
        pending = batch if type(batch) is PendingBatch else None
        if not self._pk_on or ix is not self._kix or len(batch) == 0:
            if pending is not None:
                batch = pending.get()
            if self._pk_marks.n and ix is self._kix and len(batch):  # a capture lives (taken while per key):
                self._pk_undo.entries.append((ix, batch._view(), batch._keypos, batch._kh, self._cpos(batch), 1))
            self.insert(batch if canonical else _canonical(batch), indexed=ix)  # the C step's store into ix is logged too, or its undo misses it
            return
        known = self._pk_clean >= 0 and self._pk_clean_at == self._changed()  # (the count as of the content before)
        ix.token = self._token
        _PK_COUNTS["pk_steps"] += 1
        self.inserted_rows += len(batch)
        self._grown += len(batch)  # (drop_below's amortization, trace invariant 8)
        keys, kh = batch._keypos, batch._kh
        if self._pk_marks.n:  # the step's store into ix is +batch: its undo is -batch (the batch logged as it
            # stands, pending or not: its view and columns are made by a rollback, which is rare, not by every step)
            self._pk_undo.entries.append((ix, batch, keys, kh, None, 1))
        dirty = self._pk_dirty
        w = batch.weights if pending is not None else batch.zset.weights
        started = dirty is None
        if started:  # no key dirty: the index's keys are clean but this step's (one +1 row each in the index)
            from dbsp_core import _zset

            dirty = self._pk_dirty = _zset.KeyIndex([self.schema.field(k).type for k in self.key], 1, 0)
            known, clean = True, len(ix) - int(np.count_nonzero(w > 0))
        else:
            clean = self._pk_clean
        if probed is not None and probed[0] is dirty and probed[1] is not None and len(probed[1]) == len(batch):
            fresh = probed[1]
        else:
            if pending is not None:
                batch = pending.get()
            acc = np.zeros((len(batch), 1), dtype=np.int64)
            dirty.get(batch._view(), keys, kh, acc)
            fresh = acc[:, 0] == 0
        if fresh.any():
            if pending is not None:
                batch = pending.get()
            try:
                self._pk_record(batch, dirty, fresh)
            except (MemoryError, ValueError) as exc:  # the dirty-key index could not grow (memory, the budget)
                if dirty.broken:  # (not undone: csrc/keyindex.h invariant 4)
                    raise
                self._pk_drop_recording(batch, fresh, exc, canonical)
                return
            if not started:
                clean -= int(np.count_nonzero(fresh & (w < 0)))  # a fresh key's -1 row: a clean key made dirty
        self._pk_clean, self._pk_clean_at = (clean, self._token) if known else (-1, 0)
        if self._store is not None:  # joined a batch store (the executor's spill()): batches from now on
            self._pk_off()

    def _pk_record(self, batch: "IndexedZSet", dirty: Any, fresh: np.ndarray) -> None:
        """Record the keys of ``batch``'s rows ``fresh`` (not dirty yet), once each, with the batches' totals. A
        failure of the dirty index (memory, the budget) leaves it and the records as they were."""
        view, keys, kh, w = batch._view(), batch._keypos, batch._kh, batch.zset.weights
        done: list = []  # (view, key hashes, sign) added to the dirty index, to take back if a later add fails
        recs: list = []
        try:
            for old in (True, False):  # old rows first: a key's -1 row holds the totals its batches hold
                sel = np.flatnonzero(fresh & ((w < 0) if old else (w > 0)))
                if not old and len(sel):  # a key with no -1 row in this step is a new group (the batches hold none)
                    acc = np.zeros((len(sel), 1), dtype=np.int64)
                    dirty.get(view, keys, kh[sel], acc, sel=sel)
                    sel = sel[acc[:, 0] == 0]
                if not len(sel):
                    continue
                part = batch.zset.data.take(pa.array(sel))
                pkh = np.ascontiguousarray(kh[sel])
                pv = _view_of(part, np.full(len(sel), -1 if old else 1, dtype=np.int64))
                dirty.add(pv, None, keys, pkh, [-1], -1 if old else 1)  # taken back by itself if it fails
                done.append((pv, pkh, -1 if old else 1))
                recs.append((part, pkh, old))
        except (MemoryError, ValueError):
            if not dirty.broken:
                for pv, pkh, sign in reversed(done):  # removals only: they cannot fail
                    dirty.add(pv, None, keys, pkh, [-1], -sign)
            raise
        if self._pk_marks.n:
            self._pk_undo.entries.extend((dirty, pv, keys, pkh, [-1], sign) for pv, pkh, sign in done)
        self._pk_rec.extend(recs)

    def _pk_drop_recording(self, batch: "IndexedZSet", fresh: np.ndarray, exc: BaseException, canonical: bool = True
                           ) -> None:
        """The dirty-key index could not record the step's fresh keys (memory, the budget; it is as it was), whose
        totals the key index holds already: sync the keys dirty before (their index totals include the step's), then
        insert the step's rows of the fresh keys (the change of their totals, which the index holds too), and keep
        the totals in the batches from now on, the index dropped as a failed one is (invariant 19)."""
        from dbsp_core.zset import IndexedZSet, ZSet

        _PK_COUNTS["pk_fallbacks"] += 1
        self._pk_sync()
        sel = np.flatnonzero(fresh)
        part = batch if len(sel) == len(batch) else IndexedZSet._make(
            ZSet._make(batch.zset.data.take(pa.array(sel)), batch.zset.weights[sel]), batch.key, batch._kh[sel])
        self.inserted_rows -= len(part)  # (counted by store_totals already)
        self.insert(part if canonical else _canonical(part), indexed=self._kix)
        self._drop_index(exc)

    def _cpos(self, batch: "IndexedZSet") -> list:
        return self._index_args(batch)[3]

    def _pk_sync(self) -> None:
        """Bring the batches up to date from the index (invariant 19): one consolidated, key-hash-sorted batch of the
        dirty keys' recorded totals (-1) and their index totals (+1), where the two differ."""
        if not self._pk_rec or self._pk_syncing:
            return
        from dbsp_core.zset import ZSet

        ix = self._kix
        if ix is None or ix.token != self._token:
            raise AssertionError("totals per key: the key index is not current at a sync (its totals are the state)")
        recs, self._pk_rec, self._pk_dirty = self._pk_rec, [], None  # a new dirty index: a capture keeps the old one
        data = pa.concat_tables([r[0] for r in recs])
        kh = np.concatenate([r[1] for r in recs])
        had = np.concatenate([np.full(len(r[1]), r[2]) for r in recs])
        nk = len(self.key)
        keys = list(range(nk))
        new = np.zeros((len(kh), ix.nvals), dtype=np.int64)
        ix.get(_view_of(data, None), keys, kh, new)
        cols = list(self._kix_spec[1])  # the columns, then "valid" flags of some (keep_totals_per_key)
        old = np.column_stack([_index_value(data, c) for c in cols])
        has = new[:, 0] != 0  # slot 0 is the row count: a group of the index (operators/aggregate.py invariant 1)
        same = had & has & (old == new).all(axis=1)
        minus, plus = np.flatnonzero(had & ~same), np.flatnonzero(has & ~same)
        if not len(minus) and not len(plus):
            return
        kcols = data.select(keys).take(pa.array(plus))
        flags = {c[1]: j for j, c in enumerate(cols) if isinstance(c, tuple)}
        ptab = pa.Table.from_arrays(
            list(kcols.columns) + [int_array(new[plus, j], f.type, new[plus, flags[c]] == 0 if c in flags else
                                             np.zeros(len(plus), dtype=bool))
                                   for j, (c, f) in enumerate(zip(cols, list(self.schema)[nk:]))],
            schema=self.schema)
        table = pa.concat_tables([data.take(pa.array(minus)), ptab]).combine_chunks()
        w = np.concatenate([np.full(len(minus), -1, dtype=np.int64), np.ones(len(plus), dtype=np.int64)])
        b = ZSet._make(table, w).index_by(list(self.key))  # key-hash sorted (its rows are distinct: no sums)
        _PK_COUNTS["pk_syncs"] += 1
        self._pk_syncing = True
        try:
            self.insert(b, indexed=ix)  # the index holds it already: the content is the same (a fresh token)
        finally:
            self._pk_syncing = False

    def _pk_off(self) -> None:
        """Sync, then keep the totals in the batches as before (a batch store joined, the index dropped)."""
        self._pk_sync()
        self._pk_on = False

    def _pk_mark(self) -> Any:
        """A rollback capture of this trace (rollback.py invariant 3): what :meth:`_pk_rollback` needs; None when the
        trace never kept totals per key (its index is a cache: a rollback leaves it stale, invariant 11)."""
        if not self._pk_on and not self._pk_marks.n:
            return None
        if not self._pk_marks.n:
            self._pk_undo.entries = []  # no capture alive: nothing to undo before this one
        return _Mark(self._pk_undo, len(self._pk_undo.entries), self._kix,
                     self._kix.token if self._kix is not None else None, self._pk_marks)

    def _pk_rollback(self, mark: Any) -> None:
        """Undo every in-place change of a key index made since ``mark`` (newest first); the capture's attributes
        are put back after this."""
        undo = self._pk_undo
        if undo is not mark.undo:
            raise AssertionError("totals per key: the undo log of a capture was dropped while the capture lived")
        for ix, view, keys, kh, cpos, sign in reversed(undo.entries[mark.at:]):
            if cpos is None:  # a step's batch (store_totals): its view and columns made now (built, if pending)
                if type(view) is PendingBatch:
                    view = view.get()
                view, cpos = view._view(), self._cpos(view)
            ix.take_back(view, None, keys, kh, cpos, sign)  # exact where replaying rows overflows (csrc/keyindex.h)
        del undo.entries[mark.at:]
        if mark.ix is not None:
            mark.ix.token = mark.token


class PendingBatch:
    """A step's batch for :meth:`PerKeyTotals.store_totals` whose rows are not built yet (invariant 19; csrc/extremes.h
    design note 7): its length, key positions (``_keypos``), key hashes (``_kh``) and weights, and ``make()``, which
    builds the IndexedZSet when something reads its rows (a rollback's undo, an insert, a record of fresh keys);
    :meth:`get` builds it once. A step whose keys are all dirty already reads none of them."""

    __slots__ = ("_keypos", "_kh", "weights", "_make", "_built")

    def __init__(self, keypos: Any, kh: np.ndarray, weights: np.ndarray, make: Any) -> None:
        self._keypos, self._kh, self.weights, self._make, self._built = keypos, kh, weights, make, None

    def __len__(self) -> int:
        return len(self._kh)

    def get(self) -> "IndexedZSet":
        """The batch, built on the first call: its rows' key hashes and weights must be those it was made with."""
        b = self._built
        if b is None:
            b = self._built = self._make()
            if not (np.array_equal(b._kh, self._kh) and np.array_equal(b.zset.weights, self.weights)):
                raise AssertionError("a pending batch built other rows than the step stored")
            self._make = None
        return b


class _UndoLog:
    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: list = []


class _Mark:
    """One capture's place in the undo log; alive while the capture holds it (counted in the trace's ``_Marks``)."""

    __slots__ = ("undo", "at", "ix", "token", "marks")

    def __init__(self, undo: list, at: int, ix: Any, token: Any, marks: _Marks) -> None:
        self.undo, self.at, self.ix, self.token, self.marks = undo, at, ix, token, marks
        marks.n += 1

    def __del__(self) -> None:
        self.marks.n -= 1


def _index_value(data: pa.Table, c: "str | tuple") -> np.ndarray:
    """What a key index sums of column ``c`` of ``data`` for a row of weight 1, as int64 (nulls as 0), or of its
    "valid" flag ``("valid", name)``: 1 where the value is not null (csrc/keyindex.h)."""
    import pyarrow.compute as pc

    if isinstance(c, tuple):
        return np.asarray(pc.is_valid(data.column(c[1])).to_numpy(zero_copy_only=False), dtype=np.int64)
    col = data.column(c)
    if not pa.types.is_integer(col.type):  # a timestamp or date32: its integer storage
        col = col.cast(pa.int64() if pa.types.is_timestamp(col.type) else pa.int32())
    return np.asarray(pc.fill_null(col, 0).to_numpy(zero_copy_only=False), dtype=np.int64)


def int_array(values: np.ndarray, typ: pa.DataType, null: np.ndarray) -> pa.Array:
    """An Arrow array of integer-like type ``typ`` (integers, date32, timestamps) from int64 ``values``, null where
    ``null`` (a key index holds such columns as int64: csrc/extremes.h)."""
    mask = null if null.any() else None
    if pa.types.is_int64(typ):
        return pa.array(values, pa.int64(), mask=mask)
    if pa.types.is_timestamp(typ):
        return pa.array(values, pa.int64(), mask=mask).view(typ)
    if pa.types.is_date32(typ):
        return pa.array(values.astype(np.int32), pa.int32(), mask=mask).view(typ)
    return pa.array(values.astype(typ.to_pandas_dtype()), typ, mask=mask)


def _view_of(table: pa.Table, weights: np.ndarray | None) -> Any:
    from dbsp_core import _zset

    return _zset.BatchView(table, weights)
