"""The autoscaling policy (dbsp_core.runtime.autoscale.decide) on synthetic traces: a simulated pipeline whose step takes ``serial + rows / (rate * W)`` seconds (with seeded noise) under steady, ramping, spiking and sawtooth input, closed through the decisions; and its single rules (bounds, in flight, no gain, move limit, validation).

``DBSP_AUTOSCALE_SEED`` replays the noise of a run (the seed is printed).
"""

from __future__ import annotations

import math
import os
import random

import pytest

import dbsp_core as dbsp
from dbsp_core.runtime.autoscale import Autoscale, Measurements, PolicyState, StepSample, decide

SEED = int(os.environ.get("DBSP_AUTOSCALE_SEED", str(random.SystemRandom().randrange(2**31))))


class Sim:
    """A pipeline stepped every ``tick`` seconds (or as soon as the last step ends, when late): each step takes the
    rows pushed since the last one; a rescale takes ``move_s`` seconds, during which steps go on at the old size."""

    def __init__(self, policy: Autoscale, workers: int, cap: int = 8, rate: float = 10_000.0, serial: float = 0.002,
                 tick: float = 0.1, move_s: float = 0.5, noise: float = 0.1, seed: int = SEED) -> None:
        self.policy, self.W, self.cap, self.rate, self.serial, self.tick = policy, workers, cap, rate, serial, tick
        self.move_s, self.noise, self.rng = move_s, noise, random.Random(seed)
        self.t = 0.0
        self.samples: list[StepSample] = []
        self.state = PolicyState(since=0.0)
        self.changes: list[tuple[float, int, int, str]] = []  # (t, from, to, reason)
        self.pending: tuple[float, int] | None = None  # (ends at, target) of the rescale in flight
        self.last_eval = -math.inf
        self.backlog = 0.0
        self.backlog_since: float | None = None
        self.sizes: list[tuple[float, int]] = []
        self.latencies: list[tuple[float, float]] = []
        self.arrived = 0.0
        self.arrivals: list[tuple[float, float]] = [(0.0, 0.0)]

    def run(self, until: float, load) -> "Sim":
        """Run to time ``until`` with ``load(t)`` rows per second arriving."""
        while self.t < until:
            start = self.t
            rows = int(self.backlog)
            self.backlog -= rows
            busy = rows / self.rate * (1 + self.rng.uniform(-self.noise, self.noise))  # the work varies
            d = self.serial + busy / self.W
            self.t += d
            self.samples.append(StepSample(self.t, d, rows, self.W, busy, busy / self.W))
            self.latencies.append((self.t, d))
            nxt = max(self.t, start + self.tick)
            self.backlog += load(start) * (nxt - start)
            self.arrived += load(start) * (nxt - start)
            self.arrivals.append((nxt, self.arrived))
            self.backlog_since = start if self.backlog >= 1 else None
            self.t = nxt
            if self.pending is not None and self.t >= self.pending[0]:
                self.W = self.pending[1]
                self.pending = None
                self.state = self.state.changed(self.t)
            self.sizes.append((self.t, self.W))
            if self.t - self.last_eval >= self.policy.interval_s:
                self.last_eval = self.t
                t0, n0 = next((t, n) for t, n in self.arrivals if t >= self.t - self.policy.window_s)
                self.evaluate((self.arrived - n0) / (self.t - t0) if self.t > t0 else None)
        return self

    def evaluate(self, arrival: float):
        m = Measurements(now=self.t, workers=self.W, cap=self.cap, steps=tuple(self.samples[-800:]),
                         backlog_rows=int(self.backlog), backlog_bytes=int(self.backlog) * 40,
                         backlog_age_s=0.0 if self.backlog_since is None else self.t - self.backlog_since,
                         arrival_rows_s=arrival, in_flight=self.pending is not None,
                         move_bytes=lambda w: 1000 * abs(w - self.W))
        d, self.state = decide(self.policy, m, self.state)
        if d.action == "rescale":
            self.changes.append((self.t, d.workers, d.target, d.reason))
            self.pending = (self.t + self.move_s, d.target)
        return d

    def met(self, bound_s: float, since: float = 0.0) -> float:
        lat = [s for t, s in self.latencies if t >= since]
        return sum(s <= bound_s for s in lat) / len(lat)


def policy(**kw) -> Autoscale:
    base = dict(min_workers=1, max_workers=8, max_step_ms=50, scale_down_window_s=60, window_s=5, interval_s=1,
                min_steps=5)
    base.update(kw)
    return Autoscale(**base)


def needed(rows_s: float, sim: Sim, bound_ms: float = 50) -> int:
    """The smallest size whose step (tick's rows) meets ``headroom * bound``: what a good decision picks."""
    rows = rows_s * sim.tick
    return next(w for w in range(1, 100) if sim.serial + 1.1 * rows / (sim.rate * w) <= 0.8 * bound_ms / 1000)


def test_seed_is_printed() -> None:
    print(f"\n[autoscale policy] seed {SEED} (replay: DBSP_AUTOSCALE_SEED={SEED})")


def test_steady_load_sizes_once_and_stays() -> None:
    sim = Sim(policy(), workers=1).run(600, lambda t: 12_000)  # 1 worker: ~120 ms steps, 3x the bound
    assert len(sim.changes) == 1, sim.changes
    t, a, b, why = sim.changes[0]
    assert (a, why) == (1, "scale_up") and t < 10
    assert b >= 3 and b <= needed(12_000, sim) + 1
    assert sim.met(0.050, since=20) >= 0.95


def test_a_step_to_8x_is_met_in_one_decision() -> None:
    """DS2: the size comes from the measured rates in one decision, not +1 at a time."""
    sim = Sim(policy(), workers=1).run(60, lambda t: 2_000)
    assert sim.changes == []
    sim.run(120, lambda t: 16_000)
    # to the size the rates predict meets the target, or to the cap when the noise says none quite does (seeds 78
    # and 85: the cap, 8): either way one decision
    ups = [c for c in sim.changes if c[3] in ("scale_up", "scale_up_cap")]
    assert len(ups) == 1, sim.changes
    assert ups[0][2] >= needed(16_000, sim) - 1 and ups[0][0] < 60 + 10
    assert sim.met(0.050, since=75) >= 0.95


def test_ramp_scales_up_in_few_decisions_and_never_down() -> None:
    sim = Sim(policy(), workers=1).run(300, lambda t: 2_000 + 14_000 * t / 300)
    sizes = [b for _, _, b, _ in sim.changes]
    assert sizes == sorted(sizes) and all(r in ("scale_up", "scale_up_cap") for *_, r in sim.changes), sim.changes
    assert 1 <= len(sim.changes) <= 4, sim.changes
    assert sim.W >= needed(16_000, sim) - 1


def test_spike_scales_up_fast_and_down_once_after_the_window() -> None:
    load = (lambda t: 16_000 if 30 <= t < 50 else 2_000)
    sim = Sim(policy(), workers=1).run(300, load)
    # The first decision after the spike may see a step that carried the backlog of the steps before it (at 1 worker
    # each step takes the rows that arrived during the last, so they grow): no size is then predicted to meet the
    # bound, and it goes to the cap (scale_up_cap) as fast. About 1 seed in 80 (DBSP_AUTOSCALE_SEED=1774877419).
    assert [c[3] for c in sim.changes] in (["scale_up", "scale_down"], ["scale_up_cap", "scale_down"]), sim.changes
    up, down = sim.changes
    assert 30 < up[0] < 38 and up[2] >= needed(16_000, sim) - 1
    assert down[0] >= 50 + 60 - 5 and down[2] == 1, down  # lazily: after the window, to what the low load needs


@pytest.mark.parametrize("period_factor", [1.0, 0.5, 2.0])
def test_sawtooth_at_the_window_period_does_not_flap(period_factor: float) -> None:
    p = policy()
    period = p.scale_down_window_s * period_factor
    load = (lambda t: 16_000 if (t % period) < period / 2 else 2_000)
    sim = Sim(p, workers=1).run(period * 8 + 10, load)
    # one scale-up; a period longer than the window may scale down once per low half, never more per period
    downs = [c for c in sim.changes if c[3] == "scale_down"]
    ups = [c for c in sim.changes if c[3].startswith("scale_up")]
    if period_factor <= 1.0:
        assert len(sim.changes) == 1 and ups, sim.changes
    else:
        assert len(downs) <= 8 and len(ups) <= 9, sim.changes
        for a, b in zip(sim.changes, sim.changes[1:]):
            assert b[0] - a[0] >= 5, f"two rescales {b[0] - a[0]:.1f} s apart: {sim.changes}"


def test_scale_down_never_to_a_size_the_window_pushes_back_up() -> None:
    """After a scale-down no scale-up follows while the load stays within what the window saw."""
    load = (lambda t: 16_000 if t < 30 else (6_000 if int(t) % 20 < 10 else 3_000))
    sim = Sim(policy(), workers=1).run(400, load)
    reasons = [c[3] for c in sim.changes]
    assert reasons[0] == "scale_up" and "scale_down" in reasons, sim.changes
    after = reasons[reasons.index("scale_down"):]
    assert "scale_up" not in after, sim.changes


def test_utilization_band() -> None:
    p = policy(max_step_ms=None, utilization=(0.3, 0.7))
    sim = Sim(p, workers=1, serial=0.0).run(120, lambda t: 9_000)  # 1 worker busy 90% of the time
    assert sim.changes and sim.changes[0][3] == "scale_up" and sim.changes[0][2] == 2, sim.changes
    assert len(sim.changes) == 1


def test_backlog_age_target() -> None:
    """Steps that cannot keep up (a fixed small tick, rows pile up): the backlog target sizes for arrival + drain."""
    p = policy(max_step_ms=None, max_backlog_s=2.0)
    sim = Sim(p, workers=1, tick=0.0, serial=0.05).run(120, lambda t: 30_000)
    assert sim.changes and sim.changes[0][3].startswith("scale_up"), sim.changes
    assert sim.W >= 4  # 30k rows/s at 10k rows per busy worker-second, headroom 0.8


def _m(W: int = 2, cap: int = 4, n: int = 10, seconds: float = 0.01, **kw) -> Measurements:
    steps = tuple(StepSample(1.0 + i * 0.1, seconds, 100, W, seconds * W * 0.9, seconds * 0.9) for i in range(n))
    return Measurements(now=2.0, workers=W, cap=cap, steps=steps, **kw)


def test_bounds_come_first_then_in_flight_then_measuring() -> None:
    p = policy(min_workers=2, max_workers=3)
    d, _ = decide(p, _m(W=4, cap=3), PolicyState())
    assert (d.action, d.target, d.reason) == ("rescale", 3, "bounds")
    d, _ = decide(p, _m(W=1, cap=3), PolicyState())
    assert (d.action, d.target, d.reason) == ("rescale", 2, "bounds")
    d, _ = decide(p, _m(W=4, cap=3, in_flight=True), PolicyState())
    assert (d.action, d.reason) == ("hold", "in_flight")
    d, _ = decide(p, _m(W=2, cap=3, n=3), PolicyState())
    assert (d.action, d.reason) == ("hold", "measuring")


def test_more_workers_that_would_not_help_are_not_asked_for() -> None:
    """A step dominated by its serial part (busy time tiny): the latency target is missed but no size meets it."""
    steps = tuple(StepSample(1.0 + i * 0.1, 0.2, 100, 1, 0.001, 0.001) for i in range(10))
    d, _ = decide(policy(), Measurements(now=2.0, workers=1, cap=8, steps=steps), PolicyState())
    assert (d.action, d.reason) == ("hold", "no_gain"), d


def test_a_scale_down_that_moves_too_much_is_not_made() -> None:
    p = policy(max_move_bytes=10, scale_down_window_s=0)
    d, _ = decide(p, _m(W=4, move_bytes=lambda w: 1000), PolicyState(since=0.0))
    assert (d.action, d.reason) == ("hold", "move_too_large") and d.inputs["move_bytes"] == 1000
    d, _ = decide(policy(scale_down_window_s=0), _m(W=4, move_bytes=lambda w: 1000), PolicyState(since=0.0))
    assert (d.action, d.reason, d.target) == ("rescale", "scale_down", 1)


def test_decide_is_pure() -> None:
    m = _m(W=1, seconds=0.3)
    a = decide(policy(), m, PolicyState())
    b = decide(policy(), m, PolicyState())
    assert a == b and a[0].action == "rescale" and a[0].inputs["step_ms_p99"] == 300.0


@pytest.mark.parametrize("kw, msg", [
    (dict(min_workers=0, max_workers=2, max_step_ms=1), "min_workers must be an int >= 1"),
    (dict(min_workers=3, max_workers=2, max_step_ms=1), "max_workers (2) must be >= min_workers (3)"),
    (dict(min_workers=1, max_workers=2), "no target given"),
    (dict(min_workers=1, max_workers=2, max_step_ms=-1), "max_step_ms must be a number > 0"),
    (dict(min_workers=1, max_workers=2, utilization=(0.8, 0.2)), "0 < lo < hi <= 1"),
    (dict(min_workers=1, max_workers=2, utilization=0.5), "a (lo, hi) pair"),
    (dict(min_workers=1, max_workers=2, max_step_ms=1, headroom=1.5), "headroom must be in (0, 1]"),
    (dict(min_workers=1.5, max_workers=2, max_step_ms=1), "min_workers must be an int"),
    (dict(min_workers=1, max_workers=2, max_backlog_s=float("nan")), "max_backlog_s must be a number"),
])
def test_bad_arguments_are_refused(kw, msg) -> None:
    with pytest.raises(ValueError, match=None) as e:
        Autoscale(**kw)
    assert msg in str(e.value)


def test_the_pipeline_refuses_what_is_not_a_policy() -> None:
    import pyarrow as pa

    c = dbsp.Circuit()
    c.output("o", c.input("t", pa.schema([("k", pa.int64())])))
    with pytest.raises(TypeError, match="autoscale must be a dbsp_core.Autoscale"):
        dbsp.Pipeline(c, autoscale={"min_workers": 1})
    p = dbsp.Pipeline(c)
    with pytest.raises(TypeError, match="expected a dbsp_core.Autoscale or None"):
        p.autoscale(3)
    p.close()


def test_a_recorded_trace_scales_up_in_its_8x_phase_and_replays_the_same() -> None:
    """tests/fixtures/autoscale-trace.json: the samples an autoscaler took from a real embedded pipeline held at one
    worker while the rate stepped up 8x (tests/fixtures/make_autoscale_trace.py). Replayed through the policy
    (evaluated after each step, up to 2 workers): once the 8x steps are measured the decision is a scale-up to 2;
    nothing decides below the minimum; a second replay decides the same."""
    import json

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                        "autoscale-trace.json")
    with open(path) as f:
        trace = json.load(f)
    steps = [StepSample(*s) for s in trace["steps"]]
    arrivals = trace["arrivals"]
    p = Autoscale(1, 2, max_step_ms=trace["target_ms"], window_s=3, interval_s=0, min_steps=3)
    high = trace["phase"]  # the 8x phase starts here

    def replay() -> list:
        out, state = [], PolicyState(since=0.0)
        for i, s in enumerate(steps):
            old = next(n for t, n in [(a[0], a[1]) for a in arrivals] if t >= s.t - p.window_s)
            rate = (arrivals[i][1] - old) / max(1e-9, s.t - max(0.0, s.t - p.window_s))
            m = Measurements(now=s.t, workers=1, cap=2, steps=tuple(steps[:i + 1]), arrival_rows_s=rate)
            d, state = decide(p, m, state)
            out.append(d)
        return out

    first = replay()
    assert [d.to_dict() for d in first] == [d.to_dict() for d in replay()]
    assert all(d.target in (1, 2) and d.reason != "scale_down" for d in first)
    after = [d for s, d in zip(steps, first) if s.t - s.seconds >= high + 3 * trace["tick"]]
    assert after, "the trace has no measured 8x steps"
    ups = [d for d in after if d.action == "rescale"]
    assert ups and ups[0].target == 2 and ups[0].reason.startswith("scale_up"), [d.to_dict() for d in after]
