"""The concurrency harness of issue 29: threads issuing random public operations (push, step, queue_step + run_queued, checkpoint, rescale, discard, read_output, metrics, view, query, profile, upsert and delete into a table with a primary key, close) on one pipeline, a plain-Python model of every acknowledged push, and the check of the output log's integral (or, in memory, of the returned steps) against it.

The keyed table ``u`` takes upserts (a pandas DataFrame or a list of tuples) and deletes by key; each thread
owns its own keys (``t * 100 + 0..7``), so the last operation of a key is the last one its thread made, whatever
the other threads do: the model applies each thread's acknowledged ``u`` operations in the order it made them.

An operation may refuse with a typed error (``DbspError`` and its subclasses; ``KeyError`` from ``discard`` of a
push that is not waiting) and change nothing; anything else, or a pipeline left broken, is a failure.
"""

from __future__ import annotations

import os
import random
import threading
from collections import Counter
from typing import Any, Callable

import pyarrow as pa

import dbsp_core as dbsp
from dbsp_core.errors import DbspError, StorageError
from dbsp_core.runtime import StagedExecutor

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])
KEYS = 200
U_KEYS = 8  # keys of table u per thread
SHARD_BITS = 4
MODES = ("memory", "durable", "staged")
OPS = ("push", "push", "push", "push_many", "step", "queue", "checkpoint", "rescale", "discard", "read", "metrics", "view",
       "query", "upsert", "upsert", "profile", "close")


def circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    g = t.group_by("k").agg(n=dbsp.count(), s=dbsp.sum("v"))
    c.output("g", g, materialized=True)  # view and query read its contents while other threads step
    c.output("gi", g.integrate())  # the whole view at every step: what memory mode checks (outputs of queued
    u = c.input("u", SCHEMA, primary_key=["k"])  # steps that a step() runs are not returned to anyone)
    c.output("uv", u, materialized=True)
    return c


def u_producer(run: int, t: int) -> str:
    """The producer of thread ``t``'s operations on table ``u`` in run ``run``."""
    return f"r{run}t{t}u"


def u_op(seed: int, producer: str, seq: int) -> tuple[str, Any]:
    """Operation ``seq`` of ``producer`` on table ``u``: ``("upsert", rows)`` (a pandas DataFrame or a list of
    tuples) or ``("delete", keys)``, on the keys of the producer's thread only."""
    t = int(producer.rsplit("t", 1)[1][:-1])
    rng = random.Random(f"{seed}/{producer}/{seq}/u")
    keys = sorted(rng.sample(range(U_KEYS), rng.randint(1, 3)))
    ks = [t * 100 + k for k in keys]
    if rng.random() < 0.3:
        return "delete", ks
    vs = [rng.randrange(-50, 50) for _ in ks]
    if rng.random() < 0.5:
        import pandas as pd

        return "upsert", pd.DataFrame({"k": ks, "v": vs})
    return "upsert", list(zip(ks, vs))


def apply_u(p: dbsp.Pipeline, seed: int, producer: str, seq: int, durable: bool) -> Any:
    """Make operation ``seq`` of ``producer`` on ``u`` (with producer and seq when ``durable``)."""
    kind, data = u_op(seed, producer, seq)
    ids = {"producer": producer, "seq": seq} if durable else {}
    return (p.delete if kind == "delete" else p.push)("u", data, **ids)


def model_u(ops: list[tuple[int, str, int]]) -> Counter:
    """Table ``u`` after the operations ``(seed, producer, seq)``, each producer's in seq order and producers of
    one thread in run order (a thread's keys are its own), as a multiset of rows {(k, v): 1}."""
    def order(op: tuple[int, str, int]) -> tuple[int, int]:
        return int(op[1][1:].split("t", 1)[0]), op[2]

    table: dict[int, int] = {}
    for seed, producer, seq in sorted(ops, key=order):
        kind, data = u_op(seed, producer, seq)
        if kind == "delete":
            for k in data:
                table.pop(k, None)
        else:
            rows = list(zip(data["k"], data["v"])) if hasattr(data, "columns") else data
            table.update((int(k), int(v)) for k, v in rows)
    return Counter({(k, v): 1 for k, v in table.items()})


def executor(mode: str) -> StagedExecutor | None:
    return StagedExecutor() if mode == "staged" else None


def _rows(seed: int, producer: str, seq: int) -> tuple[list[int], list[int]]:
    rng = random.Random(f"{seed}/{producer}/{seq}")
    n = rng.randint(1, 6)
    return [rng.randrange(KEYS) for _ in range(n)], [rng.randrange(-20, 20) for _ in range(n)]


def batch(seed: int, producer: str, seq: int) -> dbsp.ZSet:
    """The push ``(producer, seq)`` of a run: a few rows, and for an odd seq also the retraction of the first
    row of the producer's push ``seq - 1`` (acknowledged before this one is made; only odd seqs are ever
    discarded, so the net multiset of rows never goes below 0)."""
    ks, vs = _rows(seed, producer, seq)
    ws = [1] * len(ks)
    if seq % 2:
        pk, pv = _rows(seed, producer, seq - 1)
        ks, vs, ws = ks + pk[:1], vs + pv[:1], ws + [-1]
    return dbsp.ZSet.from_rows(list(zip(ks, vs)), SCHEMA, weights=ws)


def model(pushes: list[tuple[int, str, int]]) -> Counter:
    """The view ``g`` over the pushes ``(seed, producer, seq)``, as a multiset of rows {(k, count, sum): 1}."""
    acc: dict[int, list[int]] = {}
    for seed, producer, seq in pushes:
        z = batch(seed, producer, seq)
        t = z.to_arrow()
        for k, v, w in zip(t.column("k").to_pylist(), t.column("v").to_pylist(), t.column("weight").to_pylist()):
            a = acc.setdefault(k, [0, 0])
            a[0] += w
            a[1] += v * w
    return Counter({(k, n, s): 1 for k, (n, s) in acc.items() if n})


def log_integral(p: dbsp.Pipeline, output: str = "g") -> Counter:
    acc: Counter = Counter()
    for _, z in p.read_output(output):
        acc.update(z.to_dict())
    return Counter({r: w for r, w in acc.items() if w})  # a negative weight stays: it is a defect too


def differ(got: Counter, want: Counter) -> str:
    """What differs between two integrals (weights may be negative), a few rows of each side."""
    only = {r: w - want.get(r, 0) for r, w in got.items() if want.get(r, 0) != w}
    miss = {r: w for r, w in want.items() if r not in got}
    return f"{len(only)} rows differ or only in the pipeline {dict(list(only.items())[:6])}, " \
           f"{len(miss)} only in the model {dict(list(miss.items())[:6])}"


class Round:
    """One round: ``threads`` threads each issuing ``ops`` random operations on one pipeline in ``mode``.

    ``on_ack(producer, seq)`` / ``on_try`` / ``on_discard`` / ``on_refused`` (a push or u operation refused with a
    typed error, which changed nothing) let a kill-test child record what happened durably.
    """

    def __init__(self, mode: str, seed: int, d: str | None, threads: int = 3, ops: int = 12, run: int = 0,
                 on_try: Callable[[str, int], None] | None = None,
                 on_ack: Callable[[str, int], None] | None = None,
                 on_discard: Callable[[str, str, int], None] | None = None, allow_close: bool = True,
                 on_refused: Callable[[str, int], None] | None = None) -> None:
        self.mode, self.seed, self.d, self.threads, self.ops, self.run = mode, seed, d, threads, ops, run
        self.on_try, self.on_ack, self.on_discard, self.on_refused = on_try, on_ack, on_discard, on_refused
        self.allow_close = allow_close
        self.acked: list[tuple[int, str, int]] = []
        self.u_acked: list[tuple[int, str, int]] = []  # operations on the keyed table u
        self.discarded: set[tuple[str, int]] = set()
        self.outs: Counter = Counter()  # the sum of every output ``g`` a step or run_queued returned
        self.counts: Counter = Counter()
        self.refusals: Counter = Counter()  # "op: error: message start" -> how often
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.closed_by_op = False

    def open(self, workers: int = 2) -> dbsp.Pipeline:
        if self.d is None:
            return dbsp.Pipeline(circuit(), workers=workers, shard_bits=SHARD_BITS, checkpoint_interval=None)
        if os.path.exists(os.path.join(self.d, "META")):
            return dbsp.Pipeline.open(self.d, circuit(), executor=executor(self.mode), checkpoint_interval=0.2)
        return dbsp.Pipeline(circuit(), workers=workers, shard_bits=SHARD_BITS, storage=self.d,
                             executor=executor(self.mode), checkpoint_interval=0.2)

    def _refused(self, op: str, e: BaseException) -> None:
        with self.lock:
            self.counts["refused"] += 1
            self.counts[f"refused_{op}"] += 1
            self.refusals[f"{op}: {type(e).__name__}: {str(e)[:70]}"] += 1
            if "broken" in str(e):
                self.failures.append(f"{op}: the pipeline is broken: {e!r}")

    def _one(self, p: dbsp.Pipeline, t: int, rng: random.Random, state: dict) -> None:
        op = rng.choice(OPS)
        durable = self.d is not None
        made: list[tuple[str, int]] = []  # the pushes or u operation tried, for on_refused
        try:
            if op == "push":
                producer, seq = f"r{self.run}t{t}", state["seq"]
                if self.on_try:
                    self.on_try(producer, seq)
                made.append((producer, seq))
                state["seq"] += 1
                z = batch(self.seed, producer, seq)
                if durable:
                    ack = p.push("t", z, producer=producer, seq=seq)
                    assert ack is not None and not ack.duplicate, ack
                else:
                    p.push("t", z)
                with self.lock:
                    self.acked.append((self.seed, producer, seq))
                    state["mine"].append(seq)
                if self.on_ack:
                    self.on_ack(producer, seq)
            elif op == "push_many":  # two pushes of one producer in one call: recorded together, one fsync
                producer = f"r{self.run}t{t}"
                seqs = [state["seq"], state["seq"] + 1]
                state["seq"] += 2
                for seq in seqs:
                    if self.on_try:
                        self.on_try(producer, seq)
                    made.append((producer, seq))
                if durable:
                    acks = p.push_many([{"handle": "t", "data": batch(self.seed, producer, seq), "producer": producer,
                                         "seq": seq} for seq in seqs])
                    assert all(a is not None and not a.duplicate for a in acks), acks
                else:
                    assert p.push_many([("t", batch(self.seed, producer, seq)) for seq in seqs]) == [None, None]
                with self.lock:
                    self.acked.extend((self.seed, producer, seq) for seq in seqs)
                    state["mine"].extend(seqs)
                for seq in seqs:
                    if self.on_ack:
                        self.on_ack(producer, seq)
            elif op == "upsert":
                producer, seq = u_producer(self.run, t), state["useq"]
                if self.on_try:
                    self.on_try(producer, seq)
                made.append((producer, seq))
                state["useq"] += 1
                ack = apply_u(p, self.seed, producer, seq, durable)
                assert (ack is not None and not ack.duplicate) if durable else ack is None, ack
                with self.lock:
                    self.u_acked.append((self.seed, producer, seq))
                if self.on_ack:
                    self.on_ack(producer, seq)
            elif op == "profile":
                prof = p.profile(state=rng.random() < 0.5)
                assert prof is not None
            elif op == "step":
                out = p.step()
                with self.lock:
                    self.outs.update(out["g"].to_dict())
            elif op == "queue":
                p.queue_step()
                if rng.random() < 0.7:
                    outs = p.run_queued()
                    with self.lock:
                        for o in outs:
                            self.outs.update(o["g"].to_dict())
            elif op == "checkpoint":
                p.checkpoint(wait=rng.random() < 0.7)
            elif op == "rescale":
                p.rescale(rng.randint(1, 3), batch_shards=rng.randint(1, 16))
            elif op == "discard":
                odd = [q for q in state["mine"] if q % 2]  # only odd seqs are discarded (see batch)
                if not durable or not odd:
                    p.discard("nobody", 0)  # names no push: KeyError, nothing changes
                else:
                    producer, seq = f"r{self.run}t{t}", rng.choice(odd)
                    if self.on_discard:
                        self.on_discard("try", producer, seq)
                    p.discard(producer, seq)  # KeyError unless it waits for a step: then it is dropped
                    with self.lock:
                        self.discarded.add((producer, seq))
                    if self.on_discard:
                        self.on_discard("done", producer, seq)
            elif op == "read":
                if durable:
                    sum(1 for _ in p.read_output("g", from_step=rng.randint(0, 5)))
                else:
                    p.read_output("g")  # in memory: refused (DbspError)
            elif op == "metrics":
                m = p.metrics()
                assert isinstance(m, dict) and "steps" in m, m
            elif op == "view":  # one row per group: a read torn by a step running meanwhile would show more
                t = p.view("g")
                assert t.column_names == ["k", "n", "s"], t.schema
                assert len(set(t.column("k").to_pylist())) == t.num_rows, t.to_pylist()[:10]
            elif op == "query":
                q = p.query("SELECT count(*) AS r, count(DISTINCT k) AS ks, sum(n) AS n FROM g").to_pylist()[0]
                assert q["r"] == q["ks"], q
            elif op == "close":
                if not (self.allow_close and durable and rng.random() < 0.1):
                    return
                p.close()
                with self.lock:
                    self.closed_by_op = True
            with self.lock:
                self.counts["ops"] += 1
                self.counts[op] += 1
        except (DbspError, KeyError) as e:
            if isinstance(e, StorageError) or (isinstance(e, KeyError) and op != "discard"):  # no refusal
                self._fail(op, e)
            else:
                self._refused(op, e)
                for m in made if self.on_refused else ():
                    self.on_refused(*m)
        except BaseException as e:  # anything else is a defect
            self._fail(op, e)

    def _fail(self, op: str, e: BaseException) -> None:
        import traceback

        with self.lock:
            self.failures.append(f"{op}: {type(e).__name__}: {e}\n{''.join(traceback.format_exception(e))[-1500:]}")

    def _check_view(self, p: dbsp.Pipeline, want: Counter, output: str = "g") -> None:
        t = p.view(output)
        got = Counter(zip(*[t.column(i).to_pylist() for i in range(t.num_columns)]))
        if got != want:
            self.failures.append(f"the materialized view {output} differs from the model: {differ(got, want)}")

    def go(self, p: dbsp.Pipeline) -> None:
        """Run the threads to their end."""
        start = threading.Barrier(self.threads)

        def worker(t: int) -> None:
            rng = random.Random(f"{self.seed}/{self.run}/ops/{t}")
            state = {"seq": 0, "useq": 0, "mine": []}
            try:
                start.wait()
            except threading.BrokenBarrierError:
                return
            for _ in range(self.ops):
                self._one(p, t, rng, state)

        ths = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(self.threads)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(timeout=300)
        if any(th.is_alive() for th in ths):
            self.failures.append("a thread still runs after 300 s (a hang)")

    def check(self, p: dbsp.Pipeline | None) -> None:
        """After :meth:`go`: in memory, step once more and compare the returned steps with the model; durable,
        close (if no operation did), reopen, step once (the pushes acknowledged after the last step) and compare
        the output log's integral with the model. Appends to ``failures``."""
        want = model([a for a in self.acked if (a[1], a[2]) not in self.discarded])
        want_u = model_u(self.u_acked)
        if self.d is None:
            assert p is not None
            got = Counter({r: w for r, w in p.step()["gi"].to_dict().items() if w})
            self._check_view(p, want)
            self._check_view(p, want_u, "uv")
            p.close()
        else:
            if p is not None and not self.closed_by_op:
                p.close()
            q = self.open()
            try:
                q.step()
                got = log_integral(q)
                self._check_view(q, want)
                self._check_view(q, want_u, "uv")
                if log_integral(q, "uv") != want_u:
                    self.failures.append(f"the output log of uv differs from the model of {len(self.u_acked)} "
                                         f"operations: {differ(log_integral(q, 'uv'), want_u)}")
            finally:
                q.close()
        if got != want:
            self.failures.append(f"the integral differs from the model of the {len(self.acked)} acknowledged pushes "
                                 f"({len(self.discarded)} discarded): {differ(got, want)}; counts {dict(self.counts)}")
