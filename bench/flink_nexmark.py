"""Apache Flink's Nexmark SQL over the CSV files bench/nexmark.py wrote, run by bench/nexmark.py --peers flink in a child process with the interpreter that has apache-flink (its own venv if need be), one local mini-cluster per mode.

The SQL is the Nexmark benchmark's (github.com/nexmark/nexmark, queries/*.sql), restated over this project's
column names and CSV tables; q6 is left out (the benchmark itself marks it unsupported by Flink: an OVER
window on a non-time attribute), q12 too (processing-time windows: what it computes depends on the clock, not
the events), and q13 (its side input is a lookup join on processing time, not written here yet). Settings are
the benchmark's own flink-conf for SQL (mini-batch of 50,000 rows / 2 s, split distinct aggregation), with
P = W, hashmap (heap) state, and either no checkpoints (``memory``) or aligned checkpoints to a local
directory every ``checkpoint_ms`` (``durable``).

Time per query = the job's net runtime (JobExecutionResult.getNetRuntime: deploy to finish, the JVM already
warm) on the events minus the median of three runs of the same job on empty files, so the job's fixed start
and stop cost is not counted (our side's time does not include building the pipeline either). Reading and
parsing the CSV files is counted, as it is on our side.

The sink: a blackhole (``sink = "blackhole"``: every row is produced and dropped), or, for a durable run that does
the work ours does (bench/nexmark.py's durable pipeline logs every step's output change, fsynced, readable once by
its consumers), Flink's exactly-once file sink (``sink = "files"``: the filesystem connector, whose part files are
committed at each checkpoint) in the cheapest row format Flink can write the query's changelog in: ``csv`` for a
query whose result only appends, else ``debezium-json`` (a delete for each retraction or update-before, an insert
for each insert or update-after), picked per query by trying ``csv`` first (:data:`FILE_FORMAT`, printed).

Input (argv[1], JSON): {"root", "queries", "parallelism", "mode", "checkpoint_ms", "check", "sink"}. Output: one JSON
line per query on stdout: {"query", "seconds", "job_ms", "empty_ms", "sink"} or, with "check", {"query", "rows"}: the
number of rows of the final view (inserts minus deletes of its changelog); {"query", "error"} if Flink failed it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import sys
import time

WM = "WATERMARK FOR dateTime AS dateTime - INTERVAL '4' SECOND"
DDL = {
    "person": "id BIGINT, name STRING, emailAddress STRING, creditCard STRING, city STRING, state STRING, "
              f"dateTime TIMESTAMP(3), extra STRING, {WM}",
    "auction": "id BIGINT, itemName STRING, description STRING, initialBid BIGINT, reserve BIGINT, "
               f"dateTime TIMESTAMP(3), expires TIMESTAMP(3), seller BIGINT, category BIGINT, extra STRING, {WM}",
    "bid": f"auction BIGINT, bidder BIGINT, price BIGINT, channel STRING, url STRING, dateTime TIMESTAMP(3), "
           f"extra STRING, {WM}",
}

PRICE_RANKS = ("price < 10000", "price >= 10000 AND price < 1000000", "price >= 1000000")
RANKED = "count(*) AS total_bids, " + ", ".join(f"count(*) FILTER (WHERE {c}) AS rank{i}_bids"
                                                for i, c in enumerate(PRICE_RANKS, 1))


def _distinct(col: str) -> str:
    """q15/q16's distinct counts of ``col`` (bidder or auction), in all and per price rank."""
    return f"count(DISTINCT {col}) AS total_{col}s, " + ", ".join(
        f"count(DISTINCT {col}) FILTER (WHERE {c}) AS rank{i}_{col}s" for i, c in enumerate(PRICE_RANKS, 1))


HOP5 = "TABLE(HOP(TABLE bid, DESCRIPTOR(dateTime), INTERVAL '2' SECOND, INTERVAL '10' SECOND))"
SQL = {
    "q0": "SELECT auction, bidder, price, dateTime, extra FROM bid",
    "q1": "SELECT auction, bidder, 0.908 * price AS price, dateTime, extra FROM bid",
    "q2": "SELECT auction, price FROM bid WHERE MOD(auction, 123) = 0",
    "q3": "SELECT P.name, P.city, P.state, A.id FROM auction AS A INNER JOIN person AS P ON A.seller = P.id "
          "WHERE A.category = 10 AND (P.state = 'OR' OR P.state = 'ID' OR P.state = 'CA')",
    "q4": "SELECT Q.category, AVG(Q.final) FROM (SELECT MAX(B.price) AS final, A.category FROM auction A, bid B "
          "WHERE A.id = B.auction AND B.dateTime BETWEEN A.dateTime AND A.expires GROUP BY A.id, A.category) Q "
          "GROUP BY Q.category",
    # the benchmark's q5: the auctions whose bid count in a hopping window equals the window's largest count
    "q5": f"SELECT AuctionBids.auction, AuctionBids.num FROM (SELECT auction, count(*) AS num, window_start AS "
          f"starttime, window_end AS endtime FROM {HOP5} GROUP BY auction, window_start, window_end) AS AuctionBids "
          f"JOIN (SELECT max(CountBids.num) AS maxn, CountBids.starttime, CountBids.endtime FROM (SELECT count(*) "
          f"AS num, window_start AS starttime, window_end AS endtime FROM {HOP5} GROUP BY auction, window_start, "
          f"window_end) AS CountBids GROUP BY CountBids.starttime, CountBids.endtime) AS MaxBids "
          f"ON AuctionBids.starttime = MaxBids.starttime AND AuctionBids.endtime = MaxBids.endtime "
          f"AND AuctionBids.num >= MaxBids.maxn",
    "q7": "SELECT B.auction, B.price, B.bidder, B.dateTime, B.extra FROM bid B JOIN (SELECT MAX(price) AS maxprice, "
          "window_end AS dateTime FROM TABLE(TUMBLE(TABLE bid, DESCRIPTOR(dateTime), INTERVAL '10' SECOND)) "
          "GROUP BY window_start, window_end) B1 ON B.price = B1.maxprice "
          "WHERE B.dateTime BETWEEN B1.dateTime - INTERVAL '10' SECOND AND B1.dateTime",
    "q8": "SELECT P.id, P.name, P.starttime FROM (SELECT id, name, window_start AS starttime, window_end AS endtime "
          "FROM TABLE(TUMBLE(TABLE person, DESCRIPTOR(dateTime), INTERVAL '10' SECOND)) "
          "GROUP BY id, name, window_start, window_end) P JOIN (SELECT seller, window_start AS starttime, "
          "window_end AS endtime FROM TABLE(TUMBLE(TABLE auction, DESCRIPTOR(dateTime), INTERVAL '10' SECOND)) "
          "GROUP BY seller, window_start, window_end) A "
          "ON P.id = A.seller AND P.starttime = A.starttime AND P.endtime = A.endtime",
    "q9": "SELECT id, itemName, description, initialBid, reserve, dateTime, expires, seller, category, extra, "
          "auction, bidder, price, bid_dateTime, bid_extra FROM (SELECT A.*, B.auction, B.bidder, B.price, "
          "B.dateTime AS bid_dateTime, B.extra AS bid_extra, ROW_NUMBER() OVER (PARTITION BY A.id "
          "ORDER BY B.price DESC, B.dateTime ASC) AS rownum FROM auction A, bid B WHERE A.id = B.auction "
          "AND B.dateTime BETWEEN A.dateTime AND A.expires) WHERE rownum <= 1",
    # the benchmark writes q10 into a partitioned filesystem sink; here into the blackhole like every query
    "q10": "SELECT auction, bidder, price, dateTime, extra, DATE_FORMAT(dateTime, 'yyyy-MM-dd'), "
           "DATE_FORMAT(dateTime, 'HH:mm') FROM bid",
    "q11": "SELECT B.bidder, count(*) AS bid_count, SESSION_START(B.dateTime, INTERVAL '10' SECOND) AS starttime, "
           "SESSION_END(B.dateTime, INTERVAL '10' SECOND) AS endtime FROM bid B "
           "GROUP BY B.bidder, SESSION(B.dateTime, INTERVAL '10' SECOND)",
    # the benchmark's COUNT_CHAR user function (a Java UDF) as the same count in plain SQL
    "q14": "SELECT auction, bidder, 0.908 * price AS price, CASE WHEN HOUR(dateTime) >= 8 AND HOUR(dateTime) <= 18 "
           "THEN 'dayTime' WHEN HOUR(dateTime) <= 6 OR HOUR(dateTime) >= 20 THEN 'nightTime' ELSE 'otherTime' END "
           "AS bidTimeType, dateTime, extra, CHAR_LENGTH(extra) - CHAR_LENGTH(REPLACE(extra, 'c', '')) AS c_counts "
           "FROM bid WHERE 0.908 * price > 1000000 AND 0.908 * price < 50000000",
    "q15": f"SELECT DATE_FORMAT(dateTime, 'yyyy-MM-dd') AS `day`, {RANKED}, "
           f"{_distinct('bidder')}, {_distinct('auction')} FROM bid GROUP BY DATE_FORMAT(dateTime, 'yyyy-MM-dd')",
    "q16": f"SELECT channel, DATE_FORMAT(dateTime, 'yyyy-MM-dd') AS `day`, max(DATE_FORMAT(dateTime, 'HH:mm')) AS "
           f"`minute`, {RANKED}, {_distinct('bidder')}, {_distinct('auction')} FROM bid "
           f"GROUP BY channel, DATE_FORMAT(dateTime, 'yyyy-MM-dd')",
    "q17": f"SELECT auction, DATE_FORMAT(dateTime, 'yyyy-MM-dd') AS `day`, {RANKED}, min(price) AS min_price, "
           f"max(price) AS max_price, avg(price) AS avg_price, sum(price) AS sum_price FROM bid "
           f"GROUP BY auction, DATE_FORMAT(dateTime, 'yyyy-MM-dd')",
    "q18": "SELECT auction, bidder, price, channel, url, dateTime, extra FROM (SELECT *, ROW_NUMBER() OVER "
           "(PARTITION BY bidder, auction ORDER BY dateTime DESC) AS rank_number FROM bid) WHERE rank_number <= 1",
    "q19": "SELECT * FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY auction ORDER BY price DESC) AS rank_number "
           "FROM bid) WHERE rank_number <= 10",
    "q20": "SELECT auction, bidder, price, channel, url, B.dateTime, B.extra, itemName, description, initialBid, "
           "reserve, A.dateTime, expires, seller, category, A.extra FROM bid AS B INNER JOIN auction AS A "
           "ON B.auction = A.id WHERE A.category = 10",
    "q21": "SELECT auction, bidder, price, channel, CASE WHEN lower(channel) = 'apple' THEN '0' WHEN lower(channel) = "
           "'google' THEN '1' WHEN lower(channel) = 'facebook' THEN '2' WHEN lower(channel) = 'baidu' THEN '3' "
           "ELSE REGEXP_EXTRACT(url, '(&|^)channel_id=([^&]*)', 2) END AS channel_id FROM bid WHERE "
           "REGEXP_EXTRACT(url, '(&|^)channel_id=([^&]*)', 2) IS NOT NULL OR lower(channel) IN "
           "('apple', 'google', 'facebook', 'baidu')",
    "q22": "SELECT auction, bidder, price, channel, SPLIT_INDEX(url, '/', 3) AS dir1, SPLIT_INDEX(url, '/', 4) AS "
           "dir2, SPLIT_INDEX(url, '/', 5) AS dir3 FROM bid",
}


# The streams each query reads: both sides read (and count the time of) only these files; events/s still counts
# every event of the run, on both sides.
READS = {q: ("person", "auction") if q in ("q3", "q8") else ("auction", "bid") if q in ("q4", "q9", "q20")
         else ("bid",) for q in SQL}

# DATETIME is a reserved word of Flink 2's parser: the column is written `dateTime` in the SQL above
DDL = {k: re.sub(r"\bdateTime\b", "`dateTime`", v) for k, v in DDL.items()}
SQL = {k: re.sub(r"\bdateTime\b", "`dateTime`", v) for k, v in SQL.items()}


def environment(parallelism: int, mode: str, checkpoint_ms: int, ckpt_dir: str):
    from pyflink.table import EnvironmentSettings, TableEnvironment

    tenv = TableEnvironment.create(EnvironmentSettings.in_streaming_mode())
    conf = tenv.get_config()
    settings = {
        "parallelism.default": str(parallelism),
        "table.exec.resource.default-parallelism": str(parallelism),
        "state.backend.type": "hashmap",
        "pipeline.object-reuse": "true",
        # the Nexmark benchmark's flink-conf for SQL jobs
        "table.exec.mini-batch.enabled": "true",
        "table.exec.mini-batch.allow-latency": "2 s",
        "table.exec.mini-batch.size": "50000",
        "table.optimizer.distinct-agg.split.enabled": "true",
    }
    if mode == "durable":
        settings.update({
            "execution.checkpointing.interval": f"{checkpoint_ms} ms",
            "execution.checkpointing.mode": "EXACTLY_ONCE",
            "execution.checkpointing.storage": "filesystem",
            "execution.checkpointing.dir": "file://" + ckpt_dir,
            "state.checkpoints.dir": "file://" + ckpt_dir,
        })
    for k, v in settings.items():
        conf.set(k, v)
    return tenv


def register(tenv, root: str) -> None:
    for name, cols in DDL.items():
        tenv.execute_sql(f"DROP TEMPORARY TABLE IF EXISTS {name}")
        tenv.execute_sql(f"CREATE TEMPORARY TABLE {name} ({cols}) WITH ('connector' = 'filesystem', "
                         f"'path' = 'file://{os.path.join(root, name)}', 'format' = 'csv')")


FILE_FORMAT: dict[str, str] = {}  # query -> the row format its file sink writes (module docstring)
_outputs = [0]  # file sink directories made so far (each job writes a new one)


def _insert(tenv, query: str, sink: str, out_root: str):
    """Submit the query into its sink (module docstring); returns the TableResult."""
    from pyflink.table import TableDescriptor

    if sink == "blackhole":
        return tenv.sql_query(SQL[query]).execute_insert(TableDescriptor.for_connector("blackhole").build())
    for fmt in ([FILE_FORMAT[query]] if query in FILE_FORMAT else ["csv", "debezium-json"]):
        _outputs[0] += 1
        path = "file://" + os.path.join(out_root, f"{query}-{_outputs[0]}")
        desc = TableDescriptor.for_connector("filesystem").option("path", path).format(fmt).build()
        try:
            result = tenv.sql_query(SQL[query]).execute_insert(desc)
        except Exception as e:  # noqa: BLE001 - csv refused: the query's result has updates or deletes
            if fmt == "csv" and query not in FILE_FORMAT and re.search(r"update|delete", str(e), re.I):
                continue
            raise
        FILE_FORMAT[query] = fmt
        return result
    raise RuntimeError(f"no file format for {query}")  # pragma: no cover - debezium-json takes any changelog


def run_job(tenv, query: str, sink: str = "blackhole", out_root: str = "") -> float:
    """The query into its sink; returns the job's net runtime in ms."""
    t0 = time.perf_counter()
    result = _insert(tenv, query, sink, out_root)
    result.wait()
    wall = (time.perf_counter() - t0) * 1e3
    try:
        return float(result.get_job_client().get_job_execution_result().result().get_net_runtime())
    except Exception:  # noqa: BLE001 - a client without the result: the wall time of submit + run
        return wall


def final_rows(tenv, query: str) -> int:
    """Rows of the final view: +I/+U count one, -D/-U take one away."""
    from pyflink.common import RowKind

    n = 0
    with tenv.sql_query(SQL[query]).execute().collect() as rows:
        for r in rows:
            n += 1 if r.get_row_kind() in (RowKind.INSERT, RowKind.UPDATE_AFTER) else -1
    return n


def main() -> None:
    a = json.loads(sys.argv[1])
    ckpt = os.path.join(a["root"], f"flink-checkpoints-{a['mode']}")
    os.makedirs(ckpt, exist_ok=True)
    tenv = environment(a["parallelism"], a["mode"], a.get("checkpoint_ms", 1000), ckpt)
    data, empty = os.path.join(a["root"], "csv"), os.path.join(a["root"], "csv-empty")
    sink = a.get("sink", "blackhole")
    out_root = os.path.join(a["root"], f"flink-out-{a['mode']}")
    for q in a["queries"]:
        try:
            if a.get("check"):
                register(tenv, data)
                print(json.dumps({"query": q, "rows": final_rows(tenv, q)}), flush=True)
                continue
            register(tenv, empty)
            run_job(tenv, q, sink, out_root)  # once before timing: the first job of a JVM also pays class loading
            # and JIT; its noise is the short jobs' error
            empty_ms = statistics.median(run_job(tenv, q, sink, out_root) for _ in range(3))
            register(tenv, data)
            job_ms = run_job(tenv, q, sink, out_root)
            # the data job's sink directory (the last one made): the bytes its file sink wrote
            sink_dir = os.path.join(out_root, f"{q}-{_outputs[0]}")
            sink_bytes = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(sink_dir) for f in fs)
            print(json.dumps({"query": q, "seconds": (job_ms - empty_ms) / 1e3, "job_ms": job_ms,
                              "empty_ms": empty_ms, "sink": FILE_FORMAT.get(q, sink),
                              "sink_bytes": sink_bytes}), flush=True)
            shutil.rmtree(out_root, ignore_errors=True)  # (the jobs' files: not kept, as ours are not)
        except Exception as e:  # noqa: BLE001 - Flink's (py4j) error, reported for this query; the others run
            print(json.dumps({"query": q, "error": f"{type(e).__name__}: {str(e)[:1500]}"}), flush=True)


if __name__ == "__main__":
    main()
