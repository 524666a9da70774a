"""What a running pipeline is doing, as numbers: counters and a step-latency histogram the driver updates, gathered with log sizes, state bytes per worker and shard and late rows by ``Pipeline.metrics()``, and served as Prometheus text.

Invariants (enforced here):
  1. Updating costs O(1) per push, per step and per checkpoint (no per-row work): rows are counted from a
     Z-set's length, latencies go into fixed buckets.
  2. Counters only grow while a pipeline object lives; they start at zero when a pipeline is opened (the
     output log and the input log remain the durable record of what ran). ``METRICS`` (dbsp_core.storage.formats,
     written atomically at each checkpoint) keeps the last checkpoint's snapshot for ``dbsp inspect``.
  3. State bytes are the Arrow buffer sizes of every trace batch, split over shards by the batch's rows per
     shard (a batch is sorted by key hash, so each shard's rows are one range): they add up to the total.
  4. A metrics server (:func:`serve`; Prometheus text, and the status page of dbsp_core.status) lives no longer
     than its pipeline: ``Pipeline.close`` stops it
     (:func:`stop_serving`), and a scrape that meets a closed or broken pipeline is answered with HTTP 503 and
     one line saying why, never a traceback.

The Prometheus names (``dbsp_`` prefix): ``steps_total``, ``pushes_total``, ``duplicate_pushes_total``,
``rows_in_total{input}``, ``rows_out_total{output}``, ``step_seconds`` (histogram), ``checkpoints_total``,
``checkpoint_seconds`` (last), ``checkpoint_time_seconds_total``, ``replayed_steps_total``, ``recovery_seconds``,
``log_bytes{log}``, ``state_bytes{worker}``, ``state_shard_bytes{worker,shard}``, ``key_index_bytes{worker}``,
under a memory budget ``spill_memory_bytes``, ``spill_disk_bytes``, ``spill_mapped_bytes``,
``spill_bytes_written_total``, ``spill_evictions_total``, ``trace_memory_bytes{operator}``,
``trace_disk_bytes{operator}`` (trace invariant 12),
(the traces' key indexes, memory beside the state: trace invariant 11, dbsp_core/trace/keyindex.py), ``late_rows_total{input}``,
``output_steps{end}`` (first, last), ``consumer_next_step{consumer}``, ``workers``, ``shards``; of each source
(dbsp_core.connectors.files) ``source_files_total{source}``, ``source_rows_total{source}``,
``source_bad_files_total{source}``, ``source_quarantined_files_total{source}``,
``source_rewritten_files_total{source}``; ``process_resident_bytes``, ``sink_lag_steps{consumer}``; the backlog ``backlog_rows``, ``backlog_bytes``, ``backlog_age_seconds``;
with an autoscaling policy (dbsp_core.runtime.autoscaler) ``autoscale_decisions_total{reason}``,
``autoscale_rescales_total``, ``autoscale_failed_rescales_total``, ``autoscale_max_workers``,
``autoscale_target_workers``, ``autoscale_last_decision{action,reason}``, ``autoscale_input{input}``; and the
profile's per-operator series (dbsp_core.profile: ``operator_seconds_total{operator,kind}``,
``operator_rows_in_total``, ``operator_rows_out_total``, ``operator_step_seconds{operator,kind,quantile}``,
``operator_state_bytes``, ``operator_state_rows``, ``operator_exchange_bytes_total``; one series per live operator
of the circuit, so their number is bounded by the circuit, not by the data).
"""

from __future__ import annotations

import bisect
import collections
import math
import os
import socket
import threading
import time
import weakref
from typing import Any

import numpy as np

from dbsp_core import _zset
from dbsp_core.profile import pipeline_profile, prometheus_families
from dbsp_core.status import page as status_page, status_json

__all__ = ["Metrics", "STEP_BUCKETS", "attach_source", "gather", "prometheus_text", "serve", "sources", "state_bytes",
           "stop_serving"]

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Upper bounds (seconds) of the step-latency histogram's buckets; one more bucket holds everything above."""


_SUM = _zset.weight_sum  # a weight array's exact sum in one C loop (numpy's reduce: ~9k instructions a call)


class Metrics:
    """The counters one pipeline updates (invariants 1 and 2); read them with :meth:`snapshot`.

    >>> m = Metrics(["bids"], ["totals"])
    >>> from dbsp_core import ZSet
    >>> import pyarrow as pa
    >>> m.pushed("bids", 3); m.stepped([0], [{"totals": ZSet.from_arrow(pa.table({"k": [1, 2]}))}], 0.004)
    >>> s = m.snapshot(); s["steps"], s["rows_in"], s["rows_out"], s["step_seconds"]["count"]
    (1, {'bids': 3}, {'totals': 2}, 1)
    """

    def __init__(self, inputs: list[str], outputs: list[str], recent: int = 4096) -> None:
        self._lock = threading.Lock()
        self.started = time.time()
        self.steps = 0
        self.pushes = 0
        self.rows_in = {name: 0 for name in inputs}
        self.rows_out = {name: 0 for name in outputs}
        self.buckets = [0] * (len(STEP_BUCKETS) + 1)
        self.step_sum = 0.0
        self.recent: collections.deque = collections.deque(maxlen=recent)  # (step, seconds) of the newest steps
        self.checkpoints = 0
        self.checkpoint_last = 0.0
        self.checkpoint_sum = 0.0
        self.autoscale: dict | None = None  # the autoscaler's snapshot (dbsp_core.runtime.autoscaler), if one runs
        self.net_rows = {name: 0 for name in outputs}  # sum of the views' change weights since open
        self.checkpoint_log: collections.deque = collections.deque(maxlen=64)  # (time, steps, seconds)

    def resume(self, saved: dict | None, step: int) -> None:
        """A durable pipeline opened with its state at ``step``: the counters go on from ``saved`` (the ``METRICS``
        record of the last checkpoint, taken at its step) instead of starting over, and ``steps`` is ``step``, so
        once recovery replayed the logged steps it is the number of the next step (the same numbering as the
        output log, counting each step once). A record from a step below ``step`` (a crash after the state's
        checkpoint, before its record) lacks the rows of the steps between, which are not run again."""
        pushes, rows, lat, ck = 0, ({}, {}, {}), None, (0, 0.0, 0.0)
        if saved:  # read whole before anything changes: a malformed record raises and leaves the counters
            pushes = int(saved.get("pushes", 0))
            rows = tuple({str(k): int(v) for k, v in (saved.get(key) or {}).items()}
                         for key in ("rows_in", "rows_out", "net_rows"))
            hist = saved.get("step_seconds") or {}
            if list(hist.get("buckets", [])) == list(STEP_BUCKETS) and len(hist.get("counts", [])) == len(self.buckets):
                lat = ([int(n) for n in hist["counts"]], float(hist.get("sum", 0.0)))
            ck = (int(saved.get("checkpoints", 0)), float(saved.get("checkpoint_seconds", 0.0)),
                  float(saved.get("checkpoint_seconds_sum", 0.0)))
        with self._lock:
            self.steps = step
            self.pushes = pushes
            for mine, theirs in zip((self.rows_in, self.rows_out, self.net_rows), rows):
                mine.update({name: n for name, n in theirs.items() if name in mine})
            if lat is not None:
                self.buckets, self.step_sum = lat
            self.checkpoints, self.checkpoint_last, self.checkpoint_sum = ck

    def pushed(self, handle: str, rows: int) -> None:
        with self._lock:
            self.pushes += 1
            self.rows_in[handle] = self.rows_in.get(handle, 0) + rows

    def stepped(self, steps: list[int], outs: list[dict[str, Any]], seconds: float) -> None:
        """``steps`` ran in ``seconds`` together; each is observed at its share of the time. ``outs`` holds each
        step's ``{output: change}`` (Z-sets: their stored rows are counted)."""
        per = seconds / max(1, len(steps))
        slot = bisect.bisect_left(STEP_BUCKETS, per)
        with self._lock:
            for step, out in zip(steps, outs):
                self.steps += 1
                self.buckets[slot] += 1
                self.step_sum += per
                self.recent.append((step, per))
                rows_out, net_rows = self.rows_out, self.net_rows
                for name, z in out.items():
                    w = z._w  # one weight per stored row (zset.py invariant 1)
                    rows_out[name] = rows_out.get(name, 0) + len(w)
                    net_rows[name] = net_rows.get(name, 0) + _SUM(w)

    def rows_in_total(self) -> int:
        """Rows pushed so far, over every input."""
        with self._lock:
            return sum(self.rows_in.values())

    def autoscaled(self, snapshot: dict | None) -> None:
        """The autoscaler's newest decisions (None: no policy any more)."""
        with self._lock:
            self.autoscale = snapshot

    def checkpointed(self, seconds: float) -> None:
        with self._lock:
            self.checkpoints += 1
            self.checkpoint_last = seconds
            self.checkpoint_sum += seconds
            self.checkpoint_log.append((time.time(), self.steps, seconds))

    def snapshot(self) -> dict:
        """The counters as plain data (JSON-able): what ``METRICS`` stores and :func:`gather` starts from."""
        with self._lock:
            lat = sorted(s for _, s in self.recent)
            pct = {f"p{q}": (lat[min(len(lat) - 1, math.ceil(q / 100 * len(lat)) - 1)] if lat else None)
                   for q in (50, 99)}
            return {"steps": self.steps, "pushes": self.pushes, "rows_in": dict(self.rows_in),
                    "rows_out": dict(self.rows_out),
                    "step_seconds": {"buckets": list(STEP_BUCKETS), "counts": list(self.buckets),
                                     "count": sum(self.buckets), "sum": self.step_sum,
                                     "mean": self.step_sum / self.steps if self.steps else None, **pct},
                    "checkpoints": self.checkpoints, "checkpoint_seconds": self.checkpoint_last,
                    "checkpoint_seconds_sum": self.checkpoint_sum, "since": self.started,
                    "net_rows": dict(self.net_rows),
                    **({"autoscale": self.autoscale} if self.autoscale is not None else {})}

    def recent_latencies(self) -> list[tuple[int, float]]:
        """``(step, seconds)`` of the newest steps (up to ``recent``), oldest first."""
        with self._lock:
            return list(self.recent)

    def checkpoint_history(self) -> list[tuple[float, int, float]]:
        """``(unix time, steps run, seconds)`` of the newest checkpoints (up to 64), oldest first."""
        with self._lock:
            return list(self.checkpoint_log)


class _Attached:
    """What hangs on one pipeline from outside it: its sources by name and its metrics servers."""

    def __init__(self) -> None:
        self.sources: dict[str, tuple[str, str, dict]] = {}  # name -> (input, what it reads, its stats)
        self.servers: list = []


_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ATTACHED_LOCK = threading.Lock()


def _attached(p: Any) -> _Attached:
    with _ATTACHED_LOCK:
        a = _ATTACHED.get(p)
        if a is None:
            a = _ATTACHED[p] = _Attached()
        return a


def attach_source(p: Any, name: str, handle: str, what: str, stats: dict) -> dict:
    """Register a source of pipeline ``p`` (dbsp_core.connectors.files invariant 2) and return the stats dict it
    is to count in: ``stats``, or the one of an earlier source of the same name, input and ``what`` (the same
    source made again: its counters go on). Another source of that name raises ValueError. :func:`gather`
    reports every source's stats as long as ``p`` lives."""
    a = _attached(p)
    with _ATTACHED_LOCK:
        had = a.sources.get(name)
        if had is None:
            a.sources[name] = (handle, what, stats)
            return stats
    if had[:2] != (handle, what):
        raise ValueError(f"{name!r} is already the name of a source of this pipeline (input {had[0]!r}, "
                         f"{had[1]}); two sources of one name drop each other's data as duplicates: give this "
                         "one another name=")
    return had[2]


def sources(p: Any) -> dict[str, dict]:
    """The counters of every source of ``p`` by name (a copy)."""
    a = _attached(p)
    with _ATTACHED_LOCK:
        return {name: dict(stats) for name, (_, _, stats) in a.sources.items()}


def state_bytes(traces: dict[str, Any], shard_bits: int) -> tuple[int, dict[int, int]]:
    """Bytes of a worker's traces in total and per shard with any state (invariant 3): their batches' and, for a
    trace keeping totals per key (trace/levels.py invariant 19), the rows its next sync would add at most, counted
    without a sync (``Trace.unsynced_size``)."""
    per = np.zeros(1 << shard_bits, dtype=np.float64)
    total = 0
    for trace in traces.values():
        placed, pending = trace.parts(sync=False)  # (an estimate: trace/levels.py invariant 19)
        for b in list(placed) + list(pending):
            n = len(b)
            if not n:
                continue
            nbytes = b.size_bytes()  # (a batch in a format-2 file: not read, trace/groupedbatch.py)
            total += nbytes
            bounds = b.shard_bounds(shard_bits, near=True)  # not the spilled key hashes' pages (zset.py)
            per += np.diff(bounds) * (nbytes / n)
        rows, nbytes, hashes = trace.unsynced_size()  # totals kept per key the batches lack (no sync)
        total += nbytes
        for kh, each in hashes:
            shard = (kh >> np.uint64(64 - shard_bits)).astype(np.int64) if shard_bits else np.zeros(len(kh), np.int64)
            per += np.bincount(shard, minlength=len(per)) * each
    shards = {int(s): int(round(per[s])) for s in np.flatnonzero(per)}
    return total, shards


def rss_bytes() -> int | None:
    """This process's resident memory in bytes (Linux ``/proc/self/statm``; None where there is none)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def gather(p: Any, state: bool = True) -> dict:
    """Everything :meth:`dbsp_core.Pipeline.metrics` returns (see there)."""
    out = p._metrics.snapshot()
    out["workers"] = p.layout.workers
    out["shards"] = p.layout.shards
    out["late_rows"] = dict(p.late_rows)
    out["duplicate_pushes"] = p.stats.get("duplicates", 0)
    out["replayed_steps"] = p.stats.get("replayed_steps", 0)
    out["recovery_seconds"] = p.stats.get("recovery_s", 0.0)
    out["sources"] = sources(p)
    rows, nbytes, age = p._backlog(time.monotonic())
    out["backlog"] = {"rows": rows, "bytes": nbytes, "age_s": age}
    if p.storage is not None:
        du = p.disk_usage()
        out["log_bytes"] = {"input": du["input"], "output": du["output"]}
        out["output_steps"] = [p.output_steps.start, p.output_steps.stop]
        out["consumers"] = p.consumers.list()
    out["rss_bytes"] = rss_bytes()
    if "consumers" in out:  # each consumer (a sink) is this many logged steps behind the output log's end
        out["sink_lag_steps"] = {name: max(0, out["output_steps"][1] - nxt) for name, nxt in out["consumers"].items()}
    if state:
        bits = p.layout.shard_bits
        out["state_bytes"] = {}
        for w in range(p.layout.workers):
            traces = p._live_traces(w)
            total, shards = state_bytes(traces, bits)
            out["state_bytes"][w] = {"total": total, "shards": shards,
                                     "key_index": sum(t.index_bytes for t in traces.values())}
        store = p.executor.batch_store
        if store is not None:
            out["spill"] = spill_metrics(store, [p._live_traces(w) for w in range(p.layout.workers)])
            if "substeps" in p.stats:  # steps run in pieces under the budget (dbsp_core/runtime/substep.py)
                out["spill"]["substeps"] = dict(p.stats["substeps"])
        elif "task_spill" in p.stats:  # a staged executor's task processes (runtime/stage_task.py invariant 7)
            out["spill"] = task_spill_metrics(p.stats["task_spill"])
    out["profile"] = pipeline_profile(p, state)  # after the state: p.traces refuses a closed pipeline first
    return out


def spill_metrics(store: Any, traces: list[dict[str, Any]]) -> dict:
    """The memory budget's state (trace invariant 12): ``limit``, ``memory_bytes`` (batches in memory),
    ``disk_bytes`` (batch files), the store's counters (files written and deleted, bytes written, cache
    evictions and bytes evicted, cache hits and misses, pages of lazily opened files checked, pages prefetched and
    their runs: trace/spill.py ``BatchStore.prefetch``) and per operator's
    trace (``"<label>.<trace>"``, summed over workers) its rows, bytes in memory, bytes in batch files (a file's
    size shared by the rows read from it), ``mapped_bytes`` (its files' pages reads may have left mapped in the
    process at the last enforce: 2 MiB per unit read, trace/spill.py invariant 12 "mapped"; the store's
    ``mapped_bytes`` adds the key indexes the cache holds: what the budget bounds beside ``memory_bytes`` and
    ``filter_bytes``) and cache hits and misses, in pages: per page of a spilled batch a read
    of the trace used, a hit when the cache held it, a miss when it had evicted it or never held it (trace/spill.py
    invariant 15; which of them fault is the kernel's to count)."""
    ops: dict[str, dict[str, int]] = {}
    for per_worker in traces:
        for label, t in per_worker.items():
            o = ops.setdefault(label, {"rows": 0, "memory_bytes": 0, "disk_bytes": 0, "mapped_bytes": 0,
                                       "cache_hits": 0, "cache_misses": 0})
            for k, v in store.trace_bytes(t).items():
                o[k] += v
            hits, misses = store.cache_counts(t)
            o["cache_hits"] += hits
            o["cache_misses"] += misses
    mem, kept = store.memory()
    out = {"limit": store.memory_limit, "memory_bytes": mem, "filter_bytes": kept, "disk_bytes": store.disk_bytes(),
           "mapped_bytes": store.mapped_bytes(), "operators": ops}
    out.update(store.stats)
    return out


def task_spill_metrics(tot: dict) -> dict:
    """The memory budget of a staged executor's task processes, from what their tasks reported (runtime/staged.py
    ``_count_spills``): ``limit`` (per task process), the counters summed over every task so far, ``processes``
    (``host:pid`` -> bytes in memory and in files after its last task) and their sums ``memory_bytes`` and
    ``disk_bytes``, and ``files_by_stage_worker`` (``"<stage>.<worker>"`` -> files its tasks wrote)."""
    out = {k: v for k, v in tot.items() if k not in ("by_stage_worker", "by_process")}
    procs = tot["by_process"]
    out["memory_bytes"] = sum(r["memory_bytes"] for r in procs.values())
    out["disk_bytes"] = sum(r["disk_bytes"] for r in procs.values())
    out["processes"] = {p: dict(r) for p, r in procs.items()}
    out["files_by_stage_worker"] = {f"{k}.{w}": n for (k, w), n in sorted(tot["by_stage_worker"].items())}
    out["operators"] = {}  # per operator: not reported by the tasks yet (their traces are in other processes)
    return out


def _families(m: dict) -> list:
    """Prometheus metric families of a :func:`gather` dict."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    def counter(name: str, doc: str, value: Any = None, labels: tuple = (), rows: dict | None = None) -> Any:
        f = CounterMetricFamily("dbsp_" + name, doc, labels=list(labels) or None)
        if rows is None:
            f.add_metric([], value)
        else:
            for k, v in rows.items():
                f.add_metric([str(k)], v)
        return f

    def gauge(name: str, doc: str, value: Any = None, labels: tuple = (), rows: dict | None = None) -> Any:
        f = GaugeMetricFamily("dbsp_" + name, doc, labels=list(labels) or None)
        if rows is None:
            f.add_metric([], value)
        else:
            for k, v in rows.items():
                f.add_metric(list(k) if isinstance(k, tuple) else [str(k)], v)
        return f

    lat = m["step_seconds"]
    cum, acc = [], 0
    for bound, c in zip(list(lat["buckets"]) + [math.inf], lat["counts"]):
        acc += c
        cum.append(("+Inf" if bound == math.inf else repr(float(bound)), acc))
    hist = HistogramMetricFamily("dbsp_step_seconds",
                                 "Seconds per step (the steps of a step run, divided together, share its time)")
    hist.add_metric([], cum, lat["sum"])
    fams = [counter("steps", "Steps run by the pipeline, across opens (each once): the number of its next step",
                    m["steps"]),
            counter("pushes", "Pushes accepted", m["pushes"]),
            counter("duplicate_pushes", "Pushes acknowledged as duplicates of a seen (producer, seq)",
                    m["duplicate_pushes"]),
            counter("rows_in", "Z-set rows pushed, per input", labels=("input",), rows=m["rows_in"]),
            counter("rows_out", "Z-set rows of the views' changes, per output", labels=("output",),
                    rows=m["rows_out"]),
            hist,
            counter("checkpoints", "Checkpoints taken", m["checkpoints"]),
            gauge("checkpoint_seconds", "Duration of the last checkpoint", m["checkpoint_seconds"]),
            counter("checkpoint_time_seconds", "Seconds spent in checkpoints", m["checkpoint_seconds_sum"]),
            counter("replayed_steps", "Steps replayed by recovery", m["replayed_steps"]),
            gauge("recovery_seconds", "Duration of the last recovery", m["recovery_seconds"]),
            counter("late_rows", "Rows dropped below the watermark, per input", labels=("input",),
                    rows=m["late_rows"]),
            gauge("workers", "Workers of the layout in force", m["workers"]),
            gauge("shards", "Shards of the layout in force", m["shards"])]
    if "backlog" in m:
        bl = m["backlog"]
        fams += [gauge("backlog_rows", "Rows pushed and not yet stepped", bl["rows"]),
                 gauge("backlog_bytes", "Bytes pushed and not yet stepped", bl["bytes"]),
                 gauge("backlog_age_seconds", "Age of the oldest push not yet stepped", bl["age_s"])]
    auto = m.get("autoscale")
    if auto is not None:
        fams += _autoscale_families(auto, counter, gauge)
    src = m.get("sources", {})
    if src:
        fams += [counter(f"source_{key}", doc, labels=("source",), rows={n: v[stat] for n, v in src.items()})
                 for key, stat, doc in (
                     ("files", "files", "Files a source has read whole"),
                     ("rows", "rows", "Rows a source has pushed"),
                     ("bad_files", "bad_files", "Files a source could not read or convert (raised, skipped or "
                      "quarantined)"),
                     ("quarantined_files", "quarantined", "Bad files a source moved to its quarantine directory"),
                     ("rewritten_files", "rewritten", "Files rewritten under a name a source had read"))]
    if "log_bytes" in m:
        fams += [gauge("log_bytes", "Bytes on disk of the input and output logs", labels=("log",),
                       rows=m["log_bytes"]),
                 gauge("output_steps", "First and end (last + 1) step of the output log", labels=("end",),
                       rows={"first": m["output_steps"][0], "last": m["output_steps"][1]}),
                 gauge("consumer_next_step", "First output step a registered consumer still needs",
                       labels=("consumer",), rows=m["consumers"])]
    if m.get("rss_bytes") is not None:
        fams.append(gauge("process_resident_bytes", "Resident memory of the pipeline's process", m["rss_bytes"]))
    if m.get("sink_lag_steps"):
        fams.append(gauge("sink_lag_steps", "Logged output steps a consumer (sink) has not applied yet",
                          labels=("consumer",), rows=m["sink_lag_steps"]))
    if "profile" in m:
        fams += prometheus_families(m["profile"])
    if "spill" in m:
        sp = m["spill"]
        fams += [gauge("spill_memory_bytes", "Bytes of trace batches in memory under the memory budget", sp["memory_bytes"]),
                 gauge("spill_disk_bytes", "Bytes of the batch files spilled traces live in", sp["disk_bytes"]),
                 gauge("spill_mapped_bytes", "Bytes of batch files and key indexes reads may have left mapped into "
                       "the process at the last enforce, under the memory budget", sp.get("mapped_bytes", 0)),
                 counter("spill_bytes_written_total", "Bytes of batch files written", sp["bytes_written"]),
                 counter("spill_evictions_total", "Times the cache evicted pages of a batch file", sp["evictions"]),
                 gauge("trace_memory_bytes", "Bytes of an operator's trace batches in memory", labels=("operator",),
                       rows={k: v["memory_bytes"] for k, v in sp["operators"].items()}),
                 gauge("trace_disk_bytes", "Bytes of an operator's trace batches in batch files", labels=("operator",),
                       rows={k: v["disk_bytes"] for k, v in sp["operators"].items()}),
                 gauge("trace_rows", "Rows of an operator's trace batches (memory and batch files)",
                       labels=("operator",), rows={k: v["rows"] for k, v in sp["operators"].items()}),
                 counter("trace_cache_hits_total", "Pages of an operator's spilled batches its reads used that the "
                         "cache held", labels=("operator",),
                         rows={k: v["cache_hits"] for k, v in sp["operators"].items()}),
                 counter("trace_cache_misses_total", "Pages of an operator's spilled batches its reads used that the "
                         "cache had evicted or never held", labels=("operator",),
                         rows={k: v["cache_misses"] for k, v in sp["operators"].items()}),
                 counter("spill_cache_hits_total", "Pages of spilled batches reads used that the cache held",
                         sp["cache_hits"]),
                 counter("spill_cache_misses_total", "Pages of spilled batches reads used that the cache had evicted "
                         "or never held", sp["cache_misses"]),
                 counter("spill_pages_checked_total", "Pages of lazily opened batch files checked as steps read them",
                         sp["pages_checked"]),
                 counter("spill_pages_prefetched_total", "Pages of spilled batches steps asked the kernel to read "
                         "before walking them (while the files did not fit the page cache)",
                         sp.get("pages_prefetched", 0))]
    if "state_bytes" in m:
        fams += [gauge("state_bytes", "Bytes of operator state per worker", labels=("worker",),
                       rows={w: v["total"] for w, v in m["state_bytes"].items()}),
                 gauge("key_index_bytes", "Bytes of the traces' key indexes per worker (beside the state)",
                       labels=("worker",), rows={w: v.get("key_index", 0) for w, v in m["state_bytes"].items()}),
                 gauge("state_shard_bytes", "Bytes of operator state per worker and shard",
                       labels=("worker", "shard"),
                       rows={(str(w), str(s)): b for w, v in m["state_bytes"].items()
                             for s, b in v["shards"].items()})]
    return fams


def _autoscale_families(a: dict, counter: Any, gauge: Any) -> list:
    """The autoscaler's families: its decisions by reason, rescales, the last decision and its numeric inputs."""
    last = a.get("last") or {}
    fams = [counter("autoscale_decisions", "Autoscaling decisions, per reason", labels=("reason",),
                    rows=a["decisions"]),
            counter("autoscale_rescales", "Rescales the autoscaler made", a["rescales"]),
            counter("autoscale_failed_rescales", "Rescales the autoscaler decided that failed", a["failed_rescales"]),
            gauge("autoscale_max_workers", "The most workers the policy may use here (its max, and the cores for "
                  "worker threads)", a["cap"])]
    if last:
        fams += [gauge("autoscale_target_workers", "Worker count the last decision chose", last["target"]),
                 gauge("autoscale_last_decision", "The last decision (value 1), by action and reason",
                       labels=("action", "reason"), rows={(last["action"], last["reason"]): 1}),
                 gauge("autoscale_input", "The numeric inputs of the last decision", labels=("input",),
                       rows={k: v for k, v in last["inputs"].items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool)})]
    return fams


class _Collector:
    """A prometheus_client collector that reads the pipeline on every scrape."""

    def __init__(self, p: Any) -> None:
        self.p = p

    def collect(self) -> Any:
        return iter(_families(gather(self.p)))


def prometheus_text(p: Any) -> str:
    """The Prometheus text exposition of ``p.metrics()``."""
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(p))
    return generate_latest(reg).decode("utf-8")


def serve(p: Any, port: int = 0, addr: str = "127.0.0.1") -> tuple[Any, int]:
    """Serve ``p``'s metrics at ``http://addr:port/metrics``, and its status page at ``/`` (``/status``; the page
    polls ``/status.json``: dbsp_core.status), from a daemon thread (port 0: any free port) until
    ``p`` is closed (invariant 4); returns the server (``.shutdown()`` stops it sooner) and the port."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import CollectorRegistry, make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(p))
    inner = make_wsgi_app(reg)

    def app(environ: dict, start_response: Any) -> Any:
        try:
            path = environ.get("PATH_INFO", "")
            if path in ("/", "/status", "/status.json"):  # the status page (dbsp_core.status) and its figures
                body, kind = (status_json(p), "application/json") if path.endswith(".json") else \
                    (status_page(), "text/html; charset=utf-8")
                start_response("200 OK", [("Content-Type", kind), ("Cache-Control", "no-store"),
                                          ("Content-Length", str(len(body)))])
                return [body]
            return inner(environ, start_response)  # the text is made before the status is sent
        except Exception as e:  # noqa: BLE001 - a scrape is answered, never with a traceback
            closed = getattr(p, "_closed", False) or getattr(p, "_broken", None) is not None
            status = "503 Service Unavailable" if closed else "500 Internal Server Error"
            start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
            return [f"dbsp: no metrics: {type(e).__name__}: {e}\n".encode()]

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - no line per scrape on stderr
            pass

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET

    server = make_server(addr, port, app, Server, handler_class=Quiet)
    threading.Thread(target=server.serve_forever, name="dbsp-metrics", daemon=True).start()
    _attached(p).servers.append(server)
    return server, server.server_address[1]


def stop_serving(p: Any) -> None:
    """Stop every metrics server of ``p`` and free its port (invariant 4; ``Pipeline.close`` calls it)."""
    a = _attached(p)
    servers, a.servers = a.servers, []
    for server in servers:
        server.shutdown()  # returns at once if it was stopped already
        server.server_close()
