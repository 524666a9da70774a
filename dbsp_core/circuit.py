"""The Circuit / Stream builder API: a dataflow graph of incremental operators over streams of Z-sets, with schemas inferred and validated as it is built.

Invariants (enforced here):
  1. Nodes are appended in topological order: a node's inputs are always earlier nodes of the same circuit,
     so running nodes in id order is a valid schedule.
  2. Every Stream has a schema, inferred when its node is built; an unknown column, mismatched join key
     types, a sum over a non-numeric column, or an output column of a type Z-sets cannot hold (or no column
     at all) raise SchemaError naming the operator and the column.
  3. Every keyed operator (join, distinct, aggregate) reads its inputs through an Exchange on its key,
     unless the input is already partitioned by that key; one exchange per (stream, key) is shared.
  4. Input and output names are unique within a circuit.
  5. Every node's time lineage (dbsp_core/time/lineage.py) is derived when it is built, and a stateful
     operator whose input has one gets it as ``in_times``, so it can drop the state no later change can reach.
  6. ``readable`` maps each materialized view, materialized table and table with a primary key to the node whose
     trace holds its current contents (operators/materialize.py, operators/upsert.py); those nodes run like the
     outputs' (``live_nodes``), and their names are unique among them.
"""

from __future__ import annotations

import hashlib
import re
from typing import Callable, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from dbsp_core.aggregates import Aggregate as AggSpec
from dbsp_core.errors import SchemaError
from dbsp_core.operators import (Aggregate, Delay, Differentiate, Distinct, Exchange, Filter, FlatMap, Input,
                                 Integrate, Join, LeftJoin, Negate, Operator, Plus, Select)
from dbsp_core.operators.aggregate import PreAggregate
from dbsp_core.operators.base import check_columns, nullable_schema, same_columns
from dbsp_core.operators.constant import Constant
from dbsp_core.operators.count_distinct import CountDistinct, pair_key
from dbsp_core.operators.expr import as_expression, fingerprint_text
from dbsp_core.operators.fixpoint import Fixpoint
from dbsp_core.operators.keyless_aggregate import GLOBAL_KEY, AddGlobalKey
from dbsp_core.operators.materialize import Materialize
from dbsp_core.operators.outer_join import OuterJoin
from dbsp_core.operators.proctime import proc_tumble
from dbsp_core.operators.semi_join import SemiJoin
from dbsp_core.operators.session import Session
from dbsp_core.operators.top_k import TopK, order_spec
from dbsp_core.operators.upsert import Upsert
from dbsp_core.operators.window import Window, hop, interval_join, tumble
from dbsp_core.time.lineage import Times, meet, passed


MAX_NAME_BYTES = 1024  # input and output names are logged with every push and output record


def _check_name(name: str, what: str) -> None:
    """ValueError unless ``name`` is UTF-8 of at most MAX_NAME_BYTES bytes (it is stored and logged as such)."""
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} name {name[:40]!r} is not valid UTF-8 ({e.reason} at index {e.start})") from None
    if size > MAX_NAME_BYTES:
        raise ValueError(f"{what} name of {size} bytes is longer than the limit of {MAX_NAME_BYTES} bytes (UTF-8)")


class Circuit:
    """A dataflow graph of operators; build it with :meth:`input`, Stream methods and :meth:`output`.

    Examples
    --------
    >>> import pyarrow as pa, pyarrow.compute as pc
    >>> import dbsp_core as dbsp
    >>> c = dbsp.Circuit()
    >>> bids = c.input("bids", pa.schema([("auction", pa.int64()), ("price", pa.int64())]))
    >>> c.output("big", bids.filter(pc.field("price") > 100))
    >>> p = dbsp.Pipeline(c, workers=1)
    >>> p.push("bids", pa.table({"auction": [1, 2], "price": [50, 150]}))
    >>> p.step()["big"].to_dict()
    {(2, 150): 1}
    """

    def __init__(self) -> None:
        self.nodes: list[Operator] = []
        self.inputs: dict[str, int] = {}
        self.outputs: dict[str, int] = {}
        self._exchanges: dict[tuple[int, tuple[str, ...]], int] = {}
        self.times: dict[int, Times] = {}  # node -> time lineage of its output, when it has one (invariant 5)
        # invariant 6: the tables and views whose current contents a pipeline can read (Pipeline.view, .query):
        # name -> the node keeping them in a trace (a materialize node, or a keyed table's upsert node)
        self.readable: dict[str, int] = {}
        self.primary_keys: dict[str, tuple[str, ...]] = {}  # input -> its primary key columns

    def add_operator(self, op: Operator, times: Times | None = None, in_times: Sequence[Times] = ()) -> "Stream":
        """Append ``op`` as the circuit's next node and return the stream of its output: how every builder adds
        nodes, the Stream methods here and those of operators that live with their builders in dbsp_core.operators
        (windows, temporal views).

        ``op.inputs`` must be ids of earlier nodes (invariant 1; take them from the input streams' ``node_id``,
        after :meth:`check_stream`); ``times`` is the time lineage of the output (invariant 5, usually derived from
        the inputs' ``times`` with dbsp_core.time.lineage); ``in_times``, given to a stateful operator, is the
        lineage of each of its inputs, by which it drops the state no later change can reach.

        Examples
        --------
        >>> import pyarrow as pa
        >>> from dbsp_core.operators import Negate
        >>> c = Circuit()
        >>> t = c.input("t", pa.schema([("a", pa.int64())]))
        >>> neg = c.add_operator(Negate((t.node_id,), t.schema, t.op.partitioning), t.times)
        >>> neg.node_id, neg.op.kind
        (1, 'negate')
        """
        if not isinstance(op, Operator):
            raise TypeError(f"add_operator: expected an Operator, got {type(op).__name__}")
        for i in op.inputs:  # invariant 1
            if not 0 <= i < len(self.nodes):
                raise ValueError(f"add_operator: {op.kind} reads node {i}, which is not an earlier node of this "
                                 f"circuit (it has {len(self.nodes)} nodes)")
        from dbsp_core.zset import ZSet

        try:  # invariant 2: a type no step can hold (decimal, float16, ...) is refused now, not at the first step
            ZSet.empty(op.schema)
        except SchemaError as exc:
            raise SchemaError(f"{op.kind}#{len(self.nodes)}: its output {exc}") from None
        if any(in_times):  # invariant 5: set only when there is one, so other circuits keep their fingerprint
            op.in_times = tuple(in_times)
        op.node_id = len(self.nodes)
        self.nodes.append(op)
        if times:
            self.times[op.node_id] = dict(times)
        return Stream(self, op.node_id)

    def inserts_only(self, node_id: int) -> bool:
        """Whether every change of node ``node_id``'s stream has only positive weights, by the circuit's structure:
        an append-only input (operators/input.py invariant 3), and filter, select, flat_map, exchange, window
        assignment, the hidden key of a keyless group_by, plus (not minus) and the inner join over streams that are
        inserts only. Any other operator (a minus, an aggregate, an outer join, ...) may retract, so its stream is
        not.

        >>> import pyarrow as pa
        >>> c = Circuit()
        >>> s = c.input("t", pa.schema([("a", pa.int64())]), append_only=True)
        >>> c.inserts_only(s.select(b="a").node_id), c.inserts_only((s - s).node_id)
        (True, False)
        """
        flags: list[bool] = []
        for op in self.nodes[:node_id + 1]:  # inputs before their readers (invariant 1)
            if isinstance(op, Input):
                flags.append(op.append_only)
            else:
                passes = (isinstance(op, (Filter, Select, FlatMap, Exchange, AddGlobalKey, Window))
                          or type(op) is Join or (isinstance(op, Plus) and min(op.signs) > 0))  # a minus retracts
                flags.append(passes and all(flags[i] for i in op.inputs))
        return flags[node_id]

    def count_grows(self, node_id: int, keys: Sequence[str], order: tuple[str, str]) -> bool:
        """Whether ``order`` (a column, a direction) is the row count (``count()``) of the aggregate whose output is
        node ``node_id``'s stream (through exchanges), descending, the aggregate grouping by every column of
        ``keys`` (and maybe more), without count_distinct, over a stream that is inserts only: a step then
        retracts a group's row only beside its new row of a larger count (operators/top_k.py invariant 7)."""
        op = self.nodes[node_id]
        while isinstance(op, Exchange):
            op = self.nodes[op.inputs[0]]
        col, direction = order
        if (not isinstance(op, Aggregate) or not op.output_keys or op.distinct_columns or direction != "descending"
                or not set(keys) <= set(op.keys) or col not in op.names
                or op.plan[op.names.index(col)] != ("count", [0])):
            return False
        src = self.nodes[op.inputs[0]]
        while isinstance(src, Exchange):
            src = self.nodes[src.inputs[0]]
        return self.inserts_only(src.inputs[0] if isinstance(src, PreAggregate) else src.node_id)

    def _where(self, kind: str) -> str:
        return f"{kind}#{len(self.nodes)}"

    def input(self, name: str, schema: pa.Schema, event_time: str | None = None, lateness: object = 0, *,
              primary_key: Sequence[str] | None = None, materialized: bool = False,
              append_only: bool = False) -> "Stream":
        """Declare input handle ``name`` with ``schema``; returns its stream.

        ``primary_key`` (column names) makes it a table with a key (operators/upsert.py): a pushed row whose key
        is held replaces the held row (the stream carries the old row's retraction and the new row), a row
        pushed with weight -1 deletes the row of its key (``Pipeline.delete``), and when one step holds several
        rows of a key the last one pushed wins. Key values must not be null. A keyed table's contents are
        readable (``Pipeline.view``, ``Pipeline.query``); ``materialized=True`` makes a table without a key
        readable too (its integral is kept in a trace).

        ``event_time`` names an integer or timestamp column holding each row's event time; the input then has a
        watermark, the largest event time pushed so far minus ``lateness`` (an int in the column's unit, or a
        ``datetime.timedelta`` for a timestamp column). Rows whose event time is below the watermark in force in
        their step (the one computed from the earlier steps), or null, are *late*: dropped, and counted in
        ``Pipeline.late_rows`` (dbsp_core/time/watermark.py).
        Windows and joins keyed by event time then drop the state that no later row can reach.

        ``append_only=True`` declares that rows are only ever inserted: a push with a weight other than positive
        raises AppendOnlyError and records nothing, and operators fed only by such inputs keep less state (a
        top-k keeps only its shown rows per group, :meth:`inserts_only`). It excludes ``primary_key`` (a keyed
        table retracts the rows it replaces).

        >>> import pyarrow as pa
        >>> Circuit().input("t", pa.schema([("a", pa.int32())])).schema.names
        ['a']
        >>> Circuit().input("b", pa.schema([("t", pa.timestamp("ms"))]), event_time="t", lateness=4000).times
        {'t': ('b', 0)}
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"input name must be a non-empty str, got {name!r}")
        _check_name(name, "input")
        if name in self.inputs:
            raise ValueError(f"input {name!r} is already declared")
        if not isinstance(schema, pa.Schema):
            raise TypeError(f"input {name!r}: schema must be a pyarrow.Schema, got {type(schema).__name__}")
        if len(set(schema.names)) != len(schema.names):
            raise SchemaError(f"input {name!r}: duplicate column names in {schema.names}")
        from dbsp_core.zset import ZSet

        try:
            ZSet.empty(schema)  # rejects unsupported column types
        except SchemaError as exc:
            raise SchemaError(f"input {name!r}: {exc}") from None
        times: Times = {}
        if event_time is not None:
            import pyarrow.types as pat

            from dbsp_core.time.watermark import lateness_units

            where = f"input {name!r}"
            if not isinstance(event_time, str) or schema.get_field_index(event_time) < 0:
                raise SchemaError(f"{where}: event_time must name a column of {schema.names}, got {event_time!r}")
            typ = schema.field(event_time).type
            if not (pat.is_integer(typ) or pat.is_timestamp(typ)):
                raise SchemaError(f"{where}: event-time column {event_time!r} must be an integer or a timestamp, "
                                  f"got {typ}")
            lateness = lateness_units(lateness, typ, where)
            times = {event_time: (name, 0)}
        elif lateness:
            raise TypeError(f"input {name!r}: lateness= needs event_time=")
        if primary_key is not None:
            if isinstance(primary_key, str):
                primary_key = [primary_key]
            key = tuple(primary_key)
            if not key or len(set(key)) != len(key):
                raise SchemaError(f"input {name!r}: primary_key must name distinct columns, got {primary_key!r}")
            check_columns(schema, key, f"input {name!r}", "primary key column")
        if not isinstance(materialized, bool):
            raise TypeError(f"input {name!r}: materialized must be a bool, got {materialized!r}")
        if not isinstance(append_only, bool):
            raise TypeError(f"input {name!r}: append_only must be a bool, got {append_only!r}")
        if append_only and primary_key is not None:
            raise SchemaError(f"input {name!r}: append_only=True excludes primary_key (a table with a key retracts "
                              f"the row a push replaces); declare one of them")
        self._check_readable(name, primary_key is not None or materialized)
        s = self.add_operator(Input(name, nullable_schema(schema), event_time, int(lateness), append_only), times)
        self.inputs[name] = s.node_id
        if primary_key is not None:
            src = s._exchanged(key)
            # no time lineage: a replaced row's retraction carries an old event time that later operators must see
            s = self.add_operator(Upsert(src.node_id, s.schema, key, name))
            self.primary_keys[name] = key
            self.readable[name] = s.node_id
        elif materialized:
            self._materialize(name, s)
        return s

    def _check_readable(self, name: str, readable: bool) -> None:
        if readable and name in self.readable:
            raise ValueError(f"{name!r} is already a readable table or view (a table and a view read by "
                             f"Pipeline.view need different names)")

    def _materialize(self, name: str, stream: "Stream") -> None:
        """Keep ``stream``'s integral in a trace readable as ``name`` (invariant 6, operators/materialize.py)."""
        key = stream.op.partitioning or tuple(stream.schema.names)
        src = stream._exchanged(tuple(key))
        node = self.add_operator(Materialize(src.node_id, stream.schema, tuple(key), name))
        self.readable[name] = node.node_id

    def constant(self, value: "pa.Table | object") -> "Stream":
        """A stream whose integral is ``value`` (a ZSet or an Arrow table) from the first step on: it is emitted
        at the pipeline's first step only (operators/constant.py).

        >>> import pyarrow as pa
        >>> import dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> c.output("one", c.constant(pa.table({"x": [1]})))
        >>> p = dbsp.Pipeline(c)
        >>> p.step()["one"].to_dict(), p.step()["one"].to_dict()
        ({(1,): 1}, {})
        """
        from dbsp_core.zset import ZSet

        z = value if isinstance(value, ZSet) else ZSet.from_arrow(value)  # type: ignore[arg-type]
        return self.add_operator(Constant(z))

    def recursive(self, body: Callable[..., "Stream"], inputs: Sequence["Stream"] = (),
                  schema: pa.Schema | None = None, distinct: bool = True, max_iterations: int = 100_000
                  ) -> "Stream":
        """The least fixed point R of ``R = body(R, *inputs)`` (then ``distinct()``, as SQL's recursive UNION),
        iterated within each step and maintained incrementally under insertions and deletions of the inputs
        (operators/fixpoint.py).

        ``body`` gets a stream for R (of ``schema``, default the first input's) and one stream per input, all in a
        nested circuit, and returns R's next value; it may use filter, select, ``+``/``-``, negate, flat_map,
        windows, (inner) join and distinct. With ``distinct=False`` R is a bag (SQL's UNION ALL): it converges
        only when the body reaches zero (no cycles), else the step fails after ``max_iterations`` iterations.

        >>> import pyarrow as pa
        >>> import dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> e = c.input("e", pa.schema([("src", pa.int64()), ("dst", pa.int64())]))
        >>> step = lambda r, e: e + r.join(e, left_on="dst", right_on="src").select(src="src", dst="dst_right")
        >>> c.output("reach", c.recursive(step, [e]))
        >>> p = dbsp.Pipeline(c, workers=2)
        >>> p.push("e", pa.table({"src": [1, 2], "dst": [2, 3]}))
        >>> sorted(p.step()["reach"].to_dict())
        [(1, 2), (1, 3), (2, 3)]
        >>> p.push("e", dbsp.ZSet.from_rows([(2, 3)], e.schema, weights=[-1]))
        >>> sorted(p.step()["reach"].to_dict().items())
        [((1, 3), -1), ((2, 3), -1)]
        """
        where = self._where("recursive")
        inputs = [self.check_stream(s, where) for s in inputs]
        if schema is None:
            if not inputs:
                raise TypeError(f"{where}: give schema= (there is no input to take it from)")
            schema = inputs[0].schema
        if not isinstance(schema, pa.Schema):
            raise TypeError(f"{where}: schema must be a pyarrow.Schema, got {schema!r}")
        inner = Circuit()
        rec = inner.input("__dbsp_rec", schema)
        imports = [inner.input(f"__dbsp_in{k}", s.schema) for k, s in enumerate(inputs)]
        out = body(rec, *imports)
        if not isinstance(out, Stream) or out.circuit is not inner:
            raise TypeError(f"{where}: body must return a stream built from the streams it is given")
        if distinct:
            out = out.distinct()
        if not same_columns(out.schema, rec.schema):
            raise SchemaError(f"{where}: the body returns {out.schema.names} {out.schema.types}, but R has "
                              f"{rec.schema.names} {rec.schema.types}")
        inner.output("__dbsp_out", out)
        gathered = []
        for s in inputs:  # fixpoint invariant 3: the inputs gathered by a constant key
            g = self.add_operator(AddGlobalKey(s.node_id, s.schema, s.op.partitioning, where), s.times)
            gathered.append(g._exchanged((GLOBAL_KEY,)).node_id)
        op = Fixpoint(gathered, inner, rec.node_id, [s.node_id for s in imports], out.node_id, max_iterations,
                      where, fingerprint=circuit_fingerprint(inner), live=inner.live_nodes())
        return self.add_operator(op)

    def live_nodes(self) -> list[int]:
        """The nodes that feed an output, in id order (the nodes a pipeline runs)."""
        live = set(self.outputs.values()) | set(self.readable.values())
        for i in range(len(self.nodes) - 1, -1, -1):
            if i in live:
                live.update(self.nodes[i].inputs)
        return sorted(live)

    def output(self, name: str, stream: "Stream", materialized: bool = False) -> None:
        """Declare output handle ``name``: each step yields the change of ``stream``.

        ``materialized=True`` also keeps the view's current contents (the integral of its changes) in a trace,
        placed by shard, checkpointed and rescaled like all state, so ``Pipeline.view(name)`` and
        ``Pipeline.query(sql)`` can read it (operators/materialize.py).

        >>> import pyarrow as pa
        >>> import dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> t = c.input("t", pa.schema([("x", pa.int64())]))
        >>> c.output("big", t.filter(pa.compute.field("x") > 1), materialized=True)
        >>> p = dbsp.Pipeline(c, workers=2)
        >>> p.push("t", {"x": [1, 2, 3]}); _ = p.step()
        >>> p.push("t", [(3,)], weights=[-1]); _ = p.step()
        >>> p.view("big").to_pydict()
        {'x': [2]}
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"output name must be a non-empty str, got {name!r}")
        _check_name(name, "output")
        if name in self.outputs:
            raise ValueError(f"output {name!r} is already declared")
        if not isinstance(materialized, bool):
            raise TypeError(f"output {name!r}: materialized must be a bool, got {materialized!r}")
        self.check_stream(stream, "output")
        self._check_readable(name, materialized)
        self.outputs[name] = stream.node_id
        if materialized:
            self._materialize(name, stream)

    def check_stream(self, stream: object, where: str) -> "Stream":
        """``stream`` itself, once checked to be a Stream of this circuit: a builder calls it on every stream it is
        given before it adds a node (TypeError for another object, ValueError for a stream of another circuit,
        each naming ``where``).

        >>> import pyarrow as pa
        >>> a, b = Circuit(), Circuit()
        >>> s = a.input("t", pa.schema([("x", pa.int64())]))
        >>> a.check_stream(s, "join#1") is s
        True
        >>> b.check_stream(s, "join#1")
        Traceback (most recent call last):
        ...
        ValueError: join#1: the stream belongs to another circuit
        """
        if not isinstance(stream, Stream):
            raise TypeError(f"{where}: expected a Stream, got {type(stream).__name__}")
        if stream.circuit is not self:
            raise ValueError(f"{where}: the stream belongs to another circuit")
        return stream

    def __repr__(self) -> str:
        return (f"Circuit({len(self.nodes)} nodes, inputs={list(self.inputs)}, "
                f"outputs={list(self.outputs)})")


class Stream:
    """A stream of Z-sets in a circuit (one per step); its methods add operators.

    Examples
    --------
    >>> import pyarrow as pa, pyarrow.compute as pc
    >>> import dbsp_core as dbsp
    >>> c = dbsp.Circuit()
    >>> t = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.float64())]))
    >>> g = t.group_by("k").agg(n=dbsp.count(), mean=dbsp.avg("v"))
    >>> g.schema.names
    ['k', 'n', 'mean']
    """

    __slots__ = ("circuit", "node_id")

    def __init__(self, circuit: Circuit, node_id: int) -> None:
        self.circuit = circuit
        self.node_id = node_id

    @property
    def op(self) -> Operator:
        return self.circuit.nodes[self.node_id]

    @property
    def schema(self) -> pa.Schema:
        """The schema of the Z-sets on this stream (inferred)."""
        return self.op.schema

    @property
    def times(self) -> Times:
        """The stream's time lineage: ``{column: (input, offset)}`` (dbsp_core/time/lineage.py)."""
        return self.circuit.times.get(self.node_id, {})

    def _where(self, kind: str) -> str:
        return self.circuit._where(kind)

    def _exchanged(self, key: tuple[str, ...]) -> "Stream":
        """This stream re-sharded by ``key`` (invariant 3)."""
        key = tuple(key)
        if self.op.partitioning == key:
            return self
        cache = self.circuit._exchanges
        if (self.node_id, key) not in cache:
            ex = self.circuit.add_operator(Exchange(self.node_id, self.schema, key), self.times)
            cache[(self.node_id, key)] = ex.node_id
        return Stream(self.circuit, cache[(self.node_id, key)])

    # ---- linear operators ----

    def filter(self, predicate: pc.Expression) -> "Stream":
        """Rows where ``predicate`` (a pyarrow.compute expression) is true; null counts as false.

        The predicate is evaluated by pyarrow with its IEEE 754 rules: a comparison with NaN is false, NaN == NaN
        included (SQL views compare floats as DuckDB does instead; README "Semantics and formats").

        >>> import pyarrow as pa, pyarrow.compute as pc
        >>> s = Circuit().input("t", pa.schema([("x", pa.int64())]))
        >>> s.filter(pc.field("x") > 1).schema.names
        ['x']
        """
        where = self._where("filter")
        if not isinstance(predicate, pc.Expression):
            raise TypeError(f"{where}: expected a pyarrow.compute expression, got {predicate!r}")
        return self.circuit.add_operator(Filter(self.node_id, self.schema, self.op.partitioning, predicate, where),
                                         self.times)

    def select(self, **columns: pc.Expression | str) -> "Stream":
        """One output column per keyword: ``name=expression`` (or a column name), in order.

        >>> import pyarrow as pa, pyarrow.compute as pc
        >>> s = Circuit().input("t", pa.schema([("p", pa.int64())]))
        >>> s.select(p="p", eur=pc.field("p") * 0.9).schema.types
        [DataType(int64), DataType(double)]
        """
        where = self._where("select")
        if not columns:
            raise SchemaError(f"{where}: select needs at least one column")
        exprs = {name: as_expression(e, where) for name, e in columns.items()}
        op = Select(self.node_id, self.schema, self.op.partitioning, exprs, where)
        refs = {name: c for name, e in exprs.items() for c in self.times if e.equals(pc.field(c))}
        return self.circuit.add_operator(op, passed(self.times, refs))

    def flat_map(self, fn: Callable[[pa.RecordBatch], pa.RecordBatch], schema: pa.Schema | None = None
                 ) -> "Stream":
        """Apply a row-wise function from RecordBatch to RecordBatch; output rows keep their input's weight.

        ``schema`` is the function's output schema (inferred from ``fn`` on an empty record batch if omitted).

        >>> import pyarrow as pa
        >>> s = Circuit().input("t", pa.schema([("x", pa.int64())]))
        >>> twice = lambda b: pa.concat_tables([pa.table(b), pa.table(b)]).to_batches()[0] if b.num_rows else b
        >>> s.flat_map(twice, schema=s.schema).schema.names
        ['x']
        """
        return self.circuit.add_operator(FlatMap(self.node_id, self.schema, fn, schema, self._where("flat_map")))

    def _plus(self, other: "Stream", sign: int, kind: str) -> "Stream":
        where = self._where(kind)
        self.circuit.check_stream(other, where)
        if not same_columns(self.schema, other.schema):
            raise SchemaError(f"{where}: schemas differ: {self.schema.names} {self.schema.types} vs "
                              f"{other.schema.names} {other.schema.types}")
        part = self.op.partitioning if self.op.partitioning == other.op.partitioning else None
        return self.circuit.add_operator(Plus((self.node_id, other.node_id), (1, sign), self.schema, part),
                                         meet(self.times, other.times))

    def __add__(self, other: "Stream") -> "Stream":
        """``s + t``: the sum of two streams of the same columns (bag union)."""
        return self._plus(other, 1, "plus")

    def __sub__(self, other: "Stream") -> "Stream":
        """``s - t``: weights of ``t`` subtracted (weights may go negative)."""
        return self._plus(other, -1, "minus")

    def __neg__(self) -> "Stream":
        """``-s``: every weight negated."""
        return self.circuit.add_operator(Negate((self.node_id,), self.schema, self.op.partitioning), self.times)

    # ---- time operators ----

    def delay(self) -> "Stream":
        """z^-1: this stream one step later (empty at the first step).

        >>> import pyarrow as pa
        >>> import dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> t = c.input("t", pa.schema([("x", pa.int64())]))
        >>> c.output("prev", t.delay())
        >>> p = dbsp.Pipeline(c)
        >>> p.push("t", pa.table({"x": [1]}))
        >>> p.step()["prev"].to_dict(), p.step()["prev"].to_dict()
        ({}, {(1,): 1})
        """
        return self.circuit.add_operator(Delay((self.node_id,), self.schema, self.op.partitioning))

    def integrate(self) -> "Stream":
        """The running sum of this stream: the whole view at each step.

        >>> import pyarrow as pa
        >>> import dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> t = c.input("t", pa.schema([("x", pa.int64())]))
        >>> c.output("all", t.integrate())
        >>> p = dbsp.Pipeline(c)
        >>> p.push("t", pa.table({"x": [1]})); _ = p.step()
        >>> p.push("t", pa.table({"x": [2]})); sorted(p.step()["all"].to_dict())
        [(1,), (2,)]
        """
        return self.circuit.add_operator(Integrate((self.node_id,), self.schema, self.op.partitioning))

    def differentiate(self) -> "Stream":
        """The step-to-step change of this stream; ``s.integrate().differentiate()`` is ``s``.

        >>> import pyarrow as pa
        >>> s = Circuit().input("t", pa.schema([("x", pa.int64())]))
        >>> s.integrate().differentiate().schema == s.schema
        True
        """
        return self.circuit.add_operator(Differentiate((self.node_id,), self.schema, self.op.partitioning))

    # ---- keyed operators ----

    def distinct(self) -> "Stream":
        """Each row with positive multiplicity, once (a bag to a set).

        >>> import pyarrow as pa
        >>> import dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> t = c.input("t", pa.schema([("x", pa.int64())]))
        >>> c.output("set", t.distinct())
        >>> p = dbsp.Pipeline(c, workers=2)
        >>> p.push("t", pa.table({"x": [7, 7, 8]}))
        >>> sorted(p.step()["set"].to_dict().items())
        [((7,), 1), ((8,), 1)]
        """
        src = self._exchanged(tuple(self.schema.names))
        return self.circuit.add_operator(Distinct(src.node_id, self.schema), src.times, (src.times,))

    @staticmethod
    def _keys(on: object, left_on: object, right_on: object, where: str) -> tuple[list[str], list[str], bool]:
        def names(v: object) -> list[str]:
            return [v] if isinstance(v, str) else list(v)  # type: ignore[arg-type]

        if on is not None:
            if left_on is not None or right_on is not None:
                raise TypeError(f"{where}: give either on= or left_on=/right_on=, not both")
            return names(on), names(on), True
        if left_on is None or right_on is None:
            raise TypeError(f"{where}: give on= or both left_on= and right_on=")
        return names(left_on), names(right_on), False

    def _join(self, other: "Stream", left_on: Sequence[str], right_on: Sequence[str], drop_right_keys: bool,
              kind: str = "join") -> "Stream":
        where = self._where(kind)
        self.circuit.check_stream(other, where)
        from dbsp_core.operators.join import join_schema

        join_schema(self.schema, other.schema, left_on, right_on, drop_right_keys, where)  # validate first
        left = self._exchanged(tuple(left_on))
        right = other._exchanged(tuple(right_on))
        args = (left.node_id, right.node_id, self.schema, other.schema, left_on, right_on, drop_right_keys, where)
        if kind in ("right_join", "full_join"):
            return self.circuit.add_operator(OuterJoin(*args, how=kind[:-5]))  # lineage invariant 4: none
        op = (LeftJoin if kind == "left_join" else Join)(*args)
        if kind == "left_join":  # lineage invariant 4: no lineage, no cleanup
            return self.circuit.add_operator(op)
        keys = meet(passed(left.times, {k: k for k in left_on}),
                    passed(right.times, {lk: rk for lk, rk in zip(left_on, right_on)}))
        return self.circuit.add_operator(op, keys, (left.times, right.times))

    def join(self, other: "Stream", on: str | Sequence[str] | None = None,
             left_on: str | Sequence[str] | None = None, right_on: str | Sequence[str] | None = None
             ) -> "Stream":
        """Inner equi-join. ``on=`` keeps one key column; other right-side name clashes get ``_right``.

        >>> import pyarrow as pa
        >>> c = Circuit()
        >>> a = c.input("a", pa.schema([("k", pa.int64()), ("x", pa.int64())]))
        >>> b = c.input("b", pa.schema([("k", pa.int64()), ("x", pa.int64())]))
        >>> a.join(b, on="k").schema.names
        ['k', 'x', 'x_right']
        >>> a.join(b, left_on="k", right_on="x").schema.names
        ['k', 'x', 'k_right', 'x_right']
        """
        lk, rk, drop = self._keys(on, left_on, right_on, self._where("join"))
        return self._join(other, lk, rk, drop)

    def left_join(self, other: "Stream", on: str | Sequence[str] | None = None,
                  left_on: str | Sequence[str] | None = None, right_on: str | Sequence[str] | None = None
                  ) -> "Stream":
        """Left outer equi-join: like :meth:`join`, plus each left row without a match, padded with nulls.

        >>> import pyarrow as pa
        >>> c = Circuit()
        >>> a = c.input("a", pa.schema([("k", pa.int64())]))
        >>> b = c.input("b", pa.schema([("k", pa.int64()), ("y", pa.utf8())]))
        >>> a.left_join(b, on="k").schema.names
        ['k', 'y']
        """
        lk, rk, drop = self._keys(on, left_on, right_on, self._where("left_join"))
        return self._join(other, lk, rk, drop, kind="left_join")

    def right_join(self, other: "Stream", on: str | Sequence[str] | None = None,
                   left_on: str | Sequence[str] | None = None, right_on: str | Sequence[str] | None = None
                   ) -> "Stream":
        """Right outer equi-join: like :meth:`join`, plus each right row without a match, with null left columns
        (with ``on=``, the kept key columns hold the right row's key, as SQL's ``USING``).

        >>> import pyarrow as pa
        >>> import dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> a = c.input("a", pa.schema([("k", pa.int64()), ("x", pa.utf8())]))
        >>> b = c.input("b", pa.schema([("k", pa.int64()), ("y", pa.utf8())]))
        >>> c.output("j", a.right_join(b, on="k"))
        >>> p = dbsp.Pipeline(c)
        >>> p.push("a", pa.table({"k": [1], "x": ["a"]})); p.push("b", pa.table({"k": [1, 2], "y": ["p", "q"]}))
        >>> sorted(p.step()["j"].to_dict())
        [(1, 'a', 'p'), (2, None, 'q')]
        """
        lk, rk, drop = self._keys(on, left_on, right_on, self._where("right_join"))
        return self._join(other, lk, rk, drop, kind="right_join")

    def full_join(self, other: "Stream", on: str | Sequence[str] | None = None,
                  left_on: str | Sequence[str] | None = None, right_on: str | Sequence[str] | None = None
                  ) -> "Stream":
        """Full outer equi-join: the inner join, plus the unmatched rows of both sides padded with nulls.

        >>> import pyarrow as pa
        >>> import dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> a = c.input("a", pa.schema([("k", pa.int64()), ("x", pa.utf8())]))
        >>> b = c.input("b", pa.schema([("k", pa.int64()), ("y", pa.utf8())]))
        >>> c.output("j", a.full_join(b, on="k"))
        >>> p = dbsp.Pipeline(c)
        >>> p.push("a", pa.table({"k": [1, 3], "x": ["a", "c"]})); p.push("b", pa.table({"k": [1, 2], "y": ["p", "q"]}))
        >>> sorted(p.step()["j"].to_dict(), key=str)
        [(1, 'a', 'p'), (2, None, 'q'), (3, 'c', None)]
        """
        lk, rk, drop = self._keys(on, left_on, right_on, self._where("full_join"))
        return self._join(other, lk, rk, drop, kind="full_join")

    def _semi(self, other: "Stream", on: object, left_on: object, right_on: object, anti: bool) -> "Stream":
        where = self._where("anti_join" if anti else "semi_join")
        self.circuit.check_stream(other, where)
        lk, rk, _ = self._keys(on, left_on, right_on, where)
        from dbsp_core.operators.join import join_schema

        join_schema(self.schema, other.schema, lk, rk, False, where)  # validate before adding nodes
        keys = other if list(other.schema.names) == rk else other.select(**{k: k for k in rk})
        left, right = self._exchanged(tuple(lk)), keys._exchanged(tuple(rk))
        # lineage invariant 4: none (a change of the right side re-emits old left rows)
        return self.circuit.add_operator(SemiJoin(left.node_id, right.node_id, self.schema, keys.schema, lk, rk,
                                                  anti, where))

    def semi_join(self, other: "Stream", on: str | Sequence[str] | None = None,
                  left_on: str | Sequence[str] | None = None, right_on: str | Sequence[str] | None = None
                  ) -> "Stream":
        """The rows of this stream whose key has a match in ``other`` (SQL ``EXISTS`` / ``IN``), each with its
        own multiplicity; the output has this stream's columns (operators/semi_join.py).

        >>> import pyarrow as pa
        >>> import dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> a = c.input("a", pa.schema([("k", pa.int64())]))
        >>> b = c.input("b", pa.schema([("id", pa.int64()), ("v", pa.int64())]))
        >>> c.output("s", a.semi_join(b, left_on="k", right_on="id"))
        >>> p = dbsp.Pipeline(c)
        >>> p.push("a", pa.table({"k": [1, 1, 2]})); p.push("b", pa.table({"id": [1, 1], "v": [5, 6]}))
        >>> p.step()["s"].to_dict()
        {(1,): 2}
        """
        return self._semi(other, on, left_on, right_on, anti=False)

    def anti_join(self, other: "Stream", on: str | Sequence[str] | None = None,
                  left_on: str | Sequence[str] | None = None, right_on: str | Sequence[str] | None = None
                  ) -> "Stream":
        """The rows of this stream whose key has no match in ``other`` (SQL ``NOT EXISTS``); a null key never
        matches, so such rows are kept.

        >>> import pyarrow as pa
        >>> import dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> a = c.input("a", pa.schema([("k", pa.int64())]))
        >>> b = c.input("b", pa.schema([("k", pa.int64())]))
        >>> c.output("s", a.anti_join(b, on="k"))
        >>> p = dbsp.Pipeline(c)
        >>> p.push("a", pa.table({"k": [1, 2, None]})); p.push("b", pa.table({"k": [1]}))
        >>> sorted(p.step()["s"].to_dict().items(), key=str)
        [((2,), 1), ((None,), 1)]
        """
        return self._semi(other, on, left_on, right_on, anti=True)

    def group_by(self, *keys: str) -> "GroupBy":
        """Group rows by ``keys`` (none: the whole stream is one group); finish with :meth:`GroupBy.agg`,
        :meth:`GroupBy.top_k`, :meth:`GroupBy.argmax`, :meth:`GroupBy.argmin` or :meth:`GroupBy.session`."""
        return GroupBy(self, keys)

    # ---- event time (dbsp_core/time; windows in dbsp_core/operators) ----

    def tumble(self, column: str, size: int, start: str = "window_start", end: str = "window_end") -> "Stream":
        """Tumbling windows of ``size`` over time ``column``: adds ``start`` / ``end`` (dbsp_core.operators.window)."""
        return tumble(self, column, size, start, end)

    def hop(self, column: str, size: int, slide: int, start: str = "window_start", end: str = "window_end"
            ) -> "Stream":
        """Hopping windows of ``size`` every ``slide`` over time ``column`` (see dbsp_core.operators.window)."""
        return hop(self, column, size, slide, start, end)

    def proc_tumble(self, size: int, unit: str = "ms", start: str = "window_start", end: str = "window_end"
                    ) -> "Stream":
        """Tumbling windows of processing time: each row gets the window of ``size`` ``unit`` holding the now of
        the step in which it arrives (``timestamp[unit]`` columns; see dbsp_core.operators.proctime)."""
        return proc_tumble(self, size, unit, start, end)

    def session(self, column: str, gap: int, by: str | Sequence[str] = (), start: str = "session_start",
                end: str = "session_end") -> "Stream":
        """Session windows over time ``column`` per group of ``by`` (none: one group): each row with its
        session's ``start`` and ``end`` columns; ``group_by(*by).session(column, gap)`` (dbsp_core.operators.session).

        >>> import pyarrow as pa
        >>> s = Circuit().input("t", pa.schema([("k", pa.int64()), ("t", pa.int64())]))
        >>> s.session("t", 10, by="k").schema.names
        ['k', 't', 'session_start', 'session_end']
        """
        return self.group_by(*([by] if isinstance(by, str) else by)).session(column, gap, start, end)

    def interval_join(self, other: "Stream", left_time: str, right_time: str, lower: int, upper: int,
                      on: str | Sequence[str] | None = None, left_on: str | Sequence[str] | None = None,
                      right_on: str | Sequence[str] | None = None) -> "Stream":
        """Equi-join on keys of the pairs with ``right_time + lower <= left_time <= right_time + upper``."""
        return interval_join(self, other, left_time, right_time, lower, upper, on, left_on, right_on)

    def __repr__(self) -> str:
        return f"Stream({self.op.label}, {self.schema.names})"


class GroupBy:
    """``stream.group_by(*keys)``, waiting for :meth:`agg`."""

    def __init__(self, stream: Stream, keys: Sequence[str]) -> None:
        self.stream = stream
        self.keys = tuple(keys)

    def _keyed(self, where: str) -> tuple[Stream, tuple[str, ...], str | None]:
        """The stream to group and its keys: a keyless group_by() groups by a hidden constant key."""
        s = self.stream
        if self.keys:
            return s, self.keys, None
        s = s.circuit.add_operator(AddGlobalKey(s.node_id, s.schema, s.op.partitioning, where), s.times)
        return s, (GLOBAL_KEY,), GLOBAL_KEY

    def agg(self, **aggs: AggSpec) -> Stream:
        """One row per non-empty group: the keys, then one column per ``name=dbsp.count()/sum/min/max/avg`` or
        ``dbsp.count_distinct(col)``. With no keys, one row over the whole stream (none once it is empty).

        >>> import pyarrow as pa
        >>> import dbsp_core as dbsp
        >>> s = dbsp.Circuit().input("t", pa.schema([("k", pa.utf8()), ("v", pa.int64())]))
        >>> s.group_by("k").agg(total=dbsp.sum("v")).schema.types
        [DataType(string), DataType(int64)]
        >>> s.group_by().agg(n=dbsp.count(), keys=dbsp.count_distinct("k")).schema.names
        ['n', 'keys']
        """
        s0 = self.stream
        where = s0._where("aggregate")
        keys0 = self.keys if self.keys else (GLOBAL_KEY,)
        schema0 = s0.schema if self.keys else pa.schema(list(s0.schema) + [pa.field(GLOBAL_KEY, pa.int64())])
        Aggregate(-1, schema0, keys0, aggs, where, output_keys=bool(self.keys))  # validate before adding nodes
        s, keys, hidden = self._keyed(where)
        op = Aggregate(-1, s.schema, keys, aggs, where, output_keys=hidden is None)
        circuit = s.circuit
        if op.linear:  # combine each worker's change into partial rows before the exchange
            pre = circuit.add_operator(PreAggregate(s.node_id, op, s.op.partitioning),
                                       passed(s.times, {k: k for k in keys}))
            src = pre._exchanged(keys)
            for col in op.distinct_columns:  # count_distinct: value flips per group, as partial rows, counted
                # where each (keys, value) pair lives and summed per group (operators/count_distinct.py inv. 1-2)
                vals = s.select(**{c: c for c in dict.fromkeys(keys + (col,))})._exchanged(pair_key(keys, col))
                flips = circuit.add_operator(CountDistinct(vals.node_id, vals.schema, op, col),
                                             passed(vals.times, {k: k for k in keys}), (vals.times,))
                src = src + flips._exchanged(keys)
        else:
            src = s._exchanged(keys)
            if op.extremes and circuit.inserts_only(src.node_id):
                op.append_only = True  # operators/aggregate.py invariant 7: no value multisets kept
        op.inputs = (src.node_id,)
        return circuit.add_operator(op, passed(src.times, {k: k for k in keys}) if hidden is None else {}, (src.times,))

    def top_k(self, k: int, order_by: object, with_ties: bool = False) -> Stream:
        """The first ``k`` rows of each group in ``order_by`` order (columns, or ``(column, "descending")``),
        ties broken by the other columns; ``with_ties`` also keeps rows tied with the k-th (operators/top_k.py).

        >>> import pyarrow as pa
        >>> import dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> t = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]))
        >>> c.output("top", t.group_by("k").top_k(2, ("v", "descending")))
        >>> p = dbsp.Pipeline(c)
        >>> p.push("t", pa.table({"k": [1, 1, 1, 2], "v": [5, 9, 7, 1]}))
        >>> sorted(p.step()["top"].to_dict())
        [(1, 7), (1, 9), (2, 1)]
        """
        s0 = self.stream
        where = s0._where("top_k")
        order = order_spec(order_by, where)
        schema0 = s0.schema if self.keys else pa.schema(list(s0.schema) + [pa.field(GLOBAL_KEY, pa.int64())])
        TopK(-1, schema0, self.keys or (GLOBAL_KEY,), order, k, with_ties, where)  # validate before adding nodes
        s, keys, hidden = self._keyed(where)
        src = s._exchanged(keys)
        op = TopK(src.node_id, src.schema, keys, order, k, with_ties, where, hidden,
                  append_only=s.circuit.inserts_only(src.node_id),
                  grows=s.circuit.count_grows(src.node_id, keys, order[0]))
        return s.circuit.add_operator(op, passed(src.times, {c: c for c in keys if c != hidden}), (src.times,))

    def session(self, column: str, gap: int, start: str = "session_start", end: str = "session_end") -> Stream:
        """Session windows per group over time ``column``: every row followed by its session's ``start`` (first
        time) and ``end`` (last time + ``gap``), a session ending where the next row of the group comes more than
        ``gap`` time units later (dbsp_core/operators/session.py). Aggregate by the keys and the session columns for
        per-session results; sessions a watermark closes leave the state.

        >>> import pyarrow as pa
        >>> import dbsp_core as dbsp
        >>> c = dbsp.Circuit()
        >>> bid = c.input("bid", pa.schema([("bidder", pa.int64()), ("t", pa.int64())]), event_time="t", lateness=15)
        >>> s = bid.group_by("bidder").session("t", 10)
        >>> c.output("n", s.group_by("bidder", "session_start", "session_end").agg(n=dbsp.count()))
        >>> p = dbsp.Pipeline(c)
        >>> p.push("bid", pa.table({"bidder": [1, 1, 1, 2], "t": [0, 8, 25, 5]}))
        >>> sorted(p.step()["n"].to_dict())
        [(1, 0, 18, 2), (1, 25, 35, 1), (2, 5, 15, 1)]
        >>> p.push("bid", pa.table({"bidder": [1], "t": [17]}))  # bridges the two sessions of bidder 1
        >>> sorted(p.step()["n"].to_dict().items())
        [((1, 0, 18, 2), -1), ((1, 0, 35, 4), 1), ((1, 25, 35, 1), -1)]
        """
        s0 = self.stream
        where = s0._where("session")
        schema0 = s0.schema if self.keys else pa.schema(list(s0.schema) + [pa.field(GLOBAL_KEY, pa.int64())])
        Session(-1, schema0, self.keys or (GLOBAL_KEY,), column, gap, start, end, where)  # validate first
        s, keys, hidden = self._keyed(where)
        src = s._exchanged(keys)
        op = Session(src.node_id, src.schema, keys, column, gap, start, end, where, hidden)
        times = passed(src.times, {c: c for c in keys if c != hidden})
        if column in src.times:  # session.py invariant 5
            times[end] = src.times[column]
        return s.circuit.add_operator(op, times, (src.times,))

    def argmax(self, column: str, with_ties: bool = True) -> Stream:
        """The rows of each group with the largest ``column`` (all of them, unless ``with_ties=False``)."""
        return self.top_k(1, (column, "descending"), with_ties)

    def argmin(self, column: str, with_ties: bool = True) -> Stream:
        """The rows of each group with the smallest ``column`` (all of them, unless ``with_ties=False``)."""
        return self.top_k(1, (column, "ascending"), with_ties)


def _source_hash(fn: object) -> str:
    """A hash of a function's source text (dedented, blank lines dropped), not of its bytecode: the same code gives
    the same hash under another Python version; "" when the source is not available (functions built at run
    time), so only the function's name counts then."""
    import inspect
    import linecache
    import textwrap

    try:
        path = inspect.getsourcefile(fn)  # type: ignore[arg-type]
        if path:
            linecache.checkcache(path)  # a file changed since it was read: read it again
        src = inspect.getsource(fn)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""
    text = "\n".join(line.rstrip() for line in textwrap.dedent(src).splitlines() if line.strip())
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _node_text(op: Operator, inputs: str, ref: Callable[[Operator], str]) -> str:
    """What a fingerprint hashes of one node: kind, ``inputs`` (how the caller names them), schema, parameters;
    ``ref`` names a parameter that is another node."""
    parts = [type(op).__name__, getattr(op, "kind", ""), inputs, op.schema.to_string(), repr(op.partitioning)]
    for k, v in sorted(vars(op).items()):
        if k in ("node_id", "inputs", "schema", "partitioning", "stored", "grows"):  # stored, grows: what a run
            continue  # keeps, not what the circuit computes (operators/pruned.py; top_k.py invariant 7)
        if isinstance(v, (str, int, float, bool, type(None))):
            parts.append(f"{k}={v!r}")
        elif isinstance(v, (tuple, list)):  # of expressions too: their text as before strftime's C path
            parts.append(f"{k}=" + fingerprint_text(repr(v)))
        elif isinstance(v, pa.Schema):
            parts.append(f"{k}={v.to_string()}")
        elif isinstance(v, Operator):
            parts.append(f"{k}={ref(v)}")
        elif callable(v):
            parts.append(f"{k}=<{getattr(v, '__module__', '')}.{getattr(v, '__qualname__', type(v).__name__)}"
                         f":{_source_hash(v)}>")
        else:
            # e.g. pyarrow compute expressions print their full text; addresses vary between processes
            # (strftime's C path printed as the expression it replaced, operators/expr.py fingerprint_text)
            parts.append(f"{k}=" + fingerprint_text(re.sub(r" at 0x[0-9a-fA-F]+", "", str(v))))
    return "\x1f".join(parts)


def circuit_fingerprint(circuit: Circuit) -> str:
    """A hash of the circuit's structure: every node's kind, inputs, schema and parameters, inputs and outputs.

    It depends on what the circuit computes as written (schemas, expression text, the source text of functions
    given to ``flat_map`` or ``filter_now``), never on Python bytecode or object addresses, so the same circuit
    has the same fingerprint in every process and after a Python or library upgrade (rolling upgrade). A call of
    strftime's C path is read as the expression it replaced (operators/expr.py ``fingerprint_text``).

    >>> import pyarrow as pa
    >>> c = Circuit(); s = c.input("x", pa.schema([("a", pa.int64())])); c.output("o", s.distinct())
    >>> len(circuit_fingerprint(c))
    64
    """
    h = hashlib.sha256()
    for op in circuit.nodes:
        h.update(_node_text(op, repr(op.inputs), lambda v: f"node#{v.node_id}").encode("utf-8") + b"\x1e")
    h.update(repr(sorted(circuit.inputs.items())).encode() + repr(sorted(circuit.outputs.items())).encode())
    return h.hexdigest()


PART_FINGERPRINTS_VERSION = 1  # of :func:`part_fingerprints`; META records it with them


def part_fingerprints(circuit: Circuit) -> dict:
    """A fingerprint per input, per output and per node: a hash of the node and, recursively, of every node it
    reads, by their content rather than their position, so a view keeps its fingerprint when other views are
    added, removed or changed (META records these to name the views and tables that differ, recovery.py, and
    to find which nodes' state a changed program keeps, dbsp_core.runtime.change). ``nodes`` lists the
    fingerprint of every node by id (None for a node that feeds no output, which never runs).

    >>> import pyarrow as pa
    >>> c = Circuit(); s = c.input("x", pa.schema([("a", pa.int64())])); c.output("o", s.distinct())
    >>> d = Circuit(); t = d.input("x", pa.schema([("a", pa.int64())])); d.output("n", t); d.output("o", t.distinct())
    >>> part_fingerprints(c)["outputs"]["o"] == part_fingerprints(d)["outputs"]["o"]
    True
    """
    h: dict[int, str] = {}
    live = set(circuit.live_nodes())  # a node that is not run holds no state: it has no fingerprint in "nodes"
    for op in circuit.nodes:  # inputs are earlier nodes (invariant 1)
        ins = repr(tuple(h[i] for i in op.inputs))
        # a later node (e.g. a pre-aggregate's aggregate) is named by its distance, the same wherever the pair is
        text = _node_text(op, ins, lambda v: h.get(v.node_id, f"node+{v.node_id - op.node_id}"))
        h[op.node_id] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return {"version": PART_FINGERPRINTS_VERSION,
            "inputs": {name: h[i] for name, i in sorted(circuit.inputs.items())},
            "outputs": {name: h[i] for name, i in sorted(circuit.outputs.items())},
            "nodes": [h[i] if i in live else None for i in range(len(circuit.nodes))]}
