"""The rescale test workload: a circuit with every stateful operator kind (join, left join, distinct, linear / extremes / recompute aggregates, integrate and delay of keyed and unkeyed streams, a window over the step's now), deterministic random changes with deletions, the DuckDB query of every output, and a never-rescaled reference run; and what the kill -9 rescale tests share: their child processes, the directory they start from, the kill rounds and the final check."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "core"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "fixtures"))

from auction import by_category  # noqa: E402
import dbsp_core as dbsp  # noqa: E402
from dbsp_core.runtime import StagedExecutor  # noqa: E402
from dbsp_core.operators.temporal import within_last  # noqa: E402
from oracle import AUCTIONS, BIDS, ChangeGen, duckdb_query, normalize, to_zset  # noqa: E402

EVENTS = pa.schema([("id", pa.int64()), ("ts", pa.int64())])
SCHEMAS = {"bids": BIDS, "auctions": AUCTIONS, "events": EVENTS}
WINDOW = 100  # seconds
T0 = 1_700_000_000


def build_circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    bids, auctions, events = (c.input(n, SCHEMAS[n]) for n in ("bids", "auctions", "events"))
    c.output("joined", by_category(bids, auctions))
    c.output("extremes", bids.group_by("auction").agg(lo=dbsp.min("price"), hi=dbsp.max("price"), n=dbsp.count()))
    c.output("fsum", bids.group_by("bidder").agg(s=dbsp.sum("f"), a=dbsp.avg("f")))
    c.output("distinct", bids.select(b=pc.field("bidder"), p=pc.field("price")).distinct())
    c.output("lj", auctions.left_join(bids, left_on="id", right_on="auction"))
    c.output("integ", bids.filter(pc.field("price") > 2).integrate().differentiate())
    counts = bids.group_by("auction").agg(n=dbsp.count())  # partitioned by auction: keyed Z-set state below
    c.output("keyed_integ", counts.integrate().differentiate())
    c.output("delayed", bids.select(a=pc.field("auction")).delay())
    c.output("window", within_last(events, "ts", WINDOW))
    return c


QUERIES = {
    "joined": "SELECT a.category, COUNT(*), SUM(b.price) FROM bids b JOIN auctions a ON b.auction = a.id "
              "GROUP BY a.category",
    "extremes": "SELECT auction, MIN(price), MAX(price), COUNT(*) FROM bids GROUP BY auction",
    "fsum": "SELECT bidder, SUM(f), AVG(f) FROM bids GROUP BY bidder",
    "distinct": "SELECT DISTINCT bidder, price FROM bids",
    "lj": "SELECT a.id, a.category, a.reserve, b.auction, b.bidder, b.price, b.f FROM auctions a "
          "LEFT JOIN bids b ON a.id = b.auction",
    "integ": "SELECT * FROM bids WHERE price > 2",
    "keyed_integ": "SELECT auction, COUNT(*) FROM bids GROUP BY auction",
    "delayed": "SELECT auction FROM bids_prev",
    "window": "SELECT * FROM events WHERE ts BETWEEN {lo} AND {hi}",
}


class Workload:
    """``steps`` steps of changes (each a list of pushes) and the wall clock (ns) of each step, from ``seed``.

    With ``keys``, step 0 also inserts ``keys`` bids and auctions with distinct keys (auction / id ``i``, bidder
    ``u<i>``), so that every shard of a 256-shard layout holds state (:func:`assert_every_shard_holds_state`), and
    the last step deletes every one of them still present: a row a move lost or left at the wrong worker then shows
    in that step's output (the deletion meets no state, or the wrong state)."""

    def __init__(self, seed: int, steps: int, max_rows: int = 8, keys: int = 0) -> None:
        rng = np.random.default_rng(seed)
        gens = {n: ChangeGen(rng, SCHEMAS[n]) for n in ("bids", "auctions")}
        bulk = {"bids": Counter((i, f"u{i}", int(rng.integers(0, 100)), float(rng.integers(-20, 21)) / 4)
                                for i in range(keys)),
                "auctions": Counter((i, str(rng.choice(["a", "b", "c", "dd", ""])), 100 + int(rng.integers(0, 100)))
                                    for i in range(keys))}
        left = {name: sorted(b) for name, b in bulk.items()}  # the bulk rows still present (never drawn by gens)
        events: Counter = Counter()
        self.keys = keys
        self.pushes: list[list[tuple[str, dbsp.ZSet]]] = []
        self.now_s: list[int] = []
        self.bags: list[dict[str, dict]] = []  # the integrated inputs after each step
        now = T0
        for step in range(steps):
            now += int(rng.choice([0, 1, 30, 99, 150, 400]))
            pushes = []
            for name, g in gens.items():
                change = Counter(g.change(max_rows))
                if step == 0:
                    change.update(bulk[name])
                elif keys and step == steps - 1:  # delete what is left of the bulk rows
                    change.subtract(left[name])
                    left[name] = []
                elif keys:  # and a few of them in the other steps
                    for _ in range(min(len(left[name]), int(rng.integers(0, 4)))):
                        change[left[name].pop(int(rng.integers(len(left[name]))))] -= 1
                change = {r: w for r, w in change.items() if w}
                if change:
                    pushes.append((name, to_zset(change, SCHEMAS[name])))
            ev: Counter = Counter()
            for _ in range(int(rng.integers(0, 6))):
                present = [r for r, w in (events + ev).items() if w > 0]
                if present and rng.random() < 0.3:
                    ev[present[int(rng.integers(len(present)))]] -= 1
                else:
                    ev[(int(rng.integers(0, 4)), now + int(rng.integers(-2 * WINDOW, WINDOW // 2)))] += 1
            ev = Counter({r: w for r, w in ev.items() if w})
            events.update(ev)
            events = Counter({r: w for r, w in events.items() if w})
            if ev:
                pushes.append(("events", to_zset(dict(ev), EVENTS)))
            self.pushes.append(pushes)
            self.now_s.append(now)
            self.bags.append({"bids": {**gens["bids"].bag, **dict.fromkeys(left["bids"], 1)},
                              "auctions": {**gens["auctions"].bag, **dict.fromkeys(left["auctions"], 1)},
                              "events": dict(events)})

    def clock(self, step: int) -> int:
        return self.now_s[step] * 10**9

    def push(self, p: dbsp.Pipeline, step: int, durable: bool = True) -> None:
        """Push the changes of ``step`` into ``p``; ``durable``: each under its (producer, seq), so that a step
        pushed again after a kill counts once."""
        for name, z in self.pushes[step]:
            if durable:
                p.push(name, z, producer=f"gen-{name}", seq=step)
            else:
                p.push(name, z)

    def step_to(self, p: dbsp.Pipeline, cur: list[int], steps: int, after: Callable[[int], None] | None = None
                ) -> None:
        """Run ``p`` from its next step up to ``steps`` steps, pushing each step durably; ``cur[0]`` is the step
        running (the pipeline's clock reads it), ``after(step)`` runs after each step."""
        while p.steps < steps:
            s = cur[0] = p.steps
            self.push(p, s)
            p.step()
            if after is not None:
                after(s)


def reference(w: Workload) -> list[dict[str, dict]]:
    """Each step's output changes ({output: {row: weight}}) of a never-rescaled, in-memory, one-worker run."""
    cur = [0]
    p = dbsp.Pipeline(build_circuit(), workers=1, clock=lambda: w.clock(cur[0]))
    outs = []
    for step in range(len(w.pushes)):
        cur[0] = step
        w.push(p, step, durable=False)
        outs.append({k: v.to_dict() for k, v in p.step().items()})
    p.close()
    return outs


def duckdb_views(w: Workload, upto: int) -> dict[str, dict]:
    """DuckDB's answer for every output over the inputs integrated up to step ``upto`` (inclusive)."""
    bags = w.bags[upto]
    tables = {n: (SCHEMAS[n], bags[n]) for n in SCHEMAS}
    tables["bids_prev"] = (BIDS, w.bags[upto - 1]["bids"] if upto > 0 else {})
    now = w.now_s[upto]
    return {name: duckdb_query(sql.format(lo=now - WINDOW, hi=now), tables) for name, sql in QUERIES.items()}


def integrals(log_outputs: dict[str, list[dict]]) -> dict[str, dict]:
    """{output: normalized integral} of per-step changes."""
    out = {}
    for name, changes in log_outputs.items():
        acc: Counter = Counter()
        for ch in changes:
            acc.update(ch)
        out[name] = normalize({r: v for r, v in acc.items() if v})
    return out


def assert_every_shard_holds_state(d: str, what: str) -> int:
    """Every shard of the layout of the closed directory ``d`` holds stored operator state in its owner's database
    (read with ``inspect_storage``, as ``dbsp inspect`` shows it): a move of any shard then has rows to lose.
    Returns the number of shards."""
    from dbsp_core.storage.directory import read_layout
    from dbsp_core.storage.inspect import inspect_storage

    lay, _ = read_layout(d)
    per_worker = inspect_storage(d)["state_bytes"]
    owner = lay.shard_map.part_of_shard
    empty = [s for s in range(lay.shards) if not per_worker.get(str(int(owner[s])), {}).get(s)]
    assert not empty, (f"{what}: {len(empty)} of {lay.shards} shards hold no state at their owner (first: "
                       f"{empty[:8]}): a move lost them or left them at another worker, or the workload has too "
                       f"few keys")
    return lay.shards


def check_log_against_duckdb(p: dbsp.Pipeline, w: Workload, upto: int) -> None:
    """The output log's integral of every output equals DuckDB over all input up to step ``upto``."""
    got = integrals({name: [z.to_dict() for s, z in p.read_output(name) if s <= upto] for name in QUERIES})
    want = duckdb_views(w, upto)
    for name in QUERIES:
        assert got[name] == want[name], (f"output {name!r} after step {upto} differs from DuckDB\n"
                                         f"only in the log: {_diff(got[name], want[name])}\n"
                                         f"only in DuckDB: {_diff(want[name], got[name])}")


def _diff(a: dict, b: dict) -> dict:
    return {r: v - b.get(r, 0) for r, v in a.items() if b.get(r, 0) != v}


# --- the kill -9 rescale tests (test_rescale_kill.py, test_live_rescale_kill.py) ---

def executor(kind: str) -> StagedExecutor | None:
    """The executor of a test kind: "staged" or "embedded" (the default one)."""
    return StagedExecutor() if kind == "staged" else None


def start_storage(w: Workload, d: str, kind: str, checkpoint: bool) -> None:
    """Run the workload's first 3 steps at 2 workers into the directory ``d`` (each push under its (producer,
    seq), as the children push), and close with or without a checkpoint; a bulk-keyed workload checkpoints after
    step 0 too, so that its rows are stored state however the later steps end."""
    cur = [0]
    p = dbsp.Pipeline(build_circuit(), 2, storage=d, executor=executor(kind), checkpoint_interval=None,
                      clock=lambda: w.clock(cur[0]))

    def after(s: int) -> None:
        if s == 0 and w.keys:
            p.checkpoint()

    w.step_to(p, cur, 3, after)
    p.close(checkpoint=checkpoint)


def run_child(argv: list[str], crash: str | None, kill_after: float | None, hang_after: float, what: str
              ) -> tuple[str, dict | None]:
    """Run a child process (``argv`` after the interpreter, with this checkout first on PYTHONPATH) and return
    ("killed", None) when it was killed: by ``DBSP_CRASHPOINT=crash`` (-9) or after ``kill_after`` seconds;
    else ("done", the JSON of its last line). Without ``kill_after``, a child still running after ``hang_after``
    seconds is a hang (AssertionError naming ``what``); a child that fails otherwise is an AssertionError."""
    env = dict(os.environ)
    repo = os.path.dirname(os.path.dirname(HERE))
    env["PYTHONPATH"] = os.pathsep.join([repo] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("DBSP_CRASHPOINT", None)
    if crash:
        env["DBSP_CRASHPOINT"] = crash
    p = subprocess.Popen([sys.executable] + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                         text=True)
    try:
        out, err = p.communicate(timeout=kill_after if kill_after is not None else hang_after)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        if kill_after is None:
            raise AssertionError(f"{what} still ran after {hang_after:.0f} s (a hang)")
        return "killed", None
    if p.returncode == -9:
        return "killed", None
    assert p.returncode == 0, f"child failed (rc {p.returncode}):\n{err[-3000:]}{out[-3000:]}"  # failures on stdout
    return "done", json.loads(out.strip().splitlines()[-1])


def kill_rounds(rng: random.Random, kills: int, stats: dict, points: list[str], kill_after: tuple[float, float] | None,
                one_round: Callable[[Callable[..., tuple[str, dict | None]]], None]) -> int:
    """Run rounds until ``kills`` kills landed (at most 4x as many rounds) and return the number of rounds.

    A named point is not reached on every path and a timed kill can come after the child finished: counting the
    kills that landed, not the rounds, keeps the count from depending on the machine's speed. ``one_round(kill)``
    is one round: it draws its choices from ``rng`` and calls ``kill(child)`` once, where ``child(crash=...,
    kill_after=...)`` runs its child; ``kill`` kills it at a point of ``points`` (6 in 10, or always when
    ``kill_after`` is None: children too short for a timed kill to land) or after a time drawn from ``kill_after``
    seconds, and counts a kill that landed in ``stats`` ("kills", and "named" or "timed").
    """
    def kill(child: Callable[..., tuple[str, dict | None]]) -> None:
        if kill_after is None or rng.random() < 0.6:
            how, _ = child(crash=rng.choice(points))
            stats["named"] += how == "killed"
        else:
            how, _ = child(kill_after=rng.uniform(*kill_after))
            stats["timed"] += how == "killed"
        stats["kills"] += how == "killed"

    rounds = 0
    while stats["kills"] < kills and rounds < 4 * kills:
        rounds += 1
        one_round(kill)
    return rounds


def kill_test(tag: str, kind: str, seed: int, w: Workload, d: str, rng: random.Random, stats: dict, *,
              checkpoint: bool, kills: int, points: list[str], kill_after: tuple[float, float] | None,
              one_round: Callable[[Callable[..., tuple[str, dict | None]]], None],
              last_child: Callable[[], tuple[str, dict | None]]) -> int:
    """A kill -9 rescale test from start to end: the workload's first steps into ``d`` (:func:`start_storage`,
    closed with or without ``checkpoint``), rounds until ``kills`` kills landed (:func:`kill_rounds`), the last
    child run to the end (``last_child()``), the directory checked against the never-rescaled run and DuckDB
    (:func:`check_against_reference`), and the kills asserted to have landed. Prints the stats under ``tag``
    and returns the number of rounds."""
    ref = reference(w)
    start_storage(w, d, kind, checkpoint)
    rounds = kill_rounds(rng, kills, stats, points, kill_after, one_round)
    how, _ = last_child()
    assert how == "done"
    check_against_reference(d, kind, w, ref, len(w.pushes), seed)
    print(f"[{tag}] {kind}: {rounds} rounds, {stats}; 0 rows lost, 0 doubled")
    assert stats["kills"] >= kills, f"only {stats['kills']} of {kills} kills landed in {rounds} rounds"
    return rounds


def check_against_reference(d: str, kind: str, w: Workload, ref: list[dict[str, dict]], steps: int, seed: int
                            ) -> None:
    """The directory ``d`` holds all ``steps`` steps, each output step equals the never-rescaled run ``ref``, and
    the output log's integral equals DuckDB over all input."""
    q = dbsp.Pipeline.open(d, build_circuit(), executor=executor(kind), checkpoint_interval=None)
    assert q.steps == steps and list(q.output_steps) == list(range(steps))
    for s in range(steps):
        got = {name: z.to_dict() for name, z in q._output.get(s).items()}
        assert got == ref[s], f"output step {s} differs from the never-rescaled run (seed {seed})"
    check_log_against_duckdb(q, w, steps - 1)
    q.close()
