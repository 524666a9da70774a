"""The Operator base class (a circuit node that turns its input Z-sets into one output Z-set per step) and small helpers shared by operators.

Invariants (every operator subclass keeps them):
  1. ``schema`` is the output schema, inferred and validated when the node is built; every step's output
     has exactly these column names and types.
  2. ``partitioning`` names the key columns the output is sharded by across workers (rows with equal
     key hash live in one worker), or is None when rows may sit in any worker.
  3. ``instance()`` returns the per-worker runtime object; a stateless operator returns itself, a
     stateful one a fresh object owning its traces, so W copies never share state. Keyed stateful
     instances expose ``traces() -> {name: Trace}``: all their state, sorted by key hash, so it can be
     read and moved by shard.
  4. ``state_placed`` says whether the instance's state must sit with the owner of each row's key shard (a
     live rescale moves it shard by shard; otherwise it stays until its worker leaves). It defaults to
     "the output is partitioned"; an operator whose state is keyed internally though its output is not (the
     fixpoint's nested traces) sets it True.
  5. Operators never iterate over rows in Python: they call Arrow compute, numpy or the Z-set kernels.
  6. ``split_safe`` (default False) says that the operator is time-invariant over steps: its output at a step is
     ``F(integral of its inputs after the step) - F(before)`` (or linear), reading nothing of the step context but
     its inputs, its worker and the exchange. A step of a circuit whose live nodes are all split-safe may run, under
     a memory budget, as several sub-steps over pieces of its input, with the same result as a Z-set
     (dbsp_core/runtime/substep.py). An operator that is not sure says False: its circuits' steps then run whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbsp_core.errors import SchemaError, WeightOverflowError
from dbsp_core.time.cleanup import prune
from dbsp_core.time.lineage import input_times
from dbsp_core.zset import ZSet, _single_chunk  # (module level: an import in a function costs ~5k instructions a call)

if TYPE_CHECKING:
    from dbsp_core.operators.context import StepContext
    from dbsp_core.zset import IndexedZSet

INT64_MIN = np.iinfo(np.int64).min


class Operator:
    """A node of a circuit. Subclasses set ``kind`` and implement :meth:`step` (or :meth:`instance`)."""

    kind = "operator"
    split_safe = False  # invariant 6: a subclass that is time-invariant over steps says True

    def __init__(self, inputs: Sequence[int], schema: pa.Schema, partitioning: tuple[str, ...] | None = None
                 ) -> None:
        self.node_id = -1  # set by Circuit when the node is added
        self.inputs = tuple(inputs)
        self.schema = schema
        self.partitioning = partitioning

    @property
    def state_placed(self) -> bool:
        """Whether this node's per-worker state must live with its key's shard owner (invariant 4)."""
        return self.partitioning is not None

    @property
    def label(self) -> str:
        """Name used in error messages, e.g. ``join#4``."""
        return f"{self.kind}#{self.node_id}" if self.node_id >= 0 else self.kind

    def instance(self) -> Any:
        """Per-worker runtime object with a ``step(inputs, ctx) -> ZSet`` method."""
        return self

    def step(self, inputs: list["ZSet"], ctx: "StepContext") -> "ZSet":  # pragma: no cover - a subclass bug
        raise TypeError(f"{self.label} defines neither step() nor an instance() with a step(): every operator "
                        "must compute its output from its inputs one way or the other")


def nullable_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` with every field nullable and no metadata (the form operators produce)."""
    return pa.schema([pa.field(f.name, f.type) for f in schema])


def same_columns(a: pa.Schema, b: pa.Schema) -> bool:
    """Same column names and types in the same order (nullability and metadata ignored)."""
    if a is b or a.equals(b):  # the common case, decided in C
        return True
    return a.names == b.names and all(x.type.equals(y.type) for x, y in zip(a, b))


def check_columns(schema: pa.Schema, columns: Sequence[str], where: str, what: str = "column") -> None:
    """SchemaError naming ``where`` and the column if any of ``columns`` is not in ``schema``."""
    for c in columns:
        if not isinstance(c, str):
            raise SchemaError(f"{where}: {what} names must be str, got {c!r}")
        if schema.get_field_index(c) < 0:
            raise SchemaError(f"{where}: unknown {what} {c!r}; input columns are {schema.names}")


def check_new_columns(schema: pa.Schema, start: Any, end: Any, where: str, what: str) -> None:
    """SchemaError naming ``where`` unless ``start`` and ``end``, the two columns an operator adds (``what``:
    "window", "session"), are different non-empty str names that no column of ``schema`` has."""
    for name in (start, end):
        if not isinstance(name, str) or not name:
            raise SchemaError(f"{where}: {what} column names must be non-empty str, got {name!r}")
        if name in schema.names:
            raise SchemaError(f"{where}: output column {name!r} clashes with an input column")
    if start == end:
        raise SchemaError(f"{where}: start and end need different names, got {start!r} twice")


def empty(schema: pa.Schema) -> "ZSet":
    """The empty Z-set of ``schema``."""
    return ZSet.empty(schema)


def conform(z: "ZSet", schema: pa.Schema) -> "ZSet":
    """``z`` with exactly ``schema`` (cast when only nullability or metadata differ)."""
    if z.schema.equals(schema):
        return z
    return ZSet._make(z.data.cast(schema), z.weights)


def keyed_change(state: Any, inputs: list["ZSet"], ctx: "StepContext", schema: pa.Schema, keys: Sequence[str],
                 prepare: Callable[["ZSet"], "ZSet"] | None = None, cleanup: bool = True) -> "IndexedZSet | None":
    """How a keyed operator's step opens: :func:`opened_change`, then the change indexed by ``keys``. None when
    the change has no rows, before or after indexing (the step then outputs nothing)."""
    z = opened_change(state, inputs, ctx, schema, prepare, cleanup)
    if z is None:
        return None
    dix = z.index_by(list(keys))
    return dix if len(dix) else None


def opened_change(state: Any, inputs: list["ZSet"], ctx: "StepContext", schema: pa.Schema,
                  prepare: Callable[["ZSet"], "ZSet"] | None = None, cleanup: bool = True) -> "ZSet | None":
    """A keyed operator's step change, not indexed: first its state that no later change can reach is dropped
    (every trace of ``state.traces()`` pruned by the lineage of ``state.op``'s input, dbsp_core.time.cleanup;
    skipped when not ``cleanup``, for an operator that drops by other columns), then the step's input change is
    conformed to ``schema`` and passed through ``prepare`` (extra columns). None when it has no rows."""
    if cleanup:
        prune(state, input_times(state.op), ctx)
    z = inputs[0]
    if z.num_rows == 0:
        return None
    z = conform(z, schema)
    return prepare(z) if prepare is not None else z


def make(table: pa.Table, weights: np.ndarray, schema: pa.Schema) -> "ZSet":
    """Build an operator output from a table whose columns match ``schema`` (re-chunked to one chunk each)."""
    if table.num_rows == 0:
        return ZSet.empty(schema)
    table = _single_chunk(table)
    if not table.schema.equals(schema):
        table = table.cast(schema)
    w = np.ascontiguousarray(weights, dtype=np.int64)
    if not w.flags.writeable:  # the kernels' bindings take writable buffers
        w = w.copy()
    return ZSet._make(table, w)


def negate(z: "ZSet") -> "ZSet":
    """``-z`` without consolidating; WeightOverflowError on the one weight that has no negation."""
    w = z.weights
    if len(w) and bool((w == INT64_MIN).any()):
        raise WeightOverflowError("negate: weight -2**63 has no int64 negation")
    return -z


def concat(parts: list["ZSet"], schema: pa.Schema) -> "ZSet":
    """Sum of ``parts`` without consolidating (empty parts skipped)."""
    parts = [p for p in parts if p.num_rows]
    if not parts:
        return ZSet.empty(schema)
    if len(parts) == 1:
        return parts[0]
    return ZSet.concat(parts)


def run_starts(table: pa.Table, columns: Sequence[str]) -> np.ndarray:
    """True at row 0 and where any of ``columns`` differs from the row before (row identity: null equals null,
    NaN equals NaN, -0.0 equals 0.0): the first row of each run of equal keys in a sorted table."""
    n = table.num_rows
    out = np.zeros(n, dtype=bool)
    if n == 0:
        return out
    out[0] = True
    for c in columns:
        col = table.column(c)
        a, b = col.slice(1), col.slice(0, n - 1)
        differ = pc.or_(pc.not_equal(pc.is_valid(a), pc.is_valid(b)), pc.fill_null(pc.not_equal(a, b), False))
        if pa.types.is_floating(col.type):  # two NaNs are one value
            differ = pc.and_not(differ, pc.fill_null(pc.and_(pc.is_nan(a), pc.is_nan(b)), False))
        out[1:] |= np.asarray(differ.to_numpy(zero_copy_only=False), dtype=bool)
    return out


_PER_KEY_NULLS = tuple(int(x) for x in pa.__version__.split(".")[:1]) >= (25,)  # null placement per sort key


def sort_order(table: pa.Table, keys: Sequence[tuple[str, str]]) -> np.ndarray:
    """The row indices of ``table`` sorted by ``keys`` (``(column, "ascending" | "descending")``), nulls last;
    floats in DuckDB's order: NaN above every number (first when descending), -0.0 tied with 0.0."""
    spec: list[tuple[str, str]] = []
    for i, (c, d) in enumerate(keys):
        col = table.column(c)
        if d == "descending" and pa.types.is_floating(col.type) and pc.any(pc.is_nan(col)).as_py():
            nan = f"__dbsp_nan_{i}"  # Arrow sorts NaN after every number either way: put it first by a flag
            table = table.append_column(nan, pc.fill_null(pc.is_nan(col), False))
            spec.append((nan, "descending"))
        spec.append((c, d))
    keys = spec
    if _PER_KEY_NULLS:
        idx = pc.sort_indices(table, sort_keys=[(c, d, "at_end") for c, d in keys])
    else:  # pragma: no cover - pyarrow < 25
        idx = pc.sort_indices(table, sort_keys=list(keys), null_placement="at_end")
    return np.asarray(idx, dtype=np.int64)
