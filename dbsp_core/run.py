"""``dbsp run pipeline.sql --storage DIR``: a durable pipeline defined in SQL alone, its sources and sinks the connectors its tables and views declare, run until Ctrl-C and resumed exactly once by the next run.

Invariants:
  1. The program is compiled and every connector checked (sql/connectors.py) before anything is opened: an error
     is printed as ``FILE:LINE:COLUMN: message`` (exit status 2) and the storage directory is not touched.
  2. One loop: each source pushes what is new (a files source at most ``--files-per-step`` files), a step runs
     when something was pushed, then every sink writes the steps it lacks; the loop waits (or, with
     ``--until-idle``, ends) only when no source has anything pending. The sources' pushes carry
     ``(producer, seq)`` identities and the sinks record the step they hold (connectors/), so a crash anywhere,
     or a stop, and a later run give each input row once and each output step once.
  3. Ctrl-C (SIGINT) or SIGTERM asks the loop to stop: the step under way finishes, the sinks catch up, the
     pipeline checkpoints and closes, and the run exits with status 0 saying the step it stopped at. A second
     Ctrl-C stops at once (KeyboardInterrupt); the next run still resumes exactly once (invariant 2), by
     recovery instead of from the checkpoint.
  4. Relative paths in connector options are relative to the SQL file's directory, so the same file names the
     same directories from any working directory (a files source's identity is its directory's real path).
  5. Progress goes to stdout, one line per step that had input; options holding credentials are never printed
     (sql/connectors.py invariant 3), also not inside a connector's error message.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import Any

__all__ = ["run", "add_arguments"]

_FORMATS = {"parquet": (".parquet", ".pq"), "csv": (".csv",), "jsonl": (".jsonl", ".json", ".ndjson")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``dbsp run``."""
    p.add_argument("file", help="the SQL program: CREATE TABLE ... WITH (connector ...) and CREATE VIEW statements")
    p.add_argument("--storage", required=True, metavar="DIR",
                   help="the pipeline's storage directory (created by the first run, resumed by the next)")
    p.add_argument("--workers", type=int, default=None,
                   help="worker threads (default: 1 for a new directory, the stored count when resuming)")
    p.add_argument("--files-per-step", type=int, default=16, metavar="N",
                   help="files a files source pushes per step at most (default 16)")
    p.add_argument("--poll", type=float, default=1.0, metavar="SECONDS",
                   help="how long to wait when no source has anything new (default 1)")
    p.add_argument("--checkpoint-interval", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between checkpoints (default 10)")
    p.add_argument("--until-idle", action="store_true",
                   help="stop once no source has anything new and every sink holds every step (a batch run)")


class _Stop:
    """Invariant 3: the first SIGINT/SIGTERM asks the loop to stop, a second one interrupts."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def __call__(self, signum: int, frame: Any) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        self.event.set()
        print(f"{signal.Signals(signum).name}: stopping after this step (Ctrl-C again to stop at once)", flush=True)


def _path(base: str, value: str) -> str:
    """Invariant 4: a relative path is relative to the SQL file's directory; a URI is kept."""
    return value if "://" in value or os.path.isabs(value) else os.path.join(base, value)


def _source(p: Any, conn: Any, base: str) -> Any:
    from dbsp_core.connectors import FileSource, PostgresSource

    o = conn.options
    if conn.connector == "files":
        kw: dict[str, Any] = {"recursive": conn.flag("recursive"), "on_error": o.get("on_error", "raise"),
                              "name": o.get("name")}
        if "format" in o:
            kw["formats"] = _FORMATS[o["format"]]
        return FileSource(p, conn.name, _path(base, o["path"]), **kw)
    return PostgresSource(p, conn.name, o["dsn"], o.get("table", conn.name), where=o.get("where"),
                          name=o.get("name"))


def _sink(p: Any, conn: Any, base: str) -> Any:
    from dbsp_core.connectors import DeltaSink, ParquetSink, PostgresSink, SqliteSink

    o = conn.options
    if conn.connector == "parquet":
        return ParquetSink(p, conn.name, _path(base, o["path"]), skip_empty=conn.flag("skip_empty"))
    if conn.connector == "sqlite":
        os.makedirs(os.path.dirname(_path(base, o["path"])) or ".", exist_ok=True)
        return SqliteSink(p, conn.name, _path(base, o["path"]), table=o.get("table"))
    if conn.connector == "postgres":
        return PostgresSink(p, conn.name, o["dsn"], table=o.get("table"))
    storage = {k[len("storage."):]: v for k, v in o.items() if k.startswith("storage.")}
    key = [k.strip() for k in o["key"].split(",")] if "key" in o else None
    return DeltaSink(p, conn.name, _path(base, o["path"]), mode=o.get("mode", "append"), key=key,
                     storage_options=storage or None)


def _scrub(text: str, conns: dict) -> str:
    """``text`` without any credential the connectors were given (invariant 5): a secret option's value, and a
    DSN's password."""
    from dbsp_core.connectors.postgres import scrub

    for c in conns.values():
        for k, v in c.options.items():
            if c.secret(k) and v:
                text = scrub(text, v) if k == "dsn" else text
                text = text.replace(v, "***")
    return text


def _poll(src: Any, files_per_step: int) -> int:
    from dbsp_core.connectors import FileSource

    return src.poll(files_per_step) if isinstance(src, FileSource) else src.poll()


def _changes(out: dict, shown: int = 6) -> str:
    """The rows a step inserted and deleted per view, for the first ``shown`` views that changed."""
    parts = []
    for name, z in sorted(out.items()):
        w = z.weights
        ins, dels = int(w[w > 0].sum()), int(-w[w < 0].sum())
        if ins or dels:
            parts.append(f"{name} +{ins:,} -{dels:,}")
    more = f" and {len(parts) - shown} more views" if len(parts) > shown else ""
    return ", ".join(parts[:shown]) + more or "no changes"


def run(args: argparse.Namespace) -> int:
    """``dbsp run`` (module docstring); returns the exit status."""
    stop = _Stop()
    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run(args, stop.event)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _run(args: argparse.Namespace, stop: threading.Event) -> int:
    import dbsp_core as dbsp
    from dbsp_core.errors import DbspError
    from dbsp_core.sql import SqlError, compile
    from dbsp_core.storage.formats import META_FILE

    for flag, v in (("--workers", args.workers), ("--files-per-step", args.files_per_step)):
        if v is not None and v < 1:
            print(f"error: {flag} must be at least 1, got {v}", file=sys.stderr)
            return 2
    try:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        print(f"error: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    try:
        circuit = compile(text)  # invariant 1: every connector checked before anything opens
    except SqlError as e:
        print(f"{args.file}:{e.line}:{e.column}: {str(e).split(': ', 1)[-1]}", file=sys.stderr)
        return 2
    conns = circuit.sql.connectors  # type: ignore[attr-defined]
    base = os.path.dirname(os.path.abspath(args.file))
    resume = os.path.exists(os.path.join(args.storage, META_FILE))
    if resume:
        p = dbsp.Pipeline.open(args.storage, circuit, workers=args.workers,
                               checkpoint_interval=args.checkpoint_interval)
    else:
        p = dbsp.Pipeline(circuit, workers=args.workers or 1, storage=args.storage,
                          checkpoint_interval=args.checkpoint_interval)
    stepped = p.stats["pushes"]  # the push count at the last step: a source may push as it starts (a snapshot)
    sources: list[tuple[str, Any]] = []
    sinks: list[tuple[str, Any]] = []
    status = 0
    try:
        print(f"dbsp run {args.file}: storage {args.storage} ({'resumed at step ' + str(p.steps) if resume else 'new'},"
              f" {p.workers} worker{'s' if p.workers > 1 else ''})", flush=True)
        for name, c in conns.items():
            print(f"  {'source' if c.kind == 'table' else 'sink  '} {name}: {c.describe()}", flush=True)
        for name, c in conns.items():
            (sources if c.kind == "table" else sinks).append(
                (name, _source(p, c, base) if c.kind == "table" else _sink(p, c, base)))
        if not sources:
            print("  (no table declares a connector: nothing will arrive)", flush=True)
        first = resume  # a resumed run steps once: pushes acknowledged before the stop but never divided
        while not stop.is_set():
            t0 = time.perf_counter()
            pushed = {name: _poll(src, args.files_per_step) for name, src in sources}
            if p.stats["pushes"] != stepped or first:
                stepped = p.stats["pushes"]
                out = p.step()
                rows = ", ".join(f"{n} {v} pushes" for n, v in pushed.items() if v) \
                    or ("resumed" if first else "pushed as the sources started")
                print(f"step {p.steps - 1}: {rows}; {_changes(out)} ({time.perf_counter() - t0:.2f} s)", flush=True)
            first = False
            for _, sink in sinks:
                sink.poll()
            # idle when no source has anything left: a poll may push nothing new and still have files to go (the
            # files a stopped run had pushed already are skipped, counted against --files-per-step)
            if p.stats["pushes"] == stepped and not any(bool(src.pending()) for _, src in sources):
                if args.until_idle:
                    print(f"idle: every source read; the sinks hold steps 0..{p.steps - 1}", flush=True)
                    break
                stop.wait(args.poll)
        else:
            for _, sink in sinks:  # invariant 3: the sinks catch up before the pipeline closes
                sink.poll()
    except (DbspError, OSError, ValueError) as exc:
        print(f"error: {_scrub(str(exc), conns)}", file=sys.stderr)
        status = 1
    except Exception as exc:  # a connector's own error (sqlite3, deltalake, psycopg): named, credentials scrubbed
        print(f"error: {type(exc).__name__}: {_scrub(str(exc), conns)}", file=sys.stderr)
        status = 1
    finally:
        for _, sink in sinks:
            sink.close()
        for _, src in sources:
            if hasattr(src, "close"):
                src.close()
        p.close()
    if stop.is_set():
        print(f"stopped at step {p.steps} (checkpointed); the next run resumes there", flush=True)
    return status
