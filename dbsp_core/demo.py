"""The main job behind ``python -m dbsp_core demo``: a durable auction pipeline fed by a producer thread, with a
live progress line, an optional ``kill -9`` and recovery, and a final check against DuckDB.

The circuit (NEXMark-like) has three inputs, ``persons``, ``auctions`` and ``bids``, and five views:

- ``category_stats``: bids joined with their auction, per category: count, sum, min, max and mean price;
- ``top_bid``: per auction, the highest bid and the number of bids (min/max survive retracted bids);
- ``city_spend``: bids summed per bidder, joined with their bidder, per city (persons move city: the join sees
  deletions);
- ``bidders_per_category``: distinct (category, bidder) pairs counted per category (``COUNT(DISTINCT)``);
- ``last_hour``: the bids (joined with their auction) whose event time is within the last hour of the step's
  logged ``now``, per category.

Invariants (checked at the end of every run):
  1. The generator is a pure function of (seed, t0, batch number): re-sending a batch after a crash sends the
     same rows, and the pipeline's (producer, seq) dedup counts it once.
  2. The integral of every view's output log equals DuckDB's query over every generated batch (each counted
     once), with ``last_hour`` evaluated at the ``now`` of the last step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import dbsp_core as dbsp
from dbsp_core.storage.inspect import inspect_storage
from dbsp_core.storage.location import mask_uri


PERSONS = pa.schema([("id", pa.int64()), ("name", pa.utf8()), ("city", pa.utf8())])
AUCTIONS = pa.schema([("id", pa.int64()), ("seller", pa.int64()), ("category", pa.utf8()), ("reserve", pa.int64())])
BIDS = pa.schema([("auction", pa.int64()), ("bidder", pa.int64()), ("price", pa.int64()),
                  ("ts", pa.timestamp("ms"))])
CITIES = np.array(["Boise", "Bend", "Kent", "Lodi", "Napa", "Ogden", "Provo", "Reno", "Salem", "Tacoma",
                   "Yakima", "Eugene"])
CATEGORIES = np.array([f"cat-{i:02d}" for i in range(20)])
HOUR_MS = 3_600_000


def build_circuit() -> dbsp.Circuit:
    """The auction circuit: three inputs, five views (see the module docstring).

    >>> sorted(build_circuit().outputs)
    ['bidders_per_category', 'category_stats', 'city_spend', 'last_hour', 'top_bid']
    """
    c = dbsp.Circuit()
    persons = c.input("persons", PERSONS)
    auctions = c.input("auctions", AUCTIONS)
    bids = c.input("bids", BIDS)
    with_auction = bids.join(auctions, left_on="auction", right_on="id")
    c.output("category_stats", with_auction.group_by("category").agg(
        n=dbsp.count(), total=dbsp.sum("price"), lo=dbsp.min("price"), hi=dbsp.max("price"),
        mean=dbsp.avg("price")))
    c.output("top_bid", bids.group_by("auction").agg(hi=dbsp.max("price"), n=dbsp.count()))
    # summed per bidder before the join (eager aggregation): the join keeps a row per bidder, not every bid, and a
    # person moving city moves one row per bidder instead of each of its bids
    per_bidder = bids.group_by("bidder").agg(n=dbsp.count(), total=dbsp.sum("price"))
    c.output("city_spend", per_bidder.join(persons, left_on="bidder", right_on="id").group_by("city").agg(
        n=dbsp.sum("n"), total=dbsp.sum("total")))
    pairs = with_auction.select(category="category", bidder="bidder").distinct()
    c.output("bidders_per_category", pairs.group_by("category").agg(bidders=dbsp.count()))
    # the window over the join category_stats runs anyway: one trace of the window's rows, where windowing the bids
    # and joining them again kept a second copy in the join's left side and ran a third join and its exchange
    recent = dbsp.within_last(with_auction, "ts", 3600)
    c.output("last_hour", recent.group_by("category").agg(n=dbsp.count(), hi=dbsp.max("price")))
    return c


class Generator:
    """Deterministic input batches: batch k is a pure function of (seed, t0_ms, k) and of batches < k.

    Each batch adds persons, auctions and bids, moves some persons to another city (a retraction and an
    insertion), and retracts 5% of the bids of batch k-2 (cancelled bids). Bid event times spread over the
    last 75 minutes before ``t0_ms + k * 250 ms``, so part of every batch is already outside the last hour
    and the ``last_hour`` view loses rows as the steps' ``now`` moves on.
    """

    def __init__(self, seed: int, t0_ms: int, bids_per_batch: int) -> None:
        self.seed, self.t0_ms, self.bids_per_batch = seed, t0_ms, bids_per_batch
        self.persons_per_batch = max(10, bids_per_batch // 100)
        self.auctions_per_batch = max(10, bids_per_batch // 25)
        self.city: dict[int, str] = {}
        self.recent_bids: dict[int, pa.Table] = {}
        self.next_batch = 0

    def batch(self) -> dict[str, tuple[pa.Table, np.ndarray]]:
        """The next batch as {stream: (rows, weights)}; streams are persons, auctions, bids, cancels."""
        k = self.next_batch
        self.next_batch += 1
        rng = np.random.default_rng([self.seed, k])
        np_, na, nb = self.persons_per_batch, self.auctions_per_batch, self.bids_per_batch
        out: dict[str, tuple[pa.Table, np.ndarray]] = {}
        # persons: new ones, and some existing ones moving to another city (retract + insert)
        ids = np.arange(k * np_, (k + 1) * np_)
        cities = CITIES[rng.integers(0, len(CITIES), np_)]
        movers = rng.choice(k * np_, size=min(k * np_, np_ // 5), replace=False) if k else np.array([], np.int64)
        new_city = CITIES[rng.integers(0, len(CITIES), len(movers))]
        old = [self.city[int(i)] for i in movers]
        p_ids = np.concatenate([ids, movers, movers])  # new persons; movers' old rows out, new rows in
        p_cities = np.concatenate([cities, np.array(old, dtype=cities.dtype), new_city])
        weights = np.concatenate([np.ones(np_, np.int64), -np.ones(len(movers), np.int64),
                                  np.ones(len(movers), np.int64)])
        for i, c in zip(ids, cities):
            self.city[int(i)] = str(c)
        for i, c in zip(movers, new_city):
            self.city[int(i)] = str(c)
        names = pc.binary_join_element_wise("person-", pa.array(p_ids.astype(str)), "")
        out["persons"] = (pa.table({"id": p_ids, "name": names, "city": p_cities}, schema=PERSONS), weights)
        # auctions
        a_ids = np.arange(k * na, (k + 1) * na)
        out["auctions"] = (pa.table({"id": a_ids, "seller": rng.integers(0, (k + 1) * np_, na),
                                     "category": CATEGORIES[rng.integers(0, len(CATEGORIES), na)],
                                     "reserve": rng.integers(10, 500, na)}, schema=AUCTIONS), np.ones(na, np.int64))
        # bids: mostly on recent auctions, by any person so far
        hi = (k + 1) * na
        auction = np.maximum(0, hi - 1 - rng.geometric(1 / (4 * na), nb)).astype(np.int64)
        ts = self.t0_ms + k * 250 - rng.integers(0, 75 * 60_000, nb)
        bids = pa.table({"auction": auction, "bidder": rng.integers(0, (k + 1) * np_, nb),
                         "price": rng.integers(1, 5_000, nb), "ts": pa.array(ts, pa.timestamp("ms"))}, schema=BIDS)
        out["bids"] = (bids, np.ones(nb, np.int64))
        # cancels: 5% of the bids of batch k-2 are retracted
        self.recent_bids[k] = bids
        old_bids = self.recent_bids.pop(k - 2, None)
        if old_bids is not None:
            pick = np.sort(rng.choice(old_bids.num_rows, size=old_bids.num_rows // 20, replace=False))
            out["cancels"] = (old_bids.take(pick), -np.ones(len(pick), np.int64))
        return out


HANDLE = {"persons": "persons", "auctions": "auctions", "bids": "bids", "cancels": "bids"}


class _Producer(threading.Thread):
    """Pushes batches ``0..total-1`` with (producer, seq) = ("gen.<stream>", batch), at most ``lead`` ahead; times
    its two parts apart: generating batches (``gen_s``) and pushing them (``push_s``: encoding, the input log's
    append and fsync, dedup)."""

    def __init__(self, p: Any, gen: Generator, total: int, lead: int, record: list | None) -> None:
        super().__init__(name="dbsp-demo-producer", daemon=True)
        self.p, self.gen, self.total, self.lead, self.record = p, gen, total, lead, record
        self.sent_rows = self.duplicates = self.batches_done = 0
        self.allowed = threading.Semaphore(lead)
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.acked_pushes = 0
        self.gen_s = self.push_s = 0.0

    def run(self) -> None:
        try:
            for k in range(self.total):
                t = time.perf_counter()
                batch = self.gen.batch()
                self.gen_s += time.perf_counter() - t
                if self.record is not None:
                    self.record.append(batch)
                new = False
                for stream, (rows, w) in batch.items():
                    t = time.perf_counter()
                    ack = self.p.push(HANDLE[stream], rows, weights=w, producer=f"gen.{stream}", seq=k)
                    self.push_s += time.perf_counter() - t
                    if ack.duplicate:
                        self.duplicates += 1
                    else:
                        new = True
                        with self.cond:  # rows and pushes move together: the stepping thread reads both
                            self.sent_rows += rows.num_rows
                            self.acked_pushes += 1
                            self.cond.notify_all()
                self.batches_done = k + 1
                if new:
                    self.allowed.acquire()  # bounded lead over the stepping thread
        except BaseException as exc:  # reported by the stepping thread
            self.error = exc
        finally:
            with self.cond:
                self.cond.notify_all()


class _Progress:
    """One status line, rewritten in place on a terminal and printed about twice a second otherwise."""

    def __init__(self, prefix: str, quiet: bool) -> None:
        self.prefix, self.quiet = prefix, quiet
        self.tty = sys.stdout.isatty()
        self.last = 0.0

    def show(self, text: str, final: bool = False) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        if self.tty:
            if final or now - self.last >= 0.1:
                sys.stdout.write(f"\r\x1b[2K{self.prefix}{text}" + ("\n" if final else ""))
                sys.stdout.flush()
                self.last = now
        elif final or now - self.last >= 0.5:
            print(f"{self.prefix}{text}", flush=True)
            self.last = now


class _Rescaler(threading.Thread):
    """Rescales the pipeline live to each worker count of ``targets`` in turn, the k-th once ``k+1`` equal parts
    of the batches are in (while the producer pushes and the main thread steps)."""

    def __init__(self, p: Any, prod: "_Producer", total: int, targets: list[int]) -> None:
        super().__init__(name="dbsp-demo-rescaler", daemon=True)
        self.p, self.prod, self.total, self.targets = p, prod, total, targets
        self.reports: list[dict] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for k, n in enumerate(self.targets):
                at = (k + 1) * self.total // (len(self.targets) + 1)
                while self.prod.batches_done < at and self.prod.is_alive():
                    time.sleep(0.01)
                self.reports.append(self.p.rescale(n))
        except BaseException as exc:  # reported by the stepping thread
            self.error = exc


def _run(p: Any, gen: Generator, total: int, record: list | None, sizes: dict[str, int], progress: _Progress,
         crash_at_step: int | None = None, rescale: list[int] | None = None) -> dict[str, Any]:
    """Feed batches from a producer thread and step until every acknowledged push is stepped (rescaling live to
    the worker counts of ``rescale`` along the way)."""
    prod = _Producer(p, gen, total, lead=2, record=record)
    resc = _Rescaler(p, prod, total, rescale) if rescale else None
    t0 = time.perf_counter()
    step_ms: list[float] = []
    engine_ms: list[float] = []
    step_rows: list[int] = []
    engine0, log0 = p.stats["step_engine_s"], p.stats["step_log_s"]  # recovery's replayed steps are not ours
    ex = p.executor
    measure_cpu = hasattr(ex, "measure_cpu") and not rescale  # a rescale resizes the per-worker counters
    if measure_cpu:  # the embedded executor: CPU time of the worker threads in steps
        ex.measure_cpu = True
    cpu0 = sum(ex.worker_cpu_seconds) if measure_cpu else 0.0
    wait_s = 0.0
    stepped = -1 if p.stats["recovered_pushes"] else 0  # recovered input waits for a step of its own
    stepped_rows = 0
    prod.start()
    if resc is not None:
        resc.start()
    while True:
        w0 = time.perf_counter()
        with prod.cond:
            while prod.acked_pushes == stepped and prod.is_alive() and prod.error is None:
                prod.cond.wait(0.05)
            acked, acked_rows = prod.acked_pushes, prod.sent_rows
        wait_s += time.perf_counter() - w0
        if prod.error is not None:
            raise prod.error
        if resc is not None and resc.error is not None:
            raise resc.error
        if acked == stepped and not prod.is_alive():
            break
        s0, e0 = time.perf_counter(), p.stats["step_engine_s"]
        out = p.step()
        step_ms.append((time.perf_counter() - s0) * 1e3)
        engine_ms.append((p.stats["step_engine_s"] - e0) * 1e3)
        step_rows.append(acked_rows - stepped_rows)  # rows acknowledged before the step divided its input
        stepped, stepped_rows = acked, acked_rows
        prod.allowed.release()
        for name, z in out.items():
            sizes[name] += int(z.weights.sum())
        el = time.perf_counter() - t0
        view_text = " ".join(f"{n}={s:,}" for n, s in sizes.items())
        rp = p.rescale_progress
        scale = (f"W {rp['from_workers']}->{rp['to_workers']}: {rp['moved_shards']} shards moved, batch "
                 f"{rp['done']}/{rp['batches']}, pause {rp['last_pause_ms']:.1f} ms" if rp else f"W={p.workers}")
        engine_s = p.stats["step_engine_s"] - engine0
        progress.show(f"step {p.steps - 1:>4} | {scale} | batches {prod.batches_done}/{total} | {prod.sent_rows:,} "
                      f"rows | end to end {prod.sent_rows / el / 1e3:,.0f}k rows/s | engine "
                      f"{_rate(stepped_rows, engine_s)} | checkpoints {p.stats['checkpoints']} | {view_text}")
        if crash_at_step is not None and p.steps - 1 >= crash_at_step:
            progress.show(f"step {p.steps - 1}: kill -9 of this process now (producer mid-push, no cleanup)",
                          final=True)
            os.kill(os.getpid(), signal.SIGKILL)
    prod.join()
    if resc is not None:
        resc.join()
        if resc.error is not None:
            raise resc.error
    el = time.perf_counter() - t0
    engine_s = p.stats["step_engine_s"] - engine0
    progress.show(f"step {p.steps - 1:>4} | batches {total}/{total} | {prod.sent_rows:,} rows | end to end "
                  f"{prod.sent_rows / el / 1e3:,.0f}k rows/s | engine {_rate(stepped_rows, engine_s)} | "
                  f"checkpoints {p.stats['checkpoints']} | " + " ".join(f"{n}={s:,}" for n, s in sizes.items()),
                  final=True)
    return {"seconds": el, "rows": prod.sent_rows, "duplicates": prod.duplicates, "steps": len(step_ms),
            "step_ms": step_ms, "engine_ms": engine_ms, "step_rows": step_rows, "engine_s": engine_s,
            "log_s": p.stats["step_log_s"] - log0, "wait_s": wait_s, "gen_s": prod.gen_s, "push_s": prod.push_s,
            "cpu_s": sum(ex.worker_cpu_seconds) - cpu0 if measure_cpu else None,
            "batches": prod.batches_done, "rescales": resc.reports if resc is not None else []}


def _rate(rows: int, seconds: float) -> str:
    return f"{rows / seconds / 1e3:,.0f}k rows/s" if seconds > 0 and rows else "-"


def _views_from_log(p: Any, circuit: dbsp.Circuit) -> dict[str, dbsp.ZSet]:
    """Each view as the integral of its whole output log."""
    views = {}
    for name, i in circuit.outputs.items():
        acc = dbsp.ZSet.empty(circuit.nodes[i].schema)
        for _, z in p.read_output(name, 0):
            acc = acc + z
        views[name] = acc
    return views


def duckdb_views(batches: list[dict[str, tuple[pa.Table, np.ndarray]]], now_ns: int) -> dict[str, dict]:
    """The five views recomputed from scratch by DuckDB over all batches, as {row: multiplicity}."""
    import duckdb

    def stacked(streams: tuple[str, ...], schema: pa.Schema) -> pa.Table:
        parts = [b[s][0].append_column("w", pa.array(b[s][1], pa.int64())) for b in batches for s in streams
                 if s in b]
        return pa.concat_tables(parts) if parts else schema.empty_table().append_column("w", pa.array([], pa.int64()))

    con = duckdb.connect()
    con.execute("SET threads TO 1")
    for name, streams, schema in (("persons", ("persons",), PERSONS), ("auctions", ("auctions",), AUCTIONS),
                                  ("bids", ("bids", "cancels"), BIDS)):
        con.register(f"{name}_z", stacked(streams, schema))
        cols = ", ".join(f.name for f in schema)
        # the integrated input as a bag: one copy of a row per unit of its summed weight
        con.execute(f"CREATE TABLE {name} AS SELECT {cols} FROM (SELECT {cols}, SUM(w)::BIGINT AS w FROM {name}_z "
                    f"GROUP BY ALL HAVING SUM(w) > 0) t, range(t.w)")
        bad = con.execute(f"SELECT COUNT(*) FROM (SELECT {cols} FROM {name}_z GROUP BY ALL HAVING SUM(w) < 0)"
                          ).fetchall()[0][0]
        assert bad == 0, f"the generator retracted {name} rows that were never inserted"
    lo_ms, hi_ms = (now_ns - HOUR_MS * 10**6) / 1e6, now_ns / 1e6
    queries = {
        "category_stats": "SELECT category, COUNT(*), SUM(price), MIN(price), MAX(price), AVG(price) "
                          "FROM bids JOIN auctions ON auction = auctions.id GROUP BY category",
        "top_bid": "SELECT auction, MAX(price), COUNT(*) FROM bids GROUP BY auction",
        "city_spend": "SELECT city, COUNT(*), SUM(price) FROM bids JOIN persons ON bidder = persons.id GROUP BY city",
        "bidders_per_category": "SELECT category, COUNT(DISTINCT bidder) FROM bids JOIN auctions "
                                "ON auction = auctions.id GROUP BY category",
        "last_hour": f"SELECT category, COUNT(*), MAX(price) FROM bids JOIN auctions ON auction = auctions.id "
                     f"WHERE epoch_ms(ts) >= {lo_ms} AND epoch_ms(ts) <= {hi_ms} GROUP BY category",
    }
    out = {}
    for name, sql in queries.items():
        rows: dict = {}
        for r in con.execute(sql).fetchall():
            key = _norm(tuple(r))
            rows[key] = rows.get(key, 0) + 1
        out[name] = rows
    con.close()
    return out


def _norm(row: tuple) -> tuple:
    return tuple(round(v, 6) if isinstance(v, float) else v for v in row)


def verify(views: dict[str, dbsp.ZSet], batches: list, now_ns: int) -> list[str]:
    """Compare the pipeline's views with DuckDB; returns one line per view (raises AssertionError on a mismatch)."""
    expected = duckdb_views(batches, now_ns)
    lines = []
    for name, z in views.items():
        got = {_norm(k): w for k, w in z.to_dict().items()}
        want = expected[name]
        if got != want:
            missing = {k: w for k, w in want.items() if got.get(k) != w}
            extra = {k: w for k, w in got.items() if want.get(k) != w}
            raise AssertionError(f"view {name!r} differs from DuckDB: {len(missing)} rows missing or wrong "
                                 f"(e.g. {list(missing.items())[:3]}), {len(extra)} extra "
                                 f"(e.g. {list(extra.items())[:3]})")
        lines.append(f"{name}: {len(got):,} rows")
    return lines


def _positive(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def _workers_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected worker counts like 2,4,1, got {text!r}") from None
    if not out or any(n < 1 for n in out):
        raise argparse.ArgumentTypeError(f"expected positive worker counts like 2,4,1, got {text!r}")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=_positive, default=40, help="input batches to generate (default 40)")
    parser.add_argument("--bids", type=_positive, default=25_000, help="bids per batch (default 25000)")
    parser.add_argument("--workers", type=_positive, default=2, help="worker threads W (default 2)")
    parser.add_argument("--dir", default=None, help="storage directory (default: a temporary one, removed after)")
    parser.add_argument("--storage", default=None, metavar="URI",
                        help="keep the pipeline's storage in an object store (s3://bucket/prefix?endpoint_override=...; "
                             "credentials from the environment); --dir then holds the local cache and demo.json")
    parser.add_argument("--checkpoint-interval", type=float, default=1.0,
                        help="seconds between timer checkpoints (default 1)")
    parser.add_argument("--kill-after", type=_positive, default=None, metavar="N",
                        help="run in a child process that kill -9s itself after step N, recover with "
                             "Pipeline.open, finish, and check the views against DuckDB")
    parser.add_argument("--rescale", type=_workers_list, default=None, metavar="W1,W2,...",
                        help="rescale live to these worker counts at evenly spaced points of the run, while it runs")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--no-verify", action="store_true", help="skip the final DuckDB check")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    parser.add_argument("--t0-ms", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--crash-at-step", type=int, default=None, help=argparse.SUPPRESS)


def run_demo(argv: list[str] | None = None) -> int:
    """Run the demo (see ``dbsp demo --help``); returns the process exit code.

    >>> run_demo(["--batches", "3", "--bids", "2000", "--quiet"])  # doctest: +ELLIPSIS
    dbsp demo: ...
    verified against DuckDB: ...
    0
    """
    parser = argparse.ArgumentParser(prog="dbsp demo", description="the durable auction pipeline demo")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.kill_after is not None and args.kill_after >= args.batches:
        parser.error(f"--kill-after {args.kill_after} must be below --batches {args.batches}")
    if not args.checkpoint_interval > 0:
        parser.error("--checkpoint-interval must be positive")
    own_dir = args.dir is None
    root = tempfile.mkdtemp(prefix="dbsp-demo-") if own_dir else args.dir
    try:
        return _demo(args, root)
    finally:
        if own_dir and args.crash_at_step is None:
            shutil.rmtree(root, ignore_errors=True)


def _generator_params(args: argparse.Namespace, root: str) -> int:
    """The generator's time origin, kept in ``<root>/demo.json`` so a later run over the same directory
    regenerates the very batches it already holds (they must be equal to be recognized as duplicates)."""
    path = os.path.join(root, "demo.json")
    want = {"seed": args.seed, "bids": args.bids}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        if {k: saved.get(k) for k in want} != want:
            raise SystemExit(f"dbsp demo: {root} holds a demo run with seed {saved.get('seed')} and "
                             f"{saved.get('bids')} bids per batch; run again with those or use another --dir")
        return int(saved["t0_ms"])
    t0_ms = args.t0_ms if args.t0_ms is not None else time.time_ns() // 10**6
    os.makedirs(root, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({**want, "t0_ms": t0_ms}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return t0_ms


def _inspect(args: argparse.Namespace, root: str) -> dict:
    """What the pipeline's storage holds (an object store's newest checkpoint restored aside to read it)."""
    if args.storage is None:
        return inspect_storage(root)
    from dbsp_core.runtime.remote_state import restored

    with restored(args.storage) as (tmp, _, _):
        return inspect_storage(tmp)


def _demo(args: argparse.Namespace, root: str) -> int:
    t0_ms = _generator_params(args, root)
    circuit = build_circuit()
    child = args.crash_at_step is not None
    # with an object store the pipeline runs on a cache under --dir, rebuilt from the store on every open
    storage = root if args.storage is None else args.storage
    kw: dict[str, Any] = {} if args.storage is None else {"cache_dir": os.path.join(root, "cache")}
    if not child:
        shown = root if args.storage is None else mask_uri(args.storage)
        print(f"dbsp demo: auction pipeline (persons, auctions, bids -> {len(circuit.outputs)} views), "
              f"{args.workers} workers, {args.batches} batches of {args.bids:,} bids, storage {shown}, "
              f"checkpoint every {args.checkpoint_interval:g} s", flush=True)
    sizes = {name: 0 for name in circuit.outputs}
    if args.kill_after is not None:
        cmd = [sys.executable, "-m", "dbsp_core", "demo", "--dir", root, "--t0-ms", str(t0_ms),
               "--crash-at-step", str(args.kill_after), "--batches", str(args.batches), "--bids", str(args.bids),
               "--workers", str(args.workers), "--checkpoint-interval", str(args.checkpoint_interval),
               "--seed", str(args.seed)] + (["--quiet"] if args.quiet else []) \
            + (["--storage", args.storage] if args.storage else [])
        print(f"phase 1: a child process runs the pipeline and kills itself (SIGKILL) after step {args.kill_after}",
              flush=True)
        rc = subprocess.call(cmd)
        if rc != -signal.SIGKILL:
            print(f"error: the child exited with {rc}, not killed by SIGKILL", file=sys.stderr)
            return 1
        print(f"phase 1: child killed by SIGKILL (exit {rc}); state on disk: "
              f"{_describe(_inspect(args, root))}", flush=True)
        t = time.perf_counter()
        p = dbsp.Pipeline.open(storage, circuit, checkpoint_interval=args.checkpoint_interval, **kw)
        st = p.stats
        print(f"phase 2: Pipeline.open recovered at step {p.steps} in {time.perf_counter() - t:.2f} s: "
              f"replayed {st['replayed_steps']} steps from the input log (output checked against the output log), "
              f"{st['recovered_pushes']} acknowledged pushes waiting for a step", flush=True)
        for name, z in _views_from_log(p, circuit).items():
            sizes[name] = len(z)
        print("phase 2: the producer restarts from batch 0; batches already acknowledged come back as "
              "duplicates and are not counted again", flush=True)
    else:
        try:
            p = dbsp.Pipeline(circuit, workers=args.workers, storage=storage,
                              checkpoint_interval=args.checkpoint_interval, **kw)
        except dbsp.CircuitMismatchError as e:  # a directory an older demo (another circuit) wrote
            raise SystemExit(f"dbsp demo: {root} holds a run of another version of the demo's circuit ({e}); "
                             f"use another --dir") from None
    record: list | None = [] if not (child or args.no_verify) else None
    gen = Generator(args.seed, t0_ms, args.bids)
    progress = _Progress("  [child] " if child else "  ", args.quiet)
    try:
        res = _run(p, gen, args.batches, record, sizes, progress, crash_at_step=args.crash_at_step,
                   rescale=args.rescale if not child else None)
        for r in res["rescales"]:
            print(f"live rescale {r['from_workers']} -> {r['to_workers']} workers while running: {r['moved_shards']} "
                  f"of {r['to_shards']} shards ({r['moved_bytes']:,} of {r['total_bytes']:,} bytes of state) moved in "
                  f"{r['batches']} batches; longest pause {r['max_pause_ms']:.1f} ms; {r['seconds']:.2f} s in all",
                  flush=True)
        now_ns = p.now_ns
        steps = p.steps
        ckpt = p.checkpoint()
        med = float(np.median(res["step_ms"])) if res["step_ms"] else 0.0
        p99 = float(np.percentile(res["step_ms"], 99)) if res["step_ms"] else 0.0
        print(f"done: {res['rows']:,} new rows in {res['seconds']:.2f} s end to end "
              f"({res['rows'] / res['seconds'] / 1e3:,.0f}k rows/s), {res['steps']} steps (median {med:.1f} ms, p99 "
              f"{p99:.1f} ms of step()), {p.stats['checkpoints']} checkpoint(s) (the last covers steps 0..{ckpt - 1}), "
              f"{res['duplicates']} duplicate pushes recognized", flush=True)
        if not child:
            print(_breakdown(res, p), flush=True)
        if record is None:
            return 0
        views = _views_from_log(p, circuit)
    except BaseException:
        p.close(checkpoint=False)
        raise
    p.close()
    try:
        lines = verify(views, record, now_ns)
    except ImportError:
        print("skipped the DuckDB check: duckdb is not installed (pip install duckdb)")
        return 0
    except AssertionError as exc:
        print(f"MISMATCH: {exc}", file=sys.stderr)
        return 1
    n_in = sum(rows.num_rows for b in record for rows, _ in b.values())
    print(f"verified against DuckDB: the integral of the output log over steps 0..{steps - 1} equals a "
          f"from-scratch recomputation over all {n_in:,} input rows, for every view ({'; '.join(lines)})")
    stats = views["category_stats"].to_arrow().sort_by("category").slice(0, 5)
    for row in stats.to_pylist():
        print(f"  {row['category']}: {row['n']:,} bids, total {row['total']:,}, min {row['lo']}, "
              f"max {row['hi']}, mean {row['mean']:.1f}")
    print(f"  ... and {len(views['category_stats']) - 5} more categories")
    return 0


def _breakdown(res: dict[str, Any], p: Any) -> str:
    """Where the run's time went, each part measured on its own thread: the engine (the executor running the
    circuit), the output log, the producer's generating and pushing, checkpoints, and the stepping thread's
    waits for input. The parts overlap (threads), so they do not add up to the wall-clock time."""
    eng = np.array(res["engine_ms"]) if res["engine_ms"] else np.zeros(1)
    rows = np.array(res["step_rows"]) if res["step_rows"] else np.zeros(1, np.int64)
    ck = p.metrics(state=False)
    lines = [
        f"  where the time went (threads overlap on {os.cpu_count()} CPU(s), so the parts do not add up to the "
        f"{res['seconds']:.2f} s):",
        f"    engine (the executor running all {len(p.circuit.outputs)} views on W={p.workers}"
        f"{' at the end, rescaled live' if res['rescales'] else ''}, in step()): "
        f"{res['engine_s']:.2f} s, {_rate(int(rows.sum()), res['engine_s'])}; per step median "
        f"{np.median(eng):.1f} ms, p99 {np.percentile(eng, 99):.1f} ms, max {eng.max():.1f} ms, for a median of "
        f"{int(np.median(rows)):,} rows a step" + (
            f"; the worker threads' CPU time {res['cpu_s']:.2f} s" if res["cpu_s"] is not None else ""),
        f"    durability: output log {res['log_s']:.2f} s (in step(): write + fsync, waiting for the step's "
        f"division record); pushes {res['push_s']:.2f} s (producer thread: encode, input log append + fsync); "
        f"{ck['checkpoints']} checkpoint(s) {ck['checkpoint_seconds_sum']:.2f} s (the final one included; the others on a background thread beside "
        f"the steps)",
        f"    producer: generating {res['batches']} batches {res['gen_s']:.2f} s; the stepping thread waited "
        f"{res['wait_s']:.2f} s for acknowledged input",
    ]
    return "\n".join(lines)


def _describe(info: dict) -> str:
    ck = info["checkpoint_step"]
    return (f"checkpoint through step {'?' if ck is None else ck - 1}, input log steps {info['input_steps'][0]}.."
            f"{info['input_steps'][1]}, output steps {info['output_steps'][0]}..{info['output_steps'][1] - 1}")
