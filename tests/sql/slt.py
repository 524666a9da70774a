"""A runner for SQLite's sqllogictest files: each query of a file compiled as a view over the file's tables, fed the
tables' rows in one step, its result checked by the suite's rules.

How a query is judged (every count is one of these kinds):

  pass      the view's rows equal the reference, as a multiset of rows formatted by the query's type letters.
  dialect   the view differs from SQLite but equals DuckDB on the same data and query: a dialect difference the
            README declares (the SQL front end follows DuckDB). Counted per reason ("integer /" when the query
            divides, else "other"), never as a pass.
  refused   compiling the view raised SqlError (unsupported or invalid SQL); the message's first words are kept
            so the refusals can be counted by cause.
  wrong     the view differs from both SQLite and DuckDB: a wrong answer.
  error     compiling or stepping raised anything but SqlError (a bug), or the result had a negative weight.
  timeout   no answer within the time limit (the query runs in a child process, killed at the limit).
  skipped   the record is ``onlyif`` another engine, or the reference itself did not match the file (the
            harness reports the latter as ``reference`` and it should be 0).

The reference is SQLite (Python's sqlite3) running the file's statements and the query; its answer is first checked
against the file (values or ``N values hashing to MD5`` under the record's sort mode), so the reference is the
suite's own expectation. Views are unordered, so the comparison is on the multiset of rows: ``ORDER BY`` of a
``nosort`` query is not checked (the README: a view's rows have no order; ORDER BY ... LIMIT is top-k).

Declared differences applied to the input, not to the answers: SQLite's ``FLOAT`` is an 8-byte float, so table
columns declared FLOAT are created as DOUBLE (the engine's FLOAT is DuckDB's 4-byte REAL); ``CREATE INDEX`` and
``PRIMARY KEY`` only concern SQLite (indexes change no answer).

Command line (from the project root):

    python tests/sql/slt.py tests/sql/sqllogictest/select1.test.gz            # one file, every query
    python tests/sql/slt.py --sample 300 --seed 7 tests/sql/sqllogictest/*.gz  # 300 queries per file
    python tests/sql/slt.py --dir ~/sqllogictest/test --full                  # the whole files named in FULL

The files under tests/sql/sqllogictest are copies of SQLite's public-domain sqllogictest suite (see the README
there); a full checkout of the suite (``--dir``) runs every file of FULL.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import dataclasses
import gzip
import hashlib
import multiprocessing as mp
import os
import random
import re
import sqlite3
import sys
import time
import traceback
from typing import Iterable, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
SUITE = os.path.join(HERE, "sqllogictest")
ENGINE = "dbsp"  # the name ``skipif`` / ``onlyif`` lines test against: no record names it

# the files the issue counts, relative to the suite's test/ directory (globs); the vendored copies are a subset
FULL = ["select1.test", "select2.test", "select3.test", "select4.test", "select5.test", "random/aggregates/*.test",
        "random/groupby/*.test", "index/between/*/*.test", "evidence/in1.test", "evidence/in2.test"]


@dataclasses.dataclass
class Record:
    kind: str  # "statement" or "query"
    sql: str
    line: int
    ok: bool = True  # statement ok / statement error
    types: str = ""
    sort: str = "nosort"
    expected: list[str] | None = None  # values, one per line
    hashed: tuple[int, str] | None = None  # (count, md5) for "N values hashing to H"
    skip: bool = False  # onlyif another engine / skipif this one


def _open(path: str) -> Iterator[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        yield from f


def parse(path: str) -> list[Record]:
    """The records of a sqllogictest file, in order; ``halt`` for this engine ends the list."""
    lines = [ln.rstrip("\n") for ln in _open(path)]
    out: list[Record] = []
    i, n = 0, len(lines)
    while i < n:
        ln = lines[i].strip()
        if not ln or ln.startswith("#"):
            i += 1
            continue
        start, skip = i + 1, False
        while True:  # conditions
            words = lines[i].split("#")[0].split()
            if words and words[0] in ("skipif", "onlyif"):
                applies = words[1] == ENGINE
                skip = skip or (applies if words[0] == "skipif" else not applies)
                i += 1
                continue
            break
        words = lines[i].split("#")[0].split()
        if not words:
            i += 1
            continue
        head = words[0]
        if head == "halt":
            if not skip:
                break
            i += 1
            continue
        if head == "hash-threshold":
            i += 1
            continue
        if head not in ("statement", "query"):
            raise ValueError(f"{path}:{i + 1}: unknown record {lines[i]!r}")
        i += 1
        body: list[str] = []
        while i < n and lines[i].strip() and lines[i].strip() != "----":
            body.append(lines[i])
            i += 1
        rec = Record(head, "\n".join(body), start, skip=skip)
        if head == "statement":
            rec.ok = words[1] == "ok"
        else:
            rec.types = words[1]
            rec.sort = words[2] if len(words) > 2 else "nosort"
            if i < n and lines[i].strip() == "----":
                i += 1
                res: list[str] = []
                while i < n and lines[i].strip():
                    res.append(lines[i].strip())
                    i += 1
                m = re.fullmatch(r"(\d+) values hashing to ([0-9a-f]{32})", res[0]) if len(res) == 1 else None
                if m:
                    rec.hashed = (int(m.group(1)), m.group(2))
                else:  # one value per line (values may hold spaces)
                    rec.expected = res
        out.append(rec)
    return out


# --- values as the suite prints them ------------------------------------------------------------------------------

def _as_int(v: object) -> int:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return int(v) if v == v and abs(v) < 9.3e18 else 0
    if isinstance(v, (bytes, str)):  # SQLite's text to integer: the leading integer, else 0
        m = re.match(r"\s*[-+]?\d+", v.decode() if isinstance(v, bytes) else v)
        return int(m.group()) if m else 0
    return int(v)  # type: ignore[call-overload]


def _as_float(v: object) -> float:
    if isinstance(v, (bytes, str)):
        m = re.match(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", v.decode() if isinstance(v, bytes) else v)
        return float(m.group()) if m else 0.0
    return float(v)  # type: ignore[arg-type]


def fmt(v: object, t: str) -> str:
    """One value as sqllogictest prints it for type letter ``t`` (I integer, R real, T text)."""
    if v is None:
        return "NULL"
    if t == "I":
        return str(_as_int(v))
    if t == "R":
        return "%.3f" % _as_float(v)
    if isinstance(v, float):
        s = repr(v) if v != int(v) or abs(v) >= 1e15 else "%.1f" % v
    elif isinstance(v, bool):
        s = str(int(v))
    elif isinstance(v, bytes):
        s = v.decode(errors="replace")
    else:
        s = str(v)
    if not s:
        return "(empty)"
    return "".join(c if " " <= c <= "~" else "@" for c in s)


def rows_fmt(rows: Iterable[tuple], types: str) -> list[tuple[str, ...]]:
    out = []
    for r in rows:
        if len(r) != len(types):
            raise ValueError(f"{len(r)} columns where the record's types say {len(types)}")
        out.append(tuple(fmt(v, t) for v, t in zip(r, types)))
    return out


def file_matches(rec: Record, rows: list[tuple[str, ...]]) -> bool:
    """Whether rows (in the order the engine gave them) match the record under its sort mode."""
    if rec.sort == "rowsort":
        values = [v for r in sorted(rows) for v in r]
    elif rec.sort == "valuesort":
        values = sorted(v for r in rows for v in r)
    else:
        values = [v for r in rows for v in r]
    if rec.hashed is not None:
        count, h = rec.hashed
        return count == len(values) and hashlib.md5("".join(v + "\n" for v in values).encode()).hexdigest() == h
    return values == (rec.expected or [])


# --- the engine side (run in a child process) ----------------------------------------------------------------------

_FLOAT = re.compile(r"\bFLOAT\b", re.I)


def engine_ddl(create_table: str) -> str:
    """A file's CREATE TABLE as given to the engine and to DuckDB (the declared FLOAT difference)."""
    return _FLOAT.sub("DOUBLE", create_table)


def _arrow_tables(ddl: str, rows: dict[str, list[tuple]]):
    import pyarrow as pa

    from dbsp_core import sql

    c = sql.compile(ddl)
    tables = {}
    for name, td in c.sql.tables.items():  # type: ignore[attr-defined]
        cols = list(zip(*rows.get(name, []))) or [[] for _ in td.schema]
        arrays = []
        for f, col in zip(td.schema, cols):
            vals = list(col)
            if pa.types.is_integer(f.type):
                vals = [None if v is None else _as_int(v) for v in vals]
            elif pa.types.is_floating(f.type):
                vals = [None if v is None else _as_float(v) for v in vals]
            elif pa.types.is_string(f.type):
                vals = [None if v is None else (v if isinstance(v, str) else fmt(v, "T")) for v in vals]
            arrays.append(pa.array(vals, type=f.type))
        tables[name] = pa.Table.from_arrays(arrays, schema=td.schema)
    return tables


MEMORY = int(float(os.environ.get("DBSP_SLT_MEMORY_GB", "3")) * 2**30)  # a child's resident memory (see _wait)


def _rss(pid: int) -> int:
    """A process's resident set size in bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _wait(conn, proc, timeout: float) -> str:
    """Waits for the child's next message: "ready" when it can be read, "timeout" after ``timeout`` seconds,
    "memory" once the child's resident memory passes MEMORY (checked every 20 ms).

    The limit is watched from outside rather than set with RLIMIT_AS: under an address-space cap every library in
    the child (DuckDB, Arrow's allocator, OpenBLAS) meets a failed allocation at a point of its own choosing, and
    some of them abort or crash there, which made a plan too large to run look like a crash of the engine."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if conn.poll(max(0.0, min(0.02, left))):
            return "ready"
        if _rss(proc.pid) > MEMORY:
            return "memory"
        if left <= 0:
            return "timeout"


def _child(conn, log: str) -> None:
    """Answers jobs until it gets None: ``("load", ddl, rows, workers)`` replaces the tables (in the engine's Arrow
    form and in a new DuckDB database) and says "ready"; ``("view", sql, types)`` -> ``(kind, detail, rows)`` with
    kind answer / refused / error / timeout; ``("duckdb", sql, types)`` -> DuckDB's rows, or None when DuckDB refuses
    the query. One child serves every group of queries and every file of a process (ChildProcess) until it is killed
    (time or memory limit) or dies; only then does a new one start (each start imports dbsp_core, DuckDB and Arrow:
    about 1.3 CPU s, which was most of a sample run's time when every group had a child of its own).

    The parent kills it when its resident memory passes DBSP_SLT_MEMORY_GB (default 3, see _wait): a plan that
    builds a product of many tables counts as a timeout, a plan too slow to finish, instead of taking the machine.
    Its stderr goes to ``log``, with Python's stacks if it crashes (faulthandler)."""
    import faulthandler

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    faulthandler.enable()
    import duckdb

    import dbsp_core as dbsp
    from dbsp_core.sql import SqlError

    ddl, tables, workers, duck = "", {}, 1, None
    while (job := conn.recv()) is not None:
        what = job[0]
        if what == "load":
            _, ddl, rows, workers = job
            tables = _arrow_tables(ddl, rows)
            if duck is not None:
                duck.close()
            duck = duckdb.connect()
            duck.execute("SET threads TO 1")
            for name, t in tables.items():
                duck.register(f"__arrow_{name}", t)
                duck.execute(f"CREATE TABLE {name} AS SELECT * FROM __arrow_{name}")
                duck.unregister(f"__arrow_{name}")
            conn.send("ready")
            continue
        _, query, types = job
        if what == "duckdb":
            try:
                conn.send(rows_fmt(duck.execute(query).fetchall(), types))
            except Exception:  # noqa: BLE001 - DuckDB refuses the query: there is no DuckDB answer
                conn.send(None)
            continue
        try:
            try:
                c = dbsp.sql.compile(f"{ddl};\nCREATE VIEW slt_q AS {query}")
            except SqlError as e:
                conn.send(("refused", str(e), None))
                continue
            with dbsp.Pipeline(c, workers=workers) as p:
                for name, t in tables.items():
                    if t.num_rows:
                        p.push(name, t)
                out = p.step()["slt_q"].to_dict()
            if any(w < 0 for w in out.values()):
                conn.send(("error", "negative weight in a view over inserts only", None))
                continue
            conn.send(("answer", "", rows_fmt([r for r, w in out.items() for _ in range(w)], types)))
        except Exception as e:  # noqa: BLE001 - reported as an error of this query, the child goes on
            detail = f"{type(e).__name__}: {e}"
            if os.environ.get("DBSP_SLT_TRACEBACK"):
                detail += "\n" + traceback.format_exc()
            conn.send(("error", detail, None))


class ChildProcess:
    """The child that answers a process's queries (_child), with its stderr log; ``get()`` gives the running one or
    starts one. A child is dropped (``kill``) after a time or memory limit or a crash, and when its resident memory
    at the start of a group is over half the limit (what earlier files left in its heap must not count against the
    next file's queries)."""

    current: "ChildProcess | None" = None

    def __init__(self) -> None:
        import tempfile

        ctx = mp.get_context("spawn")
        self.tmp = tempfile.mkdtemp(prefix="slt-")
        self.log = os.path.join(self.tmp, "child.stderr")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, self.log), daemon=True)
        self.proc.start()
        child.close()

    @classmethod
    def get(cls) -> "ChildProcess":
        c = cls.current
        if c is not None and (not c.proc.is_alive() or _rss(c.proc.pid) > MEMORY // 2):
            c.kill()
            c = None
        if c is None:
            c = cls.current = cls()
        return c

    def log_size(self) -> int:
        try:
            return os.path.getsize(self.log)
        except OSError:  # not opened yet: the child is still starting
            return 0

    def log_from(self, offset: int) -> str:
        """What the child wrote to stderr from ``offset`` on (its crash report)."""
        if not os.path.exists(self.log):  # the child died before it opened it
            return ""
        with open(self.log, errors="replace") as f:
            f.seek(offset)
            return f.read()

    def kill(self, busy: bool = False) -> None:
        """Ends the child: killed at once when it is ``busy`` (it cannot take the None that ends it), else asked to
        stop and killed if it has not stopped in 2 s."""
        import shutil

        if busy and self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(2)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        self.conn.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        if ChildProcess.current is self:
            ChildProcess.current = None


def _stop_child() -> None:
    if ChildProcess.current is not None:
        ChildProcess.current.kill()


atexit.register(_stop_child)


@dataclasses.dataclass
class Outcome:
    file: str
    line: int
    sql: str
    kind: str
    detail: str = ""


def _reason(detail: str) -> str:
    """A refusal's cause, for counting: the message without its location and quoted names."""
    s = re.sub(r"^line \d+, column \d+: ", "", detail.splitlines()[0] if detail else "")
    s = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", s)
    return s[:90]


class Runner:
    """Runs the queries of files; ``outcomes`` collects one Outcome per query record met."""

    def __init__(self, timeout: float = 10.0, workers: int = 1, progress: bool = False) -> None:
        self.timeout, self.workers, self.progress = timeout, workers, progress
        self.outcomes: list[Outcome] = []

    def run_file(self, path: str, sample: int | None = None, rng: random.Random | None = None) -> None:
        records = parse(path)
        queries = [i for i, r in enumerate(records) if r.kind == "query"]
        chosen = set(queries)
        if sample is not None and sample < len(queries):
            chosen = set((rng or random.Random()).sample(queries, sample))
        name = os.path.relpath(path, SUITE) if path.startswith(SUITE) else path
        db = sqlite3.connect(":memory:")
        creates: dict[str, str] = {}
        pending: list[tuple[int, Record, list[tuple[str, ...]]]] = []
        for i, rec in enumerate(records):
            if rec.kind == "statement":
                if pending:
                    self._answer(name, pending, creates, db)
                    pending = []
                if rec.skip:
                    continue
                try:
                    db.execute(rec.sql)
                    db.commit()
                except sqlite3.Error:
                    continue  # statement error records, or SQLite-only statements: the reference's state is SQLite's
                m = re.match(r"\s*CREATE\s+TABLE\s+(\w+)", rec.sql, re.I)
                if m:
                    creates[m.group(1).lower()] = rec.sql
                m = re.match(r"\s*DROP\s+TABLE\s+(?:IF\s+EXISTS\s+)?(\w+)", rec.sql, re.I)
                if m:
                    creates.pop(m.group(1).lower(), None)
                continue
            if i not in chosen:
                continue
            if rec.skip:
                self.outcomes.append(Outcome(name, rec.line, rec.sql, "skipped", "onlyif/skipif"))
                continue
            try:
                ref = rows_fmt(db.execute(rec.sql).fetchall(), rec.types)
            except (sqlite3.Error, ValueError) as e:
                self.outcomes.append(Outcome(name, rec.line, rec.sql, "skipped", f"reference: SQLite: {e}"))
                continue
            if not file_matches(rec, ref):
                self.outcomes.append(Outcome(name, rec.line, rec.sql, "skipped", "reference: SQLite != file"))
                continue
            pending.append((i, rec, ref))
        if pending:
            self._answer(name, pending, creates, db)

    def _answer(self, name: str, pending: list, creates: dict[str, str], db: sqlite3.Connection) -> None:
        """The engine's answers to the pending queries, from the process's child (ChildProcess) given the current
        tables first (a new child after one is killed at the time limit or dies)."""
        ddl = ";\n".join(engine_ddl(s) for s in creates.values())
        rows = {t: db.execute(f"SELECT * FROM {t}").fetchall() for t in creates}
        todo = list(pending)
        while todo:
            ch = ChildProcess.get()
            mark = ch.log_size()
            parent, proc = ch.conn, ch.proc
            try:
                parent.send(("load", ddl, rows, self.workers))
                if not parent.poll(120) or parent.recv() != "ready":
                    raise EOFError("the child did not load the tables in 120 s")
                while todo:
                    _, rec, ref = todo[0]
                    parent.send(("view", rec.sql, rec.types))
                    waited = _wait(parent, proc, self.timeout)
                    if waited != "ready":
                        todo.pop(0)
                        self.outcomes.append(Outcome(name, rec.line, rec.sql, "timeout",
                                                     f"no answer in {self.timeout:g} s" if waited == "timeout"
                                                     else f"over the memory limit ({MEMORY / 2**30:g} GiB)"))
                        ch.kill(busy=True)
                        break
                    kind, detail, got = parent.recv()
                    todo.pop(0)
                    ddb, busy = None, False
                    if kind == "answer" and collections.Counter(got) != collections.Counter(ref):
                        parent.send(("duckdb", rec.sql, rec.types))
                        busy = _wait(parent, proc, self.timeout) != "ready"  # too slow, or over the limit
                        ddb = None if busy else parent.recv()
                    self.outcomes.append(self._judge(name, rec, ref, kind, detail, got, ddb))
                    if busy:
                        ch.kill(busy=True)
                        break
                    if self.progress and len(self.outcomes) % 500 == 0:
                        print(f"  {len(self.outcomes)} queries ...", file=sys.stderr, flush=True)
            except (EOFError, OSError) as e:  # the child died: a crash, reported with its stderr's first lines
                proc.join(5)
                err = ch.log_from(mark)
                _, rec, _ = todo.pop(0)
                self.outcomes.append(Outcome(name, rec.line, rec.sql, "error",
                                             f"child died: {e!r}, exit {proc.exitcode}, {err.strip()[:1500]}"))
                ch.kill()
            except BaseException:  # an error of the parent's (or ^C): the child may owe an answer, never reuse it
                ch.kill(busy=True)
                raise

    @staticmethod
    def _judge(name: str, rec: Record, ref: list, kind: str, detail: str, got, ddb) -> Outcome:
        if kind != "answer":
            return Outcome(name, rec.line, rec.sql, kind, detail)
        if collections.Counter(got) == collections.Counter(ref):
            return Outcome(name, rec.line, rec.sql, "pass")
        if ddb is not None and collections.Counter(got) == collections.Counter(ddb):
            why = "integer /" if "/" in rec.sql else "other"
            return Outcome(name, rec.line, rec.sql, "dialect", why)
        diff_got = collections.Counter(got) - collections.Counter(ref)
        diff_ref = collections.Counter(ref) - collections.Counter(got)
        return Outcome(name, rec.line, rec.sql, "wrong",
                       f"only ours: {list(diff_got.elements())[:4]}; only SQLite: {list(diff_ref.elements())[:4]}"
                       f"; DuckDB {'refuses' if ddb is None else 'differs from both'}")

    def counts(self) -> collections.Counter:
        return collections.Counter(o.kind for o in self.outcomes)

    def table(self) -> str:
        """Counts per file and kind, then refusals by cause."""
        kinds = ["pass", "dialect", "refused", "wrong", "error", "timeout", "skipped"]
        per: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for o in self.outcomes:
            per[o.file][o.kind] += 1
        lines = ["| file | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
        for f in sorted(per):
            lines.append(f"| {f} | " + " | ".join(str(per[f][k]) for k in kinds) + " |")
        tot = self.counts()
        lines.append("| all | " + " | ".join(str(tot[k]) for k in kinds) + " |")
        for kind in ("dialect", "refused", "error", "skipped"):
            causes = collections.Counter(_reason(o.detail) for o in self.outcomes if o.kind == kind)
            if causes:
                lines.append(f"\n{kind} by cause:")
                lines += [f"  {n:6d}  {c}" for c, n in causes.most_common(25)]
        return "\n".join(lines)


def vendored() -> list[str]:
    out = []
    for root, _, files in os.walk(SUITE):
        out += [os.path.join(root, f) for f in files if f.endswith((".test", ".test.gz"))]
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    import glob

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="sqllogictest files (.test or .test.gz); default: the vendored ones")
    ap.add_argument("--dir", help="a checkout of the suite's test/ directory")
    ap.add_argument("--full", action="store_true", help="with --dir: every file of FULL")
    ap.add_argument("--sample", type=int, help="queries drawn per file (default: all)")
    ap.add_argument("--seed", type=int, default=random.SystemRandom().randrange(2**31))
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per query (default 10)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--show", default="wrong,error", help="kinds whose queries are printed (default wrong,error)")
    a = ap.parse_args(argv)
    files = list(a.files)
    if a.dir and a.full:
        for g in FULL:
            files += sorted(glob.glob(os.path.join(a.dir, g)))
    files = files or vendored()
    print(f"sqllogictest: {len(files)} files, seed {a.seed}, sample {a.sample or 'all'}, W={a.workers}, "
          f"timeout {a.timeout:g} s", flush=True)
    r = Runner(timeout=a.timeout, workers=a.workers, progress=True)
    rng = random.Random(a.seed)
    for f in files:
        t0 = time.monotonic()
        before = len(r.outcomes)
        r.run_file(f, a.sample, rng)
        print(f"{f}: {len(r.outcomes) - before} queries in {time.monotonic() - t0:.0f} s", flush=True)
    show = set(a.show.split(","))
    for o in r.outcomes:
        if o.kind in show:
            print(f"\n[{o.kind}] {o.file}:{o.line}\n{o.sql}\n  -> {o.detail}")
    print("\n" + r.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
