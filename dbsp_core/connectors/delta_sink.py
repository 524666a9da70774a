"""A sink that writes a view to a Delta Lake table (the ``deltalake`` package): each step is one Delta commit carrying a ``txn`` action with the sink's application id and the step as its version, so a replay after a crash never commits a step twice.

Invariants (enforced here):
  1. Step ``s`` is exactly one Delta commit whose ``txn`` action is ``(app_id, s)``; an empty step commits no
     data but the same action (so does a MERGE that changed nothing, which deltalake does not commit), so the
     table's ``transaction_version(app_id)`` is always the last step it holds.
     Delta's commit (an atomic put of ``_delta_log/<version>.json``) makes the data and the action appear
     together or not at all.
  2. On (re)start the sink continues from ``transaction_version(app_id) + 1`` (0 for a new table); it
     acknowledges a step to the output log's consumer registry only after the commit holding it returned, so
     the log keeps every step the table lacks. A registry step above the table's means the table was replaced
     by an older one: refused, naming both steps (step_sink invariants 1 and 2).
  3. ``mode="append"``: each step appends its change, the view's columns plus ``weight`` (the change's
     multiplicity: +n inserted, -n deleted) and ``step``; the view is the sum of the rows by weight (DuckDB:
     ``SELECT cols, sum(weight) FROM read_parquet(files) GROUP BY ALL HAVING sum(weight) <> 0``).
     ``mode="merge"``: the table equals the view, which must be keyed by ``key`` (each key at most once, with
     multiplicity 1; a null key equals a null key, as in the engine): each step is one MERGE by key (a key
     inserted is upserted, a key only deleted is deleted) carrying the step's ``txn``; a change that breaks
     the key raises DbspError before anything is committed.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbsp_core.connectors.output import OutputReader
from dbsp_core.connectors.step_sink import StepSink
from dbsp_core.errors import DbspError, SchemaError
from dbsp_core.zset import ZSet

__all__ = ["DeltaSink", "delta_steps"]

MODES = ("append", "merge")
OP_COLUMN = "_dbsp_op"


def _deltalake() -> Any:
    try:
        import deltalake
    except ImportError:  # pragma: no cover - the dependency is declared; this names it if it is missing
        raise ImportError("DeltaSink needs the deltalake package: pip install 'dbsp-core[delta]'") from None
    return deltalake


class DeltaSink(StepSink):
    """Writes view ``view`` of a durable pipeline to the Delta table at ``uri`` (module docstring).

    Parameters
    ----------
    source
        A durable Pipeline in this process, or its storage directory (the pipeline may run elsewhere).
    view
        The output name.
    uri
        The Delta table's location (a local path, or a URI ``deltalake`` understands with ``storage_options``).
    mode
        ``"append"`` (each step's change with ``weight`` and ``step``) or ``"merge"`` (the table equals the view,
        merged by ``key``).
    key
        The view's key columns (``mode="merge"`` only).
    consumer
        The sink's consumer name (default ``delta-<view>``); keep it stable across restarts.
    app_id
        The Delta ``txn`` application id (default: the consumer name).

    Examples
    --------
    >>> import tempfile, pyarrow as pa, dbsp_core as dbsp
    >>> from dbsp_core.connectors import DeltaSink
    >>> c = dbsp.Circuit(); t = c.input("t", pa.schema([("k", pa.int64())]))
    >>> c.output("n", t.group_by("k").agg(n=dbsp.count()))
    >>> p = dbsp.Pipeline(c, storage=tempfile.mkdtemp())
    >>> uri = tempfile.mkdtemp(); sink = DeltaSink(p, "n", uri, mode="merge", key=["k"])
    >>> _ = p.push("t", pa.table({"k": [1, 1, 2]})); _ = p.step(); _ = p.push("t", pa.table({"k": [2]})); _ = p.step()
    >>> sink.poll()
    2
    >>> from deltalake import DeltaTable
    >>> sorted(DeltaTable(uri).to_pyarrow_table().to_pylist(), key=lambda r: r["k"])
    [{'k': 1, 'n': 2}, {'k': 2, 'n': 2}]
    >>> DeltaTable(uri).transaction_version("delta-n")
    1
    >>> sink.close(); p.close()
    """

    def __init__(self, source: Any, view: str, uri: str | os.PathLike, *, mode: str = "append",
                 key: list[str] | None = None, consumer: str | None = None, app_id: str | None = None,
                 storage_options: dict[str, str] | None = None) -> None:
        dl = _deltalake()
        if mode not in MODES:
            raise ValueError(f"DeltaSink: mode={mode!r}; it is one of {list(MODES)}")
        self.uri = os.fspath(uri)
        self.mode = mode
        self.storage_options = storage_options
        self.reader = OutputReader(source, view, consumer or f"delta-{view}")
        self.consumer = self.reader.consumer
        self.app_id = app_id or self.consumer
        self.schema = self.reader.schema
        self.columns = list(self.schema.names)
        self.what = f"DeltaSink {self.consumer!r} ({self.uri})"
        if mode == "merge":
            if not key or any(k not in self.columns for k in key):
                raise SchemaError(f"{self.what}: mode='merge' needs key= naming columns of view {view!r} "
                                  f"({self.columns}), got {key!r}")
            self.key = list(key)
            table_schema = self.schema
        else:
            if key is not None:
                raise ValueError(f"{self.what}: key= is for mode='merge'")
            clash = [n for n in ("weight", "step") if n in self.columns]
            if clash:
                raise SchemaError(f"{self.what}: view {view!r} has columns {clash}, which append mode adds; "
                                  f"rename them in the view")
            self.key = []
            table_schema = pa.schema(list(self.schema) + [pa.field("weight", pa.int64(), False),
                                                          pa.field("step", pa.int64(), False)])
        if not dl.DeltaTable.is_deltatable(self.uri, storage_options=storage_options):
            dl.DeltaTable.create(self.uri, table_schema, mode="ignore", storage_options=storage_options)
        self.table = dl.DeltaTable(self.uri, storage_options=storage_options)
        have = pa.schema(self.table.schema().to_arrow())
        if have.names != table_schema.names:
            raise SchemaError(f"{self.what}: the table has columns {have.names}, the view needs {table_schema.names}")
        self._start(self._table_next(), "the table")
        self.stats = {"steps": 0, "rows": 0, "commits": 0}

    def _table_next(self) -> int:
        v = self.table.transaction_version(self.app_id)
        return 0 if v is None else int(v) + 1

    def _commit(self, step: int) -> Any:
        dl = _deltalake()
        return dl.CommitProperties(app_transactions=[dl.Transaction(self.app_id, step)])

    def _apply(self, step: int, z: ZSet) -> None:
        """Invariant 1: one commit for ``step``."""
        z = z.consolidate()
        if self.mode == "append":
            data = z.data.cast(self.schema)
            data = data.append_column("weight", pa.array(z.weights, pa.int64())).append_column(
                "step", pa.array(np.full(z.num_rows, step, np.int64)))
            _deltalake().write_deltalake(self.table, data, mode="append", commit_properties=self._commit(step))
        else:
            self._merge(step, z)
        self.table.update_incremental()
        if self.table.transaction_version(self.app_id) != step:  # a MERGE that changed nothing commits nothing
            empty = self.table.schema().to_arrow()
            _deltalake().write_deltalake(self.table, pa.schema(empty).empty_table(), mode="append",
                                         commit_properties=self._commit(step))
        self.stats["steps"] += 1
        self.stats["rows"] += z.num_rows
        self.stats["commits"] += 1

    def _merge(self, step: int, z: ZSet) -> None:
        """Invariant 3, merge mode: a key inserted is upserted, a key only deleted is deleted."""
        data = z.data.cast(self.schema)
        w = z.weights
        if np.any(np.abs(w) != 1):
            raise DbspError(f"{self.what}: step {step} changes a row's multiplicity by more than 1, so the view is "
                            f"not keyed by {self.key}; use mode='append'")
        keys = data.select(self.key)
        ins = data.filter(pa.array(w > 0))
        dels = keys.filter(pa.array(w < 0))
        if ins.num_rows and ins.select(self.key).group_by(self.key).aggregate([]).num_rows != ins.num_rows:
            raise DbspError(f"{self.what}: step {step} inserts two rows with one key {self.key}; the view is not "
                            f"keyed by it; use mode='append'")
        if dels.num_rows and ins.num_rows:
            hit = pc.is_in(_key_strings(dels, self.key), value_set=_key_strings(ins.select(self.key), self.key))
            dels = dels.filter(pc.invert(hit))
        up = ins.append_column(OP_COLUMN, pa.array(["u"] * ins.num_rows, pa.string()))
        gone = pa.table({n: dels.column(n) if n in self.key else pa.nulls(dels.num_rows, self.schema.field(n).type)
                         for n in self.columns}).append_column(OP_COLUMN, pa.array(["d"] * dels.num_rows, pa.string()))
        src = pa.concat_tables([up, gone])
        on = " AND ".join(f"t.{_q(k)} IS NOT DISTINCT FROM s.{_q(k)}" for k in self.key)
        cols = {_q(n): f"s.{_q(n)}" for n in self.columns}
        (self.table.merge(src, on, source_alias="s", target_alias="t", commit_properties=self._commit(step))
         .when_matched_update(cols, predicate=f"s.{OP_COLUMN} = 'u'")
         .when_matched_delete(predicate=f"s.{OP_COLUMN} = 'd'")
         .when_not_matched_insert(cols, predicate=f"s.{OP_COLUMN} = 'u'")
         .execute())


def _q(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _key_strings(t: pa.Table, key: list[str]) -> pa.Array:
    """One string per row identifying its key, null equal to null (for a membership test across tables)."""
    parts = []
    for k in key:
        col = t.column(k).combine_chunks()
        text = pc.binary_join_element_wise("v", pc.cast(col, pa.string()), "")
        parts.append(pc.if_else(pc.is_null(col), pa.scalar("n"), text))
    return pc.binary_join_element_wise(*parts, "\x1f") if len(parts) > 1 else parts[0]


def delta_steps(uri: str | os.PathLike, app_id: str) -> list[int]:
    """The steps committed to the Delta table at ``uri`` by ``app_id``, one entry per commit carrying its ``txn``
    action, in commit order (read from ``_delta_log``): each step appears once when the sink kept invariant 1."""
    import json

    log = os.path.join(os.fspath(uri), "_delta_log")
    steps = []
    for name in sorted(f for f in os.listdir(log) if f.endswith(".json")):
        with open(os.path.join(log, name)) as f:
            for line in f:
                txn = json.loads(line).get("txn") if line.strip() else None
                if txn and txn.get("appId") == app_id:
                    steps.append(int(txn["version"]))
    return steps
