"""The autoscaling policy: ``Autoscale`` (a user's bounds and targets) and :func:`decide`, a pure function from what a pipeline measured (its recent steps, its backlog, the bytes a rescale to a size would move) to one decision: keep the worker count, or rescale to the size the measured per-worker rates say meets the targets.

The model (DS2-style: sizes come from measured rates, not from trial and error). Each step sample holds the step's
wall time, its input rows, and (where the executor measures it) the busy seconds of its workers: the time they spent
in operators, not waiting at an exchange. The work of a step is its busy worker-seconds; its critical path is the
busiest worker's busy time; the rest of the step (dividing, logging, the exchange barriers) is serial. At W' workers
a step is predicted to take ``serial + critical * W / W'``; per-worker utilization is ``work / (W' * elapsed)``; and
the rows one busy worker handles per second (``rows / work``) say how many workers keep up with the arrival rate
and drain the backlog within ``max_backlog_s``. Without busy times (a staged executor's tasks run elsewhere) the
whole step counts as parallel work, which the decision's inputs say (``model: "step time"``).

Invariants (enforced here; tests/core/test_autoscale_policy.py checks them on synthetic traces):
  1. :func:`decide` reads only its arguments (no clock, no pipeline, no randomness): the same measurements and
     state give the same decision and the same next state.
  2. A size outside ``[min_workers, cap]`` (``cap``: ``max_workers``, and for worker threads also the cores) is
     brought inside at once (reason ``bounds``); no other decision leaves the bounds.
  3. No decision but ``hold`` while a rescale is in flight, or before ``min_steps`` steps were measured at the
     current size since the last rescale (after ``min_steps`` more of warm-up, which drain what piled up during
     the move); the window holds at least the last ``min_steps`` steps however long they took.
  4. Scale up: when a target is missed (step latency p99 over ``max_step_ms``, utilization above the band, the
     oldest unstepped push older than ``max_backlog_s``) and a larger size is predicted to meet every target with
     ``headroom``, the decision is the smallest such size, in one decision (not +1). When no size up to ``cap``
     meets it, the decision is ``cap`` only if that is predicted to cut the missed measure by at least 10%.
  5. Scale down: only while every target is met, after ``scale_down_window_s`` at the current size, to the largest
     size any evaluation of that window required (the size that meets the window's peak with headroom: one the
     measured load would push back up is never chosen), and not when it would move more than ``max_move_bytes``.
     While the requirement of the window's newer half is below its peak (the load is still falling) it waits, up
     to a second window, so that a falling load is followed by one scale-down rather than several.
  6. Every decision carries its inputs (the window's summary, the size each target requires, the bytes the move
     would take), its choice and its reason.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable, NamedTuple

__all__ = ["Autoscale", "Decision", "Measurements", "PolicyState", "StepSample", "decide", "summarize"]


def _num(name: str, v: object, low: float, *, strict: bool = True, none: bool = True) -> None:
    if v is None and none:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v) or \
            (v <= low if strict else v < low):
        raise ValueError(f"Autoscale: {name} must be a number {'>' if strict else '>='} {low}"
                         f"{' or None' if none else ''}, got {v!r}")


def _int(name: str, v: object, low: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"Autoscale: {name} must be an int >= {low}, got {v!r}")


@dataclass(frozen=True)
class Autoscale:
    """An autoscaling policy: the worker counts a pipeline may use and the targets it keeps.

    Give it to ``Pipeline(..., autoscale=)``, ``Pipeline.open(..., autoscale=)``, ``SparkPipeline(..., autoscale=)``
    or ``p.autoscale(policy)`` on a running pipeline (``p.autoscale(None)`` stops it). After each step the
    pipeline evaluates it (at most every ``interval_s``) on what it measured and rescales live when it decides so
    (one rescale at a time; steps go on meanwhile). Decisions are in ``p.metrics()["autoscale"]``, the Prometheus
    text (``dbsp_autoscale_*``) and ``dbsp inspect``.

    Parameters
    ----------
    min_workers, max_workers : int
        The bounds of the worker count. Worker threads (the embedded executor) stop at the machine's cores too.
    max_step_ms : float or None
        Target: the p99 step latency over the window stays below this many milliseconds.
    max_backlog_s : float or None
        Target: no pushed row waits longer than this for its step (seconds).
    utilization : (float, float) or None
        Target band of per-worker utilization (busy time / wall time): above ``hi`` scales up, below ``lo`` lets
        the other targets scale down, and a new size aims at the middle of the band.
    scale_down_window_s : float
        A scale-down waits this long at a size, and goes only to the largest size any evaluation of that window
        required (default 600 s: lazy, against oscillation).
    window_s : float
        Measurements (latency mean and p99, utilization, rates) are over the steps of this many last seconds.
    interval_s : float
        Evaluate at most this often (seconds; 0: after every step).
    min_steps : int
        After a rescale, the first ``min_steps`` steps at the new size are not measured (they drain what piled up
        during the move), and ``min_steps`` more are measured before the next decision.
    headroom : float
        A new size aims at this fraction of each bound (0 < headroom <= 1), so that it does not sit at the edge.
    max_move_bytes : int or None
        A scale-down that would move more state than this is not made.
    manage_executors : bool
        SparkPipeline with Spark dynamic allocation: ask for and release Spark executors to follow the worker
        count (it says in the decisions when the cluster manager cannot).

    Examples
    --------
    >>> import dbsp_core as dbsp
    >>> a = dbsp.Autoscale(1, 4, max_step_ms=50, utilization=(0.3, 0.8))
    >>> a.min_workers, a.max_workers, a.max_step_ms
    (1, 4, 50)
    >>> dbsp.Autoscale(3, 2, max_step_ms=50)
    Traceback (most recent call last):
    ...
    ValueError: Autoscale: max_workers (2) must be >= min_workers (3)
    """

    min_workers: int
    max_workers: int
    max_step_ms: float | None = None
    max_backlog_s: float | None = None
    utilization: tuple[float, float] | None = None
    scale_down_window_s: float = 600.0
    window_s: float = 10.0
    interval_s: float = 1.0
    min_steps: int = 5
    headroom: float = 0.8
    max_move_bytes: int | None = None
    manage_executors: bool = True

    def __post_init__(self) -> None:
        _int("min_workers", self.min_workers, 1)
        _int("max_workers", self.max_workers, 1)
        if self.max_workers < self.min_workers:
            raise ValueError(f"Autoscale: max_workers ({self.max_workers}) must be >= min_workers "
                             f"({self.min_workers})")
        _num("max_step_ms", self.max_step_ms, 0)
        _num("max_backlog_s", self.max_backlog_s, 0)
        if self.utilization is not None:
            u = self.utilization
            if not isinstance(u, (tuple, list)) or len(u) != 2:
                raise ValueError(f"Autoscale: utilization must be a (lo, hi) pair or None, got {u!r}")
            _num("utilization lo", u[0], 0, none=False)
            _num("utilization hi", u[1], 0, none=False)
            if not u[0] < u[1] <= 1:
                raise ValueError(f"Autoscale: utilization (lo, hi) needs 0 < lo < hi <= 1, got {tuple(u)!r}")
            object.__setattr__(self, "utilization", (float(u[0]), float(u[1])))
        if self.max_step_ms is None and self.max_backlog_s is None and self.utilization is None:
            raise ValueError("Autoscale: no target given; give max_step_ms=, max_backlog_s= or utilization=(lo, hi) "
                             "(without one the policy would never change the size)")
        _num("scale_down_window_s", self.scale_down_window_s, 0, strict=False, none=False)
        _num("window_s", self.window_s, 0, none=False)
        _num("interval_s", self.interval_s, 0, strict=False, none=False)
        _int("min_steps", self.min_steps, 1)
        _num("headroom", self.headroom, 0, none=False)
        if self.headroom > 1:
            raise ValueError(f"Autoscale: headroom must be in (0, 1], got {self.headroom!r}")
        if self.max_move_bytes is not None:
            _int("max_move_bytes", self.max_move_bytes, 0)
        if not isinstance(self.manage_executors, bool):
            raise ValueError(f"Autoscale: manage_executors must be a bool, got {self.manage_executors!r}")

    def to_dict(self) -> dict:
        """The policy as plain data (JSON-able)."""
        d = asdict(self)
        if d["utilization"] is not None:
            d["utilization"] = list(d["utilization"])
        return d


class StepSample(NamedTuple):
    """One step as the policy sees it: when it ended (monotonic seconds), its wall time, its input rows, the workers
    it ran on, and the busy worker-seconds of all its workers and of the busiest (None: not measured)."""

    t: float
    seconds: float
    rows: int
    workers: int
    busy: float | None = None
    busy_max: float | None = None


@dataclass(frozen=True)
class Measurements:
    """What :func:`decide` decides from, at time ``now`` (monotonic seconds)."""

    now: float
    workers: int
    cap: int  # the most workers this executor may use (max_workers, and the cores for worker threads)
    steps: tuple[StepSample, ...]  # recent steps, oldest first (those before the last rescale are ignored)
    backlog_rows: int = 0
    backlog_bytes: int = 0
    backlog_age_s: float = 0.0
    arrival_rows_s: float | None = None  # rows pushed per second over the window (None: unknown)
    in_flight: bool = False  # a rescale is running
    # bytes a rescale to W' would move (None from it: unknown)
    move_bytes: Callable[[int], int | None] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class PolicyState:
    """What :func:`decide` carries from one evaluation to the next: when the size last changed, and the size each
    evaluation since then required (``(t, size)``, for the scale-down window)."""

    since: float = -math.inf
    required: tuple[tuple[float, int], ...] = ()
    warmup: bool = False  # the first steps since ``since`` drain what piled up during a move: not measured

    def changed(self, t: float) -> "PolicyState":
        """The state after a rescale that ended at ``t``: measurements restart, after a warm-up."""
        return PolicyState(t, (), True)


@dataclass(frozen=True)
class Decision:
    """One evaluation: ``action`` is ``"hold"`` or ``"rescale"``, from ``workers`` to ``target``, with a short
    ``reason`` code, a sentence ``why`` and the ``inputs`` it used."""

    t: float
    action: str
    workers: int
    target: int
    reason: str
    why: str
    inputs: dict

    def to_dict(self) -> dict:
        return {"t": self.t, "action": self.action, "workers": self.workers, "target": self.target,
                "reason": self.reason, "why": self.why, "inputs": self.inputs}


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


class _Window:
    """The steps of the window at the current size, and what the model predicts from them."""

    def __init__(self, m: Measurements, policy: Autoscale, since: float, warmup: bool = False) -> None:
        at = [s for s in m.steps if s.t > since and s.workers == m.workers]
        if warmup:
            at = at[policy.min_steps:]  # warm-up: the first steps at a new size drain what piled up during the move
        start = max(m.now - policy.window_s, since)
        self.steps = [s for s in at if s.t > start]
        if len(self.steps) < policy.min_steps:  # long steps: the window holds at least min_steps of them
            self.steps = at[-policy.min_steps:]
            start = min([start] + [s.t - s.seconds for s in self.steps])
        self.workers = m.workers
        first = min((s.t - s.seconds for s in self.steps), default=m.now)
        self.elapsed = max(m.now - max(start, first), 1e-9)
        self.measured = bool(self.steps) and all(s.busy is not None for s in self.steps)
        W = m.workers
        if self.measured:
            # the serial part of a step: the median over the window of its time outside the busiest worker's
            # busy time (one step's is noisy); the rest of each step is its critical path
            outside = sorted(max(0.0, s.seconds - float(s.busy_max)) for s in self.steps)  # type: ignore[arg-type]
            self.serial_s = outside[len(outside) // 2]
            self.work = sum(float(s.busy) for s in self.steps)  # type: ignore[arg-type]
        else:  # the whole step is parallel work (staged executor: its tasks run elsewhere)
            self.serial_s = 0.0
            self.work = sum(s.seconds for s in self.steps) * W
        self.crit = [max(0.0, s.seconds - self.serial_s) for s in self.steps]
        self.rows = sum(s.rows for s in self.steps)
        lat = [s.seconds for s in self.steps]
        self.mean = sum(lat) / len(lat) if lat else None
        self.p99 = _pct(lat, 99) if lat else None
        self.util = self.work / (W * self.elapsed)
        self.rate = self.rows / self.work if self.work > 0 and self.rows else None  # rows per busy worker-second
        # saturated: steps ran back to back (they were late), so a step's rows grew with its own duration
        # (only with busy times: without them the serial part is unknown, and the unsaturated model is the
        # conservative one)
        self.saturated = self.measured and len(lat) > 1 and sum(lat) >= 0.9 * self.elapsed
        self.cadence = _cadence(m.steps)
        self.arrival = max(m.arrival_rows_s or 0.0, self.rows / self.elapsed)
        self.per_row = sum(self.crit) / self.rows if self.rows else 0.0  # critical-path seconds per row at W

    def p99_at(self, w: int) -> float:
        """The predicted p99 step latency at ``w`` workers. Unsaturated, a step keeps its rows (the caller's cadence
        sets them) and its critical path divides by ``w / W``. Saturated, a step's rows are what arrives while
        the previous one runs (at least one cadence): ``d = serial + a * max(cadence, d)`` with ``a`` the
        critical seconds the arrival of one second costs at ``w``, so ``d = serial / (1 - a)`` when that exceeds
        the cadence (infinite when ``a >= 1``: ``w`` cannot keep up)."""
        k = self.workers / w
        S = self.serial_s
        if not self.saturated:
            return _pct([S + c * k for c in self.crit], 99)
        a = self.per_row * k * self.arrival
        T = self.cadence or 0.0
        d = S + a * T
        if d >= T:
            d = S / (1 - a) if a < 1 else math.inf
        return d

    def util_at(self, w: int) -> float:
        return self.work / (w * self.elapsed)


def _cadence(steps: tuple[StepSample, ...]) -> float | None:
    """How often the caller steps when the steps keep up: the median interval between two step starts where the
    pipeline was idle in between (None: never seen idle)."""
    gaps = []
    for a, b in zip(steps, steps[1:]):
        idle = (b.t - b.seconds) - a.t
        if idle > max(0.001, 0.2 * a.seconds):
            gaps.append(b.t - b.seconds - (a.t - a.seconds))
    return sorted(gaps)[len(gaps) // 2] if gaps else None


def summarize(m: Measurements, policy: Autoscale, since: float = -math.inf) -> dict:
    """The window's summary as a decision shows it."""
    win = _Window(m, policy, since)
    return _inputs(win, m)


def _inputs(win: _Window, m: Measurements) -> dict:
    r = (lambda x, n=6: None if x is None else round(x, n))
    return {"steps": len(win.steps), "elapsed_s": r(win.elapsed, 3), "model": "busy time" if win.measured else
            "step time", "step_ms_mean": r(win.mean and win.mean * 1000, 3),
            "step_ms_p99": r(win.p99 and win.p99 * 1000, 3), "utilization": r(win.util, 4),
            "saturated": win.saturated, "cadence_s": r(win.cadence, 4), "serial_ms": r(win.serial_s * 1000, 3),
            "rows": win.rows, "rows_per_worker_s": r(win.rate, 1), "arrival_rows_s": r(m.arrival_rows_s, 1),
            "backlog_rows": m.backlog_rows, "backlog_bytes": m.backlog_bytes,
            "backlog_age_s": round(m.backlog_age_s, 4), "cap": m.cap}


def _required(win: _Window, m: Measurements, p: Autoscale, lo: int) -> tuple[dict, dict, dict]:
    """Per target: the smallest size in ``[lo, cap]`` predicted to meet it with headroom (``cap + 1``: none does),
    whether it is missed now, and the measure it concerns (now, and predicted at ``cap``)."""
    req: dict[str, int] = {}
    missed: dict[str, bool] = {}
    gain: dict[str, tuple[float, float]] = {}
    sizes = range(lo, m.cap + 1)
    if p.max_step_ms is not None and win.steps:
        bound = p.max_step_ms / 1000
        req["latency"] = next((w for w in sizes if win.p99_at(w) <= p.headroom * bound), m.cap + 1)
        missed["latency"] = win.p99 is not None and win.p99 > bound
        gain["latency"] = (win.p99 or 0.0, win.p99_at(m.cap))
    if p.utilization is not None and win.steps:
        ulo, uhi = p.utilization
        mid = (ulo + uhi) / 2
        if ulo <= win.util <= uhi:
            req["utilization"] = m.workers
        else:
            req["utilization"] = next((w for w in sizes if win.util_at(w) <= mid), m.cap + 1)
        missed["utilization"] = win.util > uhi
        gain["utilization"] = (win.util, win.util_at(m.cap))
    if p.max_backlog_s is not None:
        missed["backlog"] = m.backlog_age_s > p.max_backlog_s
        if win.rate is not None:
            need = (m.arrival_rows_s or 0.0) + m.backlog_rows / p.max_backlog_s  # keep up, and drain in time
            req["backlog"] = next((w for w in sizes if w * win.rate * p.headroom >= need), m.cap + 1)
            gain["backlog"] = (need / (m.workers * win.rate), need / (m.cap * win.rate))
        elif missed["backlog"]:
            req["backlog"] = m.cap + 1  # rows wait and no step measured a rate: nothing says a size
    return req, missed, gain


def decide(policy: Autoscale, m: Measurements, state: PolicyState) -> tuple[Decision, PolicyState]:
    """The decision for measurements ``m`` and the state to pass to the next call (module invariants 1-6).

    >>> a = Autoscale(1, 8, max_step_ms=100, min_steps=2)
    >>> steps = tuple(StepSample(t=i * 0.5, seconds=0.4, rows=4000, workers=1, busy=0.39, busy_max=0.39)
    ...               for i in range(1, 20))
    >>> d, _ = decide(a, Measurements(now=10.0, workers=1, cap=8, steps=steps), PolicyState())
    >>> d.action, d.target, d.reason
    ('rescale', 6, 'scale_up')
    """
    W, cap, p = m.workers, m.cap, policy
    win = _Window(m, p, state.since, state.warmup)
    inputs = _inputs(win, m)

    def out(action: str, target: int, reason: str, why: str, st: PolicyState = state) -> tuple[Decision, PolicyState]:
        return Decision(m.now, action, W, target, reason, why, inputs), st

    if m.in_flight:
        return out("hold", W, "in_flight", "a rescale is in flight; the next decision comes after it")
    lo = p.min_workers
    if not lo <= W <= cap:
        t = min(max(W, lo), cap)
        return out("rescale", t, "bounds", f"{W} workers is outside the bounds [{lo}, {cap}]")
    if len(win.steps) < p.min_steps:
        return out("hold", W, "measuring", f"{len(win.steps)} of {p.min_steps} steps measured at {W} workers")
    req, missed, gain = _required(win, m, p, lo)
    inputs["required"] = dict(req)
    need = min(max([lo] + list(req.values())), cap + 1)
    misses = sorted(k for k, v in missed.items() if v)
    if misses:
        what = ", ".join(misses)
        if need <= W:
            return out("hold", W, "no_gain", f"{what} missed, but the measured rates say more workers would not "
                                             f"meet it (required {req})")
        if W == cap:
            return out("hold", W, "at_cap", f"{what} missed at the most workers allowed ({cap})")
        if need <= cap:
            inputs["predicted_p99_ms"] = round(win.p99_at(need) * 1000, 3) if win.steps else None
            inputs["move_bytes"] = m.move_bytes(need) if m.move_bytes is not None else None
            return out("rescale", need, "scale_up", f"{what} missed; {need} workers are predicted to meet every "
                                                    f"target (required {req})")
        better = [k for k in misses if k in gain and gain[k][1] <= 0.9 * gain[k][0]]
        if better:
            inputs["move_bytes"] = m.move_bytes(cap) if m.move_bytes is not None else None
            return out("rescale", cap, "scale_up_cap", f"{what} missed; no size up to {cap} is predicted to meet "
                                                       f"it, {cap} workers cut {', '.join(better)} by >= 10%")
        return out("hold", W, "no_gain", f"{what} missed; no size up to {cap} is predicted to meet it or cut it by "
                                         f"10% (required {req})")
    # every target met: the scale-down window
    horizon = m.now - p.scale_down_window_s
    kept = tuple((t, r) for t, r in state.required if t >= horizon) + ((m.now, min(need, cap)),)
    st = PolicyState(state.since, kept, state.warmup)
    peak = max(r for _, r in kept)
    inputs["window_required"] = peak
    if peak >= W:
        return out("hold", W, "ok", f"targets met; the window requires {peak} workers", st)
    if m.now - state.since < p.scale_down_window_s:
        return out("hold", W, "stabilizing", f"targets met, {peak} workers would do; a scale-down waits "
                                             f"{p.scale_down_window_s:g} s at a size "
                                             f"({m.now - state.since:.1f} s so far)", st)
    recent = max(r for t, r in kept if t >= m.now - p.scale_down_window_s / 2)
    if recent < peak and m.now - state.since < 2 * p.scale_down_window_s:
        return out("hold", W, "falling", f"targets met; the size required fell during the window ({peak} -> "
                                         f"{recent}): the scale-down waits for the peak to leave the window (one "
                                         f"rescale, not two)", st)
    moved = m.move_bytes(peak) if m.move_bytes is not None else None
    inputs["move_bytes"] = moved
    if p.max_move_bytes is not None and moved is not None and moved > p.max_move_bytes:
        return out("hold", W, "move_too_large", f"a scale-down to {peak} would move {moved} bytes, more than "
                                                f"max_move_bytes={p.max_move_bytes}", st)
    return out("rescale", peak, "scale_down", f"targets met for {p.scale_down_window_s:g} s; the largest size the "
                                              f"window required is {peak}", st)
