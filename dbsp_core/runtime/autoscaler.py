"""The autoscaler: runs an ``Autoscale`` policy on one pipeline: keeps the step samples the driver reports, evaluates the policy (dbsp_core.runtime.autoscale.decide) after a step at most every ``interval_s``, logs every decision, and makes a decided rescale on a thread of its own while steps go on.

Invariants (enforced here):
  1. Reporting a step costs O(1) (one tuple appended; no per-row work); an evaluation runs at most every
     ``interval_s``, under the driver's step lock (the measurements and the layout are one moment's), and measures
     the state a move would take (per-shard bytes of every trace batch) only when the decision asks.
  2. At most one rescale in flight: the autoscaler starts one only when neither its own nor anyone's
     (``Pipeline.rescale_progress``) runs, and the policy holds while one does. A rescale is ``Pipeline.rescale``
     itself, so it is live and exactly once (dbsp_core.runtime.rescale invariants 4 and 6).
  3. Every decision is logged (logger ``dbsp_core.autoscale``: a rescale at INFO, a hold at DEBUG), counted by
     reason and, with the newest ones, the rescales made and their pauses, in the pipeline's metrics
     (``p.metrics()["autoscale"]``, the Prometheus text, and the ``METRICS`` record ``dbsp inspect`` reads).
  4. A failed rescale is recorded (its decision stays, with the error) and does not stop the autoscaler; the
     pipeline itself says whether it is still usable (driver invariant 8). A failed evaluation is logged and
     counted (reason ``error``) and never fails the step that ran it.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from typing import Any, Protocol

from dbsp_core.runtime.autoscale import Autoscale, Decision, Measurements, PolicyState, StepSample, decide

__all__ = ["Autoscaler", "Capacity"]

log = logging.getLogger("dbsp_core.autoscale")

_CORES = os.cpu_count() or 1


class Capacity(Protocol):
    """What follows the worker count outside the process (SparkPipeline: Spark executors under dynamic
    allocation). :meth:`follow` is called before a scale-up and after a scale-down and says what it did."""

    def follow(self, workers: int) -> str: ...


class Autoscaler:
    """One policy on one pipeline ``p`` (see the module docstring). ``capacity``: what else follows the size."""

    def __init__(self, p: Any, policy: Autoscale, capacity: Capacity | None = None) -> None:
        self.p = p
        self.capacity = capacity
        self._lock = threading.Lock()
        self.samples: collections.deque = collections.deque(maxlen=8192)
        self.arrivals: collections.deque = collections.deque(maxlen=8192)  # (t, rows pushed so far)
        self.decisions: collections.deque = collections.deque(maxlen=32)  # the newest decisions, every kind
        self.changes: collections.deque = collections.deque(maxlen=32)  # the newest rescale decisions + results
        self.counts: dict[str, int] = {}
        self.rescales = 0
        self.failed = 0
        self.executors: str | None = None  # what the capacity said last
        self._thread: threading.Thread | None = None
        self._running = False  # a decided rescale has not ended (set before its thread starts, cleared at its end)
        self._stopped = False
        self._last_eval = -math.inf
        self.state = PolicyState(since=time.monotonic())
        self.set_policy(policy)

    def set_policy(self, policy: Autoscale) -> None:
        kind = self.p.executor.kind
        with self._lock:
            self.policy = policy
            self.cap = min(policy.max_workers, _CORES) if kind == "embedded" else policy.max_workers
            self.cap = max(self.cap, policy.min_workers)  # min_workers above the cores: the user's bound wins
            self._last_eval = -math.inf  # evaluate the new policy after the next step
        self._publish()

    # ---- measurements (invariant 1) ----

    def stepped(self, seconds: float, rows: int, workers: int, busy: list[float] | None) -> None:
        """A step run ended (called by the driver under the step lock): record it, and evaluate when due."""
        now = time.monotonic()
        self.samples.append(StepSample(now, seconds, rows, workers, None if busy is None else sum(busy),
                                       None if busy is None else max(busy)))
        self.arrivals.append((now, self.p._metrics.rows_in_total()))
        if now - self._last_eval >= self.policy.interval_s:
            self._last_eval = now
            try:
                self.evaluate(now)
            except Exception as exc:  # noqa: BLE001 - invariant 4: the policy never fails a step
                self.counts["error"] = self.counts.get("error", 0) + 1
                log.warning("autoscale: the evaluation failed: %s: %s", type(exc).__name__, exc)

    def _arrival_rate(self, now: float) -> float | None:
        horizon = now - self.policy.window_s
        old = next(((t, n) for t, n in self.arrivals if t >= horizon), None)
        if old is None or not self.arrivals:
            return None
        t1, n1 = self.arrivals[-1]
        return (n1 - old[1]) / (t1 - old[0]) if t1 > old[0] else None

    def _move_bytes(self, workers: int) -> int | None:
        """Bytes of state a rescale to ``workers`` would move (the shards whose owner changes); None when the
        executor cannot say (its state is not readable here)."""
        try:
            return self._moved(workers)
        except Exception as exc:  # noqa: BLE001 - a decision without the figure, saying so
            log.debug("autoscale: the bytes a move to %d workers would take are unknown: %s", workers, exc)
            return None

    def _moved(self, workers: int) -> int:
        from dbsp_core.metrics import state_bytes

        lay = self.p.layout
        new = lay.rebalance(workers)
        moved = lay.moved_shards(new)  # at the finer of the two shard counts
        if not moved:
            return 0
        bits = max(lay.shard_bits, new.shard_bits)
        per: dict[int, int] = {}
        for w in range(lay.workers):
            for s, n in state_bytes(self.p.executor.traces(w), bits)[1].items():
                per[s] = per.get(s, 0) + n
        return int(sum(per.get(int(s), 0) for s in moved))

    # ---- decisions ----

    def in_flight(self) -> bool:
        return self._running or self.p.rescale_progress is not None

    def evaluate(self, now: float | None = None) -> Decision:
        """Evaluate the policy now (the driver's step lock held) and act on its decision."""
        now = time.monotonic() if now is None else now
        rows, nbytes, age = self.p._backlog(now)
        with self._lock:
            policy, state, cap = self.policy, self.state, self.cap
        m = Measurements(now=now, workers=self.p.layout.workers, cap=cap, steps=tuple(self.samples),
                         backlog_rows=rows, backlog_bytes=nbytes, backlog_age_s=age,
                         arrival_rows_s=self._arrival_rate(now), in_flight=self.in_flight(),
                         move_bytes=self._move_bytes)
        d, nxt = decide(policy, m, state)
        with self._lock:
            if self.state is state:  # a rescale that ended meanwhile restarted the measurements: keep that
                self.state = nxt
            self.counts[d.reason] = self.counts.get(d.reason, 0) + 1
            self.decisions.append(d.to_dict())
        if d.action == "rescale":
            log.info("autoscale: %d -> %d workers (%s): %s; inputs %s", d.workers, d.target, d.reason, d.why,
                     d.inputs)
            if not self._stopped:
                rec = {**d.to_dict(), "result": "started"}
                with self._lock:
                    self.changes.append(rec)
                self._running = True
                t = threading.Thread(target=self._rescale, args=(d, rec), name="dbsp-autoscale", daemon=True)
                t.start()  # started before it is published: stop() on another thread joins what it finds
                self._thread = t
        else:
            log.debug("autoscale: hold at %d workers (%s): %s", d.workers, d.reason, d.why)
        self._publish()
        return d

    def _rescale(self, d: Decision, rec: dict) -> None:
        """The thread of one decided rescale (invariants 2 and 4)."""
        try:
            if self.capacity is not None and self.policy.manage_executors and d.target > d.workers:
                self.executors = self.capacity.follow(d.target)  # executors first: the new tasks need them
            rep = self.p.rescale(d.target)
            if self.capacity is not None and self.policy.manage_executors and d.target < d.workers:
                self.executors = self.capacity.follow(d.target)
            rec.update(result="done", max_pause_ms=rep.get("max_pause_ms"), moved_bytes=rep.get("moved_bytes"),
                       seconds=rep.get("seconds"), executors=self.executors)
            self.rescales += 1
        except Exception as exc:  # noqa: BLE001 - invariant 4: recorded, the pipeline says if it is usable
            rec.update(result="failed", error=f"{type(exc).__name__}: {exc}")
            self.failed += 1
            log.warning("autoscale: the rescale %d -> %d failed: %s", d.workers, d.target, exc)
        finally:
            with self._lock:
                self.state = self.state.changed(time.monotonic())
                self._running = False
            self._publish()

    def stop(self) -> None:
        """No more rescales; wait for one in flight (call without the step lock)."""
        self._stopped = True
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()

    # ---- what the metrics show (invariant 3) ----

    def snapshot(self) -> dict:
        with self._lock:
            last = self.decisions[-1] if self.decisions else None
            return {"policy": self.policy.to_dict(), "cap": self.cap, "rescales": self.rescales,
                    "failed_rescales": self.failed, "decisions": dict(self.counts), "last": last,
                    "recent": list(self.decisions)[-8:], "changes": list(self.changes), "executors": self.executors,
                    "in_flight": self._running}

    def _publish(self) -> None:
        self.p._metrics.autoscaled(self.snapshot())
