"""Where the time goes: each worker's step loop times its operators (:func:`run_nodes`), and ``Pipeline.profile()`` turns those timings, the operators' rows and their traces' state into one record per operator and per view, which a checkpoint also writes to ``PROFILE`` for ``dbsp profile DIR``.

Invariants (enforced here):
  1. Measuring costs two ``perf_counter`` calls and a few list updates per operator per step, never work per
     row: rows are counted from the Z-sets' lengths, state from their batches' Arrow buffer sizes.
  2. ``rows_out`` of an operator (summed over workers) equals ``rows_in`` its consumers see from it (an input,
     which has no inputs, has ``rows_in`` None; its ``rows_out`` are the rows pushed to it): every value
     an operator returns is what its consumers on that worker get (the exchange counts what it receives, and
     its bytes are those sent to other workers).
  3. Times: ``seconds`` is summed over workers (the work); ``mean_ms`` and ``p99_ms`` are over the newest
     ``WINDOW`` steps of the slowest worker's time in each step (what the step waits for). An exchange's time
     includes its wait at the barrier for the other workers.
  4. A record has fixed fields; one another measurement fills (a spilled trace's ``disk_bytes``, its
     ``cache_hits``) is None until something measures it, never a made-up 0; so are the timings and rows of a
     node no timer in this process ran (stage tasks on Spark executors): every live node has a record.

The staged executor's stage tasks time their nodes where they run: in this process (``LocalJobRunner``) the
driver reads them from :func:`task_timers`; tasks on Spark executors keep theirs there (not reported). Every
attempt of a retried task counts.
"""

from __future__ import annotations

import collections
import math
import operator
import threading
import time
from typing import Any, Iterable

__all__ = ["NodeTimer", "Profile", "WINDOW", "format_table", "operator_profile", "pipeline_profile",
           "prometheus_families", "reset_task_timers", "run_nodes", "task_timer", "task_timers", "zset_bytes"]

WINDOW = 256
"""Steps kept per worker for the per-step figures (mean, p99)."""

PROFILE_FORMAT = 1
"""Version of the ``PROFILE`` record's body (dbsp_core.storage.formats)."""

OPERATOR_FIELDS = ("node", "operator", "kind", "steps", "seconds", "mean_ms", "p99_ms", "rows_in", "rows_out",
                   "state_rows", "state_bytes", "key_index_bytes", "exchange_bytes", "disk_bytes", "cache_hits")
VIEW_FIELDS = ("view", "node", "rows_out", "net_rows", "upstream_seconds", "upstream_state_bytes")


class NodeTimer:
    """One worker's measurements of the nodes it runs (for the staged executor: one stage's nodes)."""

    __slots__ = ("nodes", "seconds", "rows_in", "rows_out", "steps", "recent", "step", "exchange_bytes")

    def __init__(self, nodes: Iterable[int], window: int = WINDOW) -> None:
        self.nodes = list(nodes)
        n = len(self.nodes)
        self.seconds = [0.0] * n
        self.rows_in = [0] * n
        self.rows_out = [0] * n
        self.steps = 0
        self.recent: collections.deque = collections.deque(maxlen=window)  # (step, [seconds per node])
        self.step = -1  # the step about to run (the executor sets it)
        self.exchange_bytes: dict[int, int] = {}  # exchange node -> bytes this worker sent to the others


_add = operator.add


def zset_bytes(z: Any) -> int:
    """Bytes of a Z-set's Arrow buffers and weights."""
    return int(z.data.nbytes) + int(z.weights.nbytes)


def run_nodes(calls: list[tuple[Any, tuple, int]], values: dict, ctx: Any, timer: NodeTimer) -> None:
    """Run ``calls`` (``(step function, input nodes, node)`` in order) over ``values``, timing each (invariant 1).
    On an exception the failing node is the first of ``calls`` without a value."""
    clock = time.perf_counter
    m = len(calls)
    dts, ins, outs = [0.0] * m, [0] * m, [0] * m
    get = values.__getitem__
    k = 0
    try:
        for step, inputs, i in calls:
            args = list(map(get, inputs))  # (not a comprehension: no function object made and called per node)
            n = 0
            for a in args:
                n += a.num_rows
            t = clock()
            out = step(args, ctx)
            dts[k] = clock() - t
            values[i] = out
            ins[k] = n
            outs[k] = out.num_rows
            k += 1
    finally:  # the nodes that ran (the others add 0), summed in C, not three sums of Python per node
        sec, rin, rout = timer.seconds, timer.rows_in, timer.rows_out
        sec[:] = map(_add, sec, dts)
        rin[:] = map(_add, rin, ins)
        rout[:] = map(_add, rout, outs)
    timer.recent.append((timer.step, dts))
    timer.steps += 1


def failed_node(calls: list[tuple[Any, tuple, int]], values: dict) -> int:
    """The node :func:`run_nodes` was running when it raised (-1 if none)."""
    return next((i for _, _, i in calls if i not in values), -1)


# ---- stage tasks' timers (the staged executor) ----

_TASK_TIMERS: dict[tuple[str, int, int], NodeTimer] = {}
_TASK_LOCK = threading.Lock()


def task_timer(storage: str, stage: int, worker: int, nodes: list[int]) -> NodeTimer:
    """The timer of stage ``stage`` on ``worker`` of the pipeline at ``storage`` in this process."""
    key = (storage, stage, worker)
    with _TASK_LOCK:
        t = _TASK_TIMERS.get(key)
        if t is None or t.nodes != list(nodes):
            t = _TASK_TIMERS[key] = NodeTimer(nodes)
        return t


def task_timers(storage: str) -> list[NodeTimer]:
    with _TASK_LOCK:
        return [t for (s, _, _), t in _TASK_TIMERS.items() if s == storage]


def reset_task_timers(storage: str) -> None:
    """Forget the stage tasks' timings of ``storage`` (a pipeline opened on it starts counting at zero)."""
    with _TASK_LOCK:
        for key in [k for k in _TASK_TIMERS if k[0] == storage]:
            del _TASK_TIMERS[key]


# ---- the profile ----


_UNTIMED = {"steps": None, "seconds": None, "rows_in": None, "rows_out": None, "exchange_bytes": None}


def _total(xs: Iterable[float | None]) -> float | None:
    """The sum of the measured ``xs`` (None if none is)."""
    got = [x for x in xs if x is not None]
    return sum(got) if got else None


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def _state_by_label(traces: dict[str, Any]) -> dict[str, list[int]]:
    """``{operator label: [rows, bytes, key index bytes]}`` of one worker's traces (``"<label>.<name>"``)."""
    out: dict[str, list[int]] = {}
    for key, trace in traces.items():
        acc = out.setdefault(key.rsplit(".", 1)[0], [0, 0, 0])
        placed, pending = trace.parts(sync=False)  # (an estimate: trace/levels.py invariant 19)
        for b in list(placed) + list(pending):
            acc[0] += len(b)
            acc[1] += b.size_bytes()  # (a batch in a format-2 file: not read, trace/groupedbatch.py)
        rows, nbytes, _ = trace.unsynced_size()  # totals kept per key the batches lack (no sync)
        acc[0] += rows
        acc[1] += nbytes
        acc[2] += trace.index_bytes
    return out


def operator_profile(circuit: Any, timers: list[NodeTimer], views: dict[str, dict], worker_traces: list | None
                     ) -> dict:
    """The profile: ``{"operators": [record per live node], "views": [record per view]}`` (fields
    :data:`OPERATOR_FIELDS`, :data:`VIEW_FIELDS`). ``views``: ``{name: {"rows_out", "net_rows"}}`` (the
    driver's counts of the consolidated output); ``worker_traces``: each worker's traces, or None to leave the
    state fields None."""
    nodes = circuit.nodes
    acc: dict[int, dict] = {}
    per_step: dict[int, dict[int, float]] = {}  # node -> step -> slowest worker's seconds
    for t in timers:
        for k, i in enumerate(t.nodes):
            a = acc.get(i)
            if a is None:
                a = acc[i] = {"steps": 0, "seconds": 0.0, "rows_in": 0, "rows_out": 0, "exchange_bytes": None}
            a["steps"] = max(a["steps"], t.steps)
            a["seconds"] += t.seconds[k]
            a["rows_in"] += t.rows_in[k]
            a["rows_out"] += t.rows_out[k]
        for step, dts in list(t.recent):
            for k, i in enumerate(t.nodes):
                d = per_step.setdefault(i, {})
                d[step] = max(d.get(step, 0.0), dts[k])
    for t in timers:  # an exchange the staged executor makes a stage boundary is timed by no stage: bytes only
        for x, b in t.exchange_bytes.items():
            a = acc.setdefault(x, dict(_UNTIMED))
            a["exchange_bytes"] = (a["exchange_bytes"] or 0) + b
    state: dict[str, list[int]] | None = None
    if worker_traces is not None:
        state = {}
        for traces in worker_traces:
            for label, (r, b, ix) in _state_by_label(traces).items():
                s = state.setdefault(label, [0, 0, 0])
                s[0] += r
                s[1] += b
                s[2] += ix
    ops = []
    for i in circuit.live_nodes():  # a node no timer here ran (tasks on Spark executors): state only
        a, node = acc.get(i, _UNTIMED), nodes[i]
        window = list(per_step.get(i, {}).values())
        st = state.get(node.label, [0, 0, 0]) if state is not None else [None, None, None]
        ops.append({"node": i, "operator": node.label, "kind": node.kind, "steps": a["steps"],
                    "seconds": a["seconds"],
                    "mean_ms": 1e3 * sum(window) / len(window) if window else None,
                    "p99_ms": 1e3 * _quantile(window, 0.99) if window else None,
                    "rows_in": a["rows_in"] if node.inputs else None, "rows_out": a["rows_out"],
                    "state_rows": st[0], "state_bytes": st[1], "key_index_bytes": st[2],
                    "exchange_bytes": a["exchange_bytes"], "disk_bytes": None, "cache_hits": None})
    by_node = {r["node"]: r for r in ops}
    out_views = []
    for name, i in circuit.outputs.items():
        up, todo = set(), [i]
        while todo:  # the operators the view depends on (shared ones count in each view)
            j = todo.pop()
            if j not in up:
                up.add(j)
                todo.extend(nodes[j].inputs)
        mine = [by_node[j] for j in up if j in by_node]
        sb = [r["state_bytes"] for r in mine if r["state_bytes"] is not None]
        v = views.get(name, {})
        out_views.append({"view": name, "node": i, "rows_out": v.get("rows_out"), "net_rows": v.get("net_rows"),
                          "upstream_seconds": _total(r["seconds"] for r in mine),
                          "upstream_state_bytes": sum(sb) if state is not None else None})
    return {"format": PROFILE_FORMAT, "operators": ops, "views": out_views}


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def format_table(prof: dict) -> str:
    """The profile as two plain-text tables (operators by time, then views).

    >>> print(format_table({"operators": [], "views": []}).splitlines()[0].split()[:3])
    ['node', 'operator', 'kind']
    """
    lines = []
    for fields, rows in ((OPERATOR_FIELDS, sorted(prof["operators"], key=lambda r: -(r["seconds"] or 0.0))),
                         (VIEW_FIELDS, prof["views"])):
        cells = [list(fields)] + [[_cell(r.get(f)) for f in fields] for r in rows]
        widths = [max(len(c[k]) for c in cells) for k in range(len(fields))]
        lines += ["  ".join(c[k].rjust(widths[k]) if k > 2 else c[k].ljust(widths[k]) for k in range(len(fields)))
                  .rstrip() for c in cells]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


class Profile(dict):
    """What :meth:`dbsp_core.Pipeline.profile` returns: ``{"operators": [...], "views": [...]}`` (plain data,
    JSON-able) that prints as two tables; :meth:`table` gives either list as a pyarrow Table."""

    def __str__(self) -> str:
        return format_table(self)

    def table(self, which: str = "operators") -> Any:
        import pyarrow as pa

        if which not in ("operators", "views"):
            raise ValueError(f"Profile.table: which must be 'operators' or 'views', got {which!r}")
        fields = OPERATOR_FIELDS if which == "operators" else VIEW_FIELDS
        return pa.table({f: [r[f] for r in self[which]] for f in fields})


def pipeline_profile(p: Any, state: bool = True) -> Profile:
    """The profile of pipeline ``p`` (its step lock held): the executor's timers, the driver's output counts
    and, with ``state``, every worker's traces (a staged executor reads them from its stage databases)."""
    snap = p._metrics.snapshot()
    views = {name: {"rows_out": snap["rows_out"].get(name), "net_rows": snap["net_rows"].get(name)}
             for name in p.circuit.outputs}
    ex = p.executor
    traces = [ex.traces(w) for w in range(p.layout.workers)] if state else None
    prof = Profile(operator_profile(p.circuit, ex.node_timers(), views, traces))
    prof["steps"] = snap["steps"]
    prof["workers"] = p.layout.workers
    prof["executor"] = ex.kind
    return prof


def prometheus_families(prof: dict) -> list:
    """The profile's Prometheus families (dbsp_core.metrics lists their names)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    labels = ["operator", "kind"]
    fams = {}
    for name, cls, doc, extra in (
            ("operator_seconds", CounterMetricFamily, "Seconds an operator's steps took, summed over workers", []),
            ("operator_rows_in", CounterMetricFamily, "Rows an operator received, summed over workers", []),
            ("operator_rows_out", CounterMetricFamily, "Rows an operator returned, summed over workers", []),
            ("operator_step_seconds", GaugeMetricFamily, "An operator's seconds per step on the slowest worker, "
             f"mean and p99 of the newest {WINDOW} steps", ["quantile"]),
            ("operator_state_rows", GaugeMetricFamily, "Rows of an operator's traces, all workers", []),
            ("operator_state_bytes", GaugeMetricFamily, "Bytes of an operator's traces, all workers", []),
            ("operator_exchange_bytes", CounterMetricFamily, "Bytes an exchange sent between workers", [])):
        fams[name] = cls("dbsp_" + name, doc, labels=labels + extra)
    for r in prof["operators"]:
        lab = [r["operator"], r["kind"]]
        for key in ("seconds", "rows_in", "rows_out", "state_rows", "state_bytes", "exchange_bytes"):
            if r[key] is not None:
                fams["operator_" + key].add_metric(lab, r[key])
        for q, key in (("mean", "mean_ms"), ("0.99", "p99_ms")):
            if r[key] is not None:
                fams["operator_step_seconds"].add_metric(lab + [q], r[key] / 1e3)
    return list(fams.values())
