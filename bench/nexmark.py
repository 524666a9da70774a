"""Nexmark throughput of dbsp-core (embedded in memory and durable) per query, beside Apache Flink and Spark Structured Streaming measured in the same run on the same events, with the published figures of Feldera and Flink as context.

How it measures (the fairness rules of bench/bench_spark.py):

- The events are generated once (``dbsp_core.nexmark.generate``, its own rate printed apart) and written as
  one parquet file per stream and step; both systems read the same files, one file per stream per step
  (Spark: the file source with ``maxFilesPerTrigger=1``, ``trigger(availableNow=True)``, the ``noop`` sink).
- dbsp: each (query, mode, W) runs in a fresh child process, so its peak RSS is its own: read + push + step
  of every step is timed (q13's side table is pushed before, untimed). ``durable`` is ``storage=<tmp dir>``
  with the default checkpoint interval (input log fsync'd on every push, division records, output log).
  ``--reader files`` (the default) reads the events through one ``FileSource`` per stream the query reads
  (``flink_nexmark.READS``, as Flink reads only those), one file per stream and step, in every mode: the product's
  file reader, which reads the next files ahead on a thread of its own while the pipeline steps (connectors/files.py
  invariant 9), as Flink's file source parses beside its operators; durable, the source declares its files immutable
  (they are written once, before the run), so its pushes are logged by reference to the files, not by their rows:
  Flink's durable runs log no input either (their sources replay from the files). ``--reader push`` reads each step's
  files with pyarrow and pushes every stream with one ``push_many`` (rows in the input log, one fsync per step), the
  read serial with the step on the caller's thread.
- Spark: the sum of ``durationMs.triggerExecution`` of the micro-batches; ``local[W]``,
  ``shuffle.partitions = W``, RocksDB state store. Only queries Structured Streaming can express run (no
  chained aggregations, no ROW_NUMBER, no COUNT(DISTINCT) on streams).
- Flink (``--peers flink``): Apache Flink's Nexmark SQL (bench/flink_nexmark.py) in a child process run by
  the interpreter that has ``apache-flink`` (``--flink-python`` or ``DBSP_FLINK_PYTHON``), local mini-cluster,
  P = W, hashmap state, for ``memory`` no checkpoints, for ``durable`` checkpoints to a local directory every
  ``--flink-checkpoint-ms``, and then (``--flink-durable-sink files``, the default) every output change written by
  Flink's exactly-once file sink (committed at each checkpoint; ``csv``, or ``debezium-json`` for a query whose
  result has updates or deletes), as ours logs every step's output change fsynced; ``--flink-durable-sink
  blackhole`` drops Flink's output (the comparison before 2026-12-01, in which only our side wrote its output).
  Both sides then read the same CSV files (one per stream and step, written once
  from the generator's tables): Flink's filesystem source has no Parquet reader without an extra jar, and CSV
  parsing is counted on both sides (ours: the FileSources' parse, or with ``--reader push``
  ``pyarrow.csv.read_csv`` of each step's files, inside the timed loop; ``--source csv`` reads the CSV files
  without Flink); both read only the streams the query reads (``flink_nexmark.READS``). Flink's time = the job's net
  runtime minus the median of three runs of the same job on empty files. ``--check`` instead compares the
  number of rows of each final view on both sides (is it the same work?).
- events/s = events of all steps / time; per core = events/s / W (W worker threads, or Spark's local[W]).
  Published figures are per core, from the engines' own reports, on other machines.

Run:  python bench/nexmark.py --queries q0,q4,q7 --events 1000000 --workers 1,2 --modes memory,durable
      [--spark] [--write-results]     (small smoke run: --events 20000)
"""

from __future__ import annotations

import argparse
import json
import re
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dbsp_core as dbsp  # noqa: E402
import flink_nexmark  # noqa: E402  (bench/, beside this file; imports pyflink only in its child)
from dbsp_core import nexmark  # noqa: E402

PUBLISHED = {  # events/s/core, from the engines' published Nexmark reports
    "Feldera": {"q0": 573_000, "q4": 460_000, "q7": 318_000, "q9": 106_000, "q16": 137_000, "q20": 232_000},
    "Flink": {"q0": 155_000, "q1": 158_000, "q2": 175_000, "q3": 152_000, "q4": 34_000, "q5": 22_000,
              "q7": 12_300, "q8": 146_000, "q9": 14_200, "q20": 19_000},
}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
BEGIN, END = "<!-- nexmark:begin -->", "<!-- nexmark:end -->"

DAY = "date_format(dateTime, 'yyyy-MM-dd')"
SPARK_SQL = {  # (SQL over the streams person, auction, bid and the static side_input; output mode)
    "q0": ("SELECT * FROM bid", "append"),
    "q1": ("SELECT auction, bidder, 0.908 * price AS price, dateTime, extra FROM bid", "append"),
    "q2": ("SELECT auction, price FROM bid WHERE auction % 123 = 0", "append"),
    "q3": ("SELECT P.name, P.city, P.state, A.id FROM auction A JOIN person P ON A.seller = P.id "
           "WHERE A.category = 10 AND P.state IN ('OR', 'ID', 'CA')", "append"),
    "q10": ("SELECT auction, bidder, price, dateTime, extra, date_format(dateTime, 'yyyy-MM-dd'), "
            "date_format(dateTime, 'HH:mm') FROM bid", "append"),
    "q13": ("SELECT B.auction, B.bidder, B.price, B.dateTime, S.value FROM bid B JOIN side_input S "
            "ON B.auction % 10000 = S.key", "append"),
    "q14": ("SELECT auction, bidder, 0.908 * price AS price, CASE WHEN hour(dateTime) BETWEEN 8 AND 18 THEN "
            "'dayTime' WHEN hour(dateTime) <= 6 OR hour(dateTime) >= 20 THEN 'nightTime' ELSE 'otherTime' END, "
            "dateTime, extra, length(extra) - length(replace(extra, 'c', '')) FROM bid "
            "WHERE 0.908 * price > 1000000 AND 0.908 * price < 50000000", "append"),
    "q17": (f"SELECT auction, {DAY} AS day, count(*), count_if(price < 10000), "
            f"count_if(price >= 10000 AND price < 1000000), count_if(price >= 1000000), min(price), max(price), "
            f"avg(price), sum(price) FROM bid GROUP BY auction, {DAY}", "update"),
    "q20": ("SELECT B.auction, B.bidder, B.price, B.channel, B.url, B.dateTime, B.extra, A.itemName, "
            "A.description, A.initialBid, A.reserve, A.dateTime, A.expires, A.seller, A.category, A.extra "
            "FROM bid B JOIN auction A ON B.auction = A.id WHERE A.category = 10", "append"),
    "q21": ("SELECT auction, bidder, price, channel, CASE lower(channel) WHEN 'apple' THEN '0' WHEN 'google' "
            "THEN '1' WHEN 'facebook' THEN '2' WHEN 'baidu' THEN '3' ELSE regexp_extract(url, "
            "'(&|^)channel_id=([^&]*)', 2) END FROM bid WHERE url RLIKE '(&|^)channel_id=' OR lower(channel) IN "
            "('apple', 'google', 'facebook', 'baidu')", "append"),
    "q22": ("SELECT auction, bidder, price, channel, split(url, '/')[3], split(url, '/')[4], split(url, '/')[5] "
            "FROM bid", "append"),
}


def write_events(root: str, events: int, batch: int, seed: int, rate: int,
                 csv: bool = False) -> tuple[list[dict], float]:
    """One parquet file per stream and step (and with ``csv`` one headerless CSV file too, under root/csv, with
    empty twins of its directories under root/csv-empty, and the same with a header line under root/csvh for
    FileSource); returns the files and the generator's own events/s."""
    files, gen_s = [], 0.0
    for name in nexmark.SCHEMAS:
        os.makedirs(os.path.join(root, name))
        if csv:
            for sub in ("csv", "csv-empty", "csvh"):
                os.makedirs(os.path.join(root, sub, name))
    next(nexmark.generate(1, seed=seed))  # the seed's string pools, drawn once per process: not the rate
    it = nexmark.generate(events, seed=seed, batch=batch, rate=rate)
    while True:
        t0 = time.perf_counter()
        b = next(it, None)
        gen_s += time.perf_counter() - t0
        if b is None:
            break
        step = {}
        for name, t in b.items():
            step[name] = os.path.join(root, name, f"part-{len(files):05d}.parquet")
            pq.write_table(t, step[name])
            step["rows:" + name] = t.num_rows
            if csv:
                step["csv:" + name] = os.path.join(root, "csv", name, f"part-{len(files):05d}.csv")
                pa_csv.write_csv(t, step["csv:" + name], pa_csv.WriteOptions(include_header=False))
                pa_csv.write_csv(t, os.path.join(root, "csvh", name, f"part-{len(files):05d}.csv"))
        files.append(step)
    pq.write_table(nexmark.side_input(), os.path.join(root, "side_input.parquet"))
    # The generator alone: a second pass with nothing in between (the pass above interleaves parquet writes,
    # which evict its arrays; its first large batch also pays one-time page faults). Both rates are printed.
    for _ in nexmark.generate(min(events, batch), seed=seed, batch=batch, rate=rate):
        pass
    t0 = time.perf_counter()
    for _ in nexmark.generate(events, seed=seed, batch=batch, rate=rate):
        pass
    alone = time.perf_counter() - t0
    print(f"generator: {events / gen_s / 1e6:.2f} M events/s while writing the files, "
          f"{events / alone / 1e6:.2f} M events/s alone", flush=True)
    return files, events / alone if alone else float("inf")


def read_csv(path: str, name: str) -> pa.Table:
    """One step's CSV file of stream ``name`` as written by write_events, in the generator's schema."""
    schema = nexmark.SCHEMAS[name]
    return pa_csv.read_csv(path, read_options=pa_csv.ReadOptions(column_names=schema.names),
                           convert_options=pa_csv.ConvertOptions(column_types=schema, strings_can_be_null=False))


def file_sources(p: dbsp.Pipeline, root: str, reads, source: str, read_ahead: int | None = None) -> list:
    """One FileSource per stream of ``reads`` over its directory of step files (parquet, or CSV with a header);
    durable, the files are declared immutable (pushes logged by reference to them); ``read_ahead`` None: the
    source's default."""
    from dbsp_core.connectors import FileSource

    sub = "csvh" if source == "csv" else ""
    more = {} if read_ahead is None else {"read_ahead": read_ahead}
    return [FileSource(p, name, os.path.join(root, sub, name), immutable_files=p.storage is not None, **more)
            for name in reads]


def push_step(p: dbsp.Pipeline, step: dict, reads, source: str, sources: list | None) -> None:
    """One step's input: each source's next file, or (without sources) each stream's file read and pushed
    with one push_many (durable: one fsync of the input log for the step's pushes)."""
    if sources:
        for s in sources:
            s.poll(max_files=1)
        return
    p.push_many([(name, read_csv(step["csv:" + name], name) if source == "csv" else pq.read_table(step[name]))
                 for name in reads])


def run_dbsp(query: str, mode: str, workers: int, files: list[dict], root: str,
             source: str = "parquet", reader: str = "push", read_ahead: int | None = None,
             output_sync: bool = True) -> dict:
    """One measurement, in this (child) process, reading each step's parquet (or with ``source="csv"``, CSV)
    files inside the timed loop, through FileSources (``reader="files"``) or pyarrow and push_many."""
    storage = tempfile.mkdtemp(prefix=f"nexmark-{query}-", dir=root) if mode == "durable" else None
    c = nexmark.circuit(query)
    from dbsp_core.runtime.embedded import EmbeddedExecutor

    # merges on the workers' threads: per-core figures divide by W, so W threads must be all the cores used
    ex = EmbeddedExecutor(background_merge=False)
    p = dbsp.Pipeline(c, workers=workers, storage=storage, executor=ex, output_sync=output_sync) if storage else \
        dbsp.Pipeline(c, workers=workers, executor=ex)
    try:
        if query == "q13":
            p.push("side_input", pq.read_table(os.path.join(root, "side_input.parquet")))
        events, seconds, read_s, out_rows, final_rows, sources = 0, 0.0, 0.0, 0, 0, []
        # beside Flink (CSV) or through FileSources, read only the streams the query reads, as Flink does; else
        # all, as Spark is timed
        reads = (flink_nexmark.READS.get(query, nexmark.SCHEMAS) if source == "csv" or reader == "files"
                 else nexmark.SCHEMAS)
        sources = file_sources(p, root, reads, source, read_ahead) if reader == "files" else []
        for step in files:
            t0 = time.perf_counter()
            push_step(p, step, reads, source, sources or None)
            read_s += time.perf_counter() - t0
            events += sum(step["rows:" + name] for name in nexmark.SCHEMAS)
            out = p.step()
            seconds += time.perf_counter() - t0
            out_rows += out[query].num_rows
            final_rows += int(out[query].weights.sum())
        late = sum(p.late_rows.values())
        out_bytes = p._output.disk_bytes() if storage else 0  # what the output log wrote (Flink's: sink_bytes)
    finally:
        for s in sources:
            s.close()  # joins each source's read-ahead thread
        p.close()
        if storage:
            shutil.rmtree(storage, ignore_errors=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"query": query, "mode": mode, "workers": workers, "events": events, "seconds": seconds, "read_s": read_s,
            "peak_mib": peak, "out_rows": out_rows, "out_bytes": out_bytes, "final_rows": final_rows, "late": late, "source": source,
            "reader": reader}


def measure_dbsp(query: str, mode: str, workers: int, root: str, source: str = "parquet",
                 reader: str = "push", output_sync: bool = True) -> dict:
    """run_dbsp in a fresh child process (its own peak memory)."""
    arg = json.dumps({"query": query, "mode": mode, "workers": workers, "root": root, "source": source,
                      "reader": reader, "output_sync": output_sync})
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", arg], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{query} {mode} W={workers} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def spark_session(workers: int):
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    return (SparkSession.builder.master(f"local[{workers}]").appName("bench-nexmark")
            .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
            .config("spark.driver.memory", "3g").config("spark.sql.shuffle.partitions", str(workers))
            .config("spark.sql.streaming.stateStore.providerClass",
                    "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
            .config("spark.sql.streaming.noDataMicroBatches.enabled", "false")
            .config("spark.sql.session.timeZone", "UTC").getOrCreate())


def measure_spark(spark, query: str, root: str, steps: int, events: int) -> dict:
    """Spark Structured Streaming over the same files: the sum of its micro-batches' trigger times. It reads only
    the streams its SQL names; the rate counts every event of the run, as for dbsp (which is pushed all three)."""
    sql, mode = SPARK_SQL[query]
    read = 0
    for name in nexmark.SCHEMAS:
        if re.search(rf"\b(?:FROM|JOIN)\s+{name}\b", sql, flags=re.I):  # a stream the query reads (not a column)
            d = os.path.join(root, name)
            read += sum(pq.read_metadata(os.path.join(d, f)).num_rows for f in os.listdir(d))
        d = os.path.join(root, name)
        schema = spark.read.parquet(d).schema
        spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(d).createOrReplaceTempView(name)
    spark.read.parquet(os.path.join(root, "side_input.parquet")).createOrReplaceTempView("side_input")
    ckpt = tempfile.mkdtemp(prefix=f"spark-{query}-", dir=root)
    q = (spark.sql(sql).writeStream.format("noop").outputMode(mode).option("checkpointLocation", ckpt)
         .trigger(availableNow=True).start())
    q.awaitTermination()
    if q.exception() is not None:
        raise RuntimeError(f"Spark {query} failed: {q.exception()}")
    progress = [p for p in q.recentProgress if p["numInputRows"] > 0]
    seconds = sum(p["durationMs"]["triggerExecution"] for p in progress) / 1e3
    rows = sum(int(p["numInputRows"]) for p in progress)
    if rows != read:
        raise RuntimeError(f"Spark {query} read {rows} rows in {len(progress)} batches, expected {read} in "
                           f"{steps} (recentProgress keeps 100 batches: use fewer steps)")
    return {"seconds": seconds, "events": events}


def flink_python(args: argparse.Namespace) -> str:
    """The interpreter that runs bench/flink_nexmark.py: --flink-python, else DBSP_FLINK_PYTHON, else ours."""
    return args.flink_python or os.environ.get("DBSP_FLINK_PYTHON") or sys.executable


def measure_flink(args: argparse.Namespace, queries: list[str], mode: str, parallelism: int, root: str,
                  check: bool = False) -> dict[str, dict]:
    """bench/flink_nexmark.py in a child process (one JVM for all the queries of this mode and P)."""
    arg = json.dumps({"root": root, "queries": queries, "parallelism": parallelism, "mode": mode,
                      "checkpoint_ms": args.flink_checkpoint_ms, "check": check,
                      "sink": args.flink_durable_sink if mode == "durable" else "blackhole"})
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flink_nexmark.py")
    r = subprocess.run([flink_python(args), script, arg], capture_output=True, text=True)
    out = {}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            out[d["query"]] = d
    if r.returncode or set(out) != set(queries):
        raise RuntimeError(f"Flink {mode} P={parallelism} failed (exit {r.returncode}; is apache-flink installed "
                           f"for {flink_python(args)}? see bench/README.md):\n{r.stderr[-3000:]}")
    for q, d in out.items():
        if "error" in d:
            print(f"{q:>4} {mode:>7} Flink P={parallelism} failed: {d['error']}", file=sys.stderr, flush=True)
    return out


def run_flink(args: argparse.Namespace, queries: list[str], modes: list[str], workers: list[int], root: str,
              events: int) -> dict:
    """Flink's events/s per (query, mode, P) for the queries its SQL expresses."""
    flink: dict = {}
    fq = [q for q in queries if q in flink_nexmark.SQL]
    for mode in modes:
        for w in workers:
            for q, d in measure_flink(args, fq, mode, w, root).items():
                if "error" in d:
                    continue
                flink[(q, mode, w)] = d
                note = "" if d["seconds"] > 0 else "  (not above the empty job: no figure)"
                rate = events / d["seconds"] if d["seconds"] > 0 else float("nan")
                wrote = f", {d['sink_bytes'] / 2**20:,.1f} MiB written" if d.get("sink_bytes") else ""
                print(f"{q:>4} {mode:>7} Flink P={w}: {rate:>12,.0f} events/s  (job {d['job_ms']:,.0f} ms, "
                      f"empty job {d['empty_ms']:,.0f} ms, sink {d.get('sink', 'blackhole')}{wrote}){note}", flush=True)
    return flink


def check(args: argparse.Namespace, queries: list[str], workers: list[int], root: str) -> bool:
    """Rows of each final view, ours (in memory) against Flink's, at each W = P; True if all agree."""
    fq = [q for q in queries if q in flink_nexmark.SQL]
    ok = True
    print("\n| query | W = P | dbsp final rows | Flink final rows | same |\n|---|---|---|---|---|")
    for w in workers:
        flink = measure_flink(args, fq, "memory", w, root, check=True)
        for q in fq:
            ours = measure_dbsp(q, "memory", w, root, "csv")["final_rows"]
            theirs = flink[q].get("rows")
            same = ours == theirs
            ok &= same
            print(f"| {q} | {w} | {ours:,} | {'failed' if theirs is None else f'{theirs:,}'} | "
                  f"{'yes' if same else 'NO'} |", flush=True)
    skipped = [q for q in queries if q not in flink_nexmark.SQL]
    if skipped:
        print(f"not compared (no Flink SQL here): {', '.join(skipped)}")
    return ok


def head_line(gen_rate: float, args: argparse.Namespace) -> str:
    return (f"{args.events:,} events in steps of {args.batch:,} (seed {args.seed}, {args.rate:,} events/s of event "
            f"time), read from {'CSV' if args.source == 'csv' else 'parquet'} files (dbsp: {args.reader_used}); "
            f"generator alone: "
            f"{gen_rate / 1e6:.2f} M events/s; {os.cpu_count()} cores, load average "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; dbsp_core {dbsp.__version__}, pyarrow {pa.__version__}"
            + ("; durable output fsynced only at checkpoints (--output-sync off)" if args.output_sync == "off" else ""))


def peers_table(rows: list[dict], flink: dict, args: argparse.Namespace) -> str:
    """Ours against Flink measured in this run (the ratio first); published per-core figures as context."""
    lines = ["| query | mode | W = P | dbsp / Flink | dbsp events/s | Flink events/s | context: published "
             "events/s/core, other machines (Feldera / Flink) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        q, w, mode = r["query"], r["workers"], r["mode"]
        ours = r["events"] / r["seconds"]
        f = flink.get((q, mode, w))
        theirs = r["events"] / f["seconds"] if f and f["seconds"] > 0 else None
        ratio = f"**{ours / theirs:.1f}x**" if theirs else ("n/a" if q not in flink_nexmark.SQL else "-")
        pub = " / ".join(f"{PUBLISHED[e][q]:,}" if q in PUBLISHED[e] else "-" for e in ("Feldera", "Flink"))
        lines.append(f"| {q} | {mode} | {w} | {ratio} | {ours:,.0f} | "
                     f"{f'{theirs:,.0f}' if theirs else '-'} | {pub} |")
    durable_sink = ("its output written by the exactly-once file sink (csv, or debezium-json for a changelog)"
                    if args.flink_durable_sink == "files" else "its output dropped (blackhole)")
    lines += ["", f"Flink {'with checkpoints to local disk every ' + str(args.flink_checkpoint_ms) + ' ms'} and "
              f"{durable_sink} for durable, none and a blackhole for memory; hashmap state; n/a: no Flink SQL for the query here "
              f"(bench/flink_nexmark.py says why); -: Flink failed the query or its job took no longer than on "
              f"empty files (both printed above)."]
    return "\n".join(lines)


def table(rows: list[dict], spark: dict, gen_rate: float, args: argparse.Namespace) -> str:
    lines = ["| query | mode | W | dbsp events/s | dbsp events/s/core | peak MiB | Spark SS events/s/core "
             "| Feldera events/s/core (published) | Flink events/s/core (published) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q, w = r["query"], r["workers"]
        rate = r["events"] / r["seconds"] if r["seconds"] else float("inf")
        s = spark.get((q, w))
        s_cell = f"{s['events'] / s['seconds'] / w:,.0f}" if s else ("-" if q in SPARK_SQL else "n/a")
        pub = [f"{PUBLISHED[e][q]:,}" if q in PUBLISHED[e] else "-" for e in ("Feldera", "Flink")]
        lines.append(f"| {q} | {r['mode']} | {w} | {rate:,.0f} | {rate / w:,.0f} | {r['peak_mib']:,.0f} | "
                     f"{s_cell} | {pub[0]} | {pub[1]} |")
    lines.append("")
    lines.append("n/a: Structured Streaming cannot express the query (chained aggregations, ROW_NUMBER, "
                 "COUNT(DISTINCT) on a stream); -: not measured or not published.")
    return "\n".join(lines)


def write_results(text: str, path: str) -> None:
    """Put ``text`` between the Nexmark markers of ``path`` (appending the section the first time)."""
    old = open(path).read() if os.path.exists(path) else ""
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in old and END in old:
        new = old[:old.index(BEGIN)] + block + old[old.index(END) + len(END):]
    else:
        new = old.rstrip("\n") + "\n\n## Nexmark\n\nCommand: `python bench/nexmark.py --spark --write-results " \
                                 "...` (see its docstring for how it measures).\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", default="q0,q1,q2,q3,q4,q5,q7,q8,q9,q16,q20")
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=100_000, help="events per step")
    ap.add_argument("--workers", default="1,2", help="worker counts, e.g. 1,2")
    ap.add_argument("--modes", default="memory,durable")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate", type=int, default=nexmark.generator.DEFAULT_RATE, help="events/s of event time")
    ap.add_argument("--spark", action="store_true", help="also measure Spark Structured Streaming")
    ap.add_argument("--write-results", action="store_true", help=f"write the table into {RESULTS}")
    ap.add_argument("--results-file", default=RESULTS)
    ap.add_argument("--peers", choices=["flink"], help="also run Apache Flink's SQL on the same events (CSV)")
    ap.add_argument("--flink-python", help="interpreter with apache-flink (default: $DBSP_FLINK_PYTHON or this one)")
    ap.add_argument("--flink-checkpoint-ms", type=int, default=1000, help="Flink's checkpoint interval, durable")
    ap.add_argument("--flink-durable-sink", choices=("files", "blackhole"), default="files",
                    help="durable Flink's sink: its exactly-once file sink (every output change written, as ours "
                         "logs them) or a blackhole (output dropped)")
    ap.add_argument("--check", action="store_true",
                    help="with --peers: compare the rows of each final view with Flink's instead of timing")
    ap.add_argument("--reader", choices=["auto", "files", "push"], default="auto",
                    help="files (auto): a FileSource per stream read, reading ahead while the pipeline steps (durable: "
                    "pushes logged by reference to the files); push: pyarrow reads, one push_many per step")
    ap.add_argument("--source", choices=["auto", "csv", "parquet"], default="auto",
                    help="the files our side reads: csv (auto with --peers: the files Flink reads) or parquet")
    ap.add_argument("--output-sync", choices=["on", "off"], default="on",
                    help="durable: fsync each step's output record before step() returns (on, the default contract) "
                         "or only at checkpoints (off: Pipeline(output_sync=False), to measure what the contract costs)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.check and not args.peers:
        ap.error("--check compares with a peer: add --peers flink")
    if args.child:
        a = json.loads(args.child)
        files = json.load(open(os.path.join(a["root"], "files.json")))
        print(json.dumps(run_dbsp(a["query"], a["mode"], a["workers"], files, a["root"], a["source"],
                                  a.get("reader", "push"), a.get("read_ahead"), a.get("output_sync", True))))
        return
    queries = [q.strip() for q in args.queries.split(",") if q.strip()]
    for q in queries:
        if q not in nexmark.QUERIES:
            sys.exit(f"unknown query {q!r}: the queries are q0..q22")
    workers = [int(w) for w in args.workers.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    root = tempfile.mkdtemp(prefix="nexmark-bench-")
    try:
        source = args.source if args.source != "auto" else "csv" if args.peers else "parquet"
        if args.peers and source != "csv":
            ap.error("--peers reads CSV on both sides: --source csv (or auto)")
        files, gen_rate = write_events(root, args.events, args.batch, args.seed, args.rate, csv=source == "csv")
        json.dump(files, open(os.path.join(root, "files.json"), "w"))
        print(f"generated {args.events:,} events in {len(files)} steps; generator {gen_rate / 1e6:.2f} M events/s",
              flush=True)
        if args.check:
            sys.exit(0 if check(args, queries, workers, root) else 1)
        reader = args.reader if args.reader != "auto" else "files"
        args.source, args.reader_used = source, "FileSources" if reader == "files" else "pyarrow + push_many"
        print(f"dbsp reads the events through {'FileSources' if reader == 'files' else 'pyarrow and push_many'}",
              flush=True)
        rows = []
        for q in queries:
            for mode in modes:
                for w in workers:
                    r = measure_dbsp(q, mode, w, root, source, reader, args.output_sync == "on")
                    rate = r["events"] / r["seconds"]
                    print(f"{q:>4} {mode:>7} W={w}: {rate:>12,.0f} events/s  {rate / w:>12,.0f} /core  "
                          f"peak {r['peak_mib']:,.0f} MiB  ({r['out_rows']:,} output rows, {r['late']} late"
                          f"{', output log %.1f MiB' % (r['out_bytes'] / 2**20) if r.get('out_bytes') else ''})",
                          flush=True)
                    rows.append(r)
        flink = run_flink(args, queries, modes, workers, root, args.events) if args.peers else {}
        spark: dict = {}
        if args.spark:
            for w in workers:
                session = spark_session(w)
                try:
                    for q in queries:
                        if q in SPARK_SQL:
                            spark[(q, w)] = s = measure_spark(session, q, root, len(files), args.events)
                            print(f"{q:>4}   Spark W={w}: {s['events'] / s['seconds']:>12,.0f} events/s  "
                                  f"{s['events'] / s['seconds'] / w:>12,.0f} /core", flush=True)
                finally:
                    session.stop()
        text = head_line(gen_rate, args) + "\n\n"
        if args.peers:
            text += peers_table(rows, flink, args) + "\n\n"
        text += table(rows, spark, gen_rate, args)
        print()
        print(text)
        if args.write_results:
            write_results(text, args.results_file)
            print(f"\nwritten into {args.results_file}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
