"""Runs every code block of the README as written: each Python block (checking every printed value against the
comment beside its print()), the Spark and Kafka blocks where Java is installed, and the demo's shell block;
the install and wheel blocks are run by .ci/run, which reads them from the README (marked ``# CI runs this``)."""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPARK = "# Spark: needs Java 17"
POSTGRES = "# Postgres: needs a server"  # run by tests/connectors/test_postgres.py with the test server


def _blocks(lang: str) -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return re.findall(rf"```{lang}\n(.*?)```", f.read(), flags=re.S)


def _literal_prefix(text: str):
    """The longest prefix of ``text`` ending in ``}`` that is a Python literal (a comment may go on after it)."""
    for end in sorted((i + 1 for i, ch in enumerate(text) if ch == "}"), reverse=True):
        try:
            return ast.literal_eval(text[:end])
        except (SyntaxError, ValueError):
            continue
    raise ValueError(f"no literal at the start of {text!r}")


def _run_checked(block: str) -> None:
    expected = [_literal_prefix(m.group(1)) for m in re.finditer(r"print\(.*\)\s+# (\{.*)$", block, flags=re.M)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md", "exec"), {"__name__": "__readme__"})
    printed = [ast.literal_eval(line) for line in out.getvalue().splitlines()]
    assert printed == expected


def _java() -> bool:
    home = os.environ.get("JAVA_HOME")
    return bool(shutil.which("java") or (home and os.path.exists(os.path.join(home, "bin", "java"))))


def test_every_block_is_run_somewhere() -> None:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        langs = re.findall(r"```(\w*)\n.*?```", f.read(), flags=re.S)
    assert set(langs) <= {"python", "bash"}, langs  # no block in a language nothing runs
    bash = _blocks("bash")
    assert sum("# CI runs this" in b for b in bash) + sum("dbsp_core demo --kill-after" in b for b in bash) \
        + sum(b.startswith("# tests/sql/test_run.py runs this block") for b in bash) == len(bash)


def test_readme_examples_print_what_they_say() -> None:
    blocks = [b for b in _blocks("python") if not b.startswith((SPARK, POSTGRES))]
    assert len(blocks) >= 5
    for block in blocks:
        _run_checked(block)


def _spark_blocks() -> list[str]:
    if not _java():
        pytest.skip("Java is not installed (the Spark blocks start a JVM)")
    pytest.importorskip("pyspark")
    import pyspark

    os.environ.setdefault("SPARK_HOME", os.path.dirname(pyspark.__file__))
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()  # the blocks start their own local[2] session
    return [b for b in _blocks("python") if b.startswith(SPARK)]


@pytest.mark.spark
def test_readme_spark_examples_print_what_they_say() -> None:
    blocks = [b for b in _spark_blocks() if "kafka" not in b]
    assert len(blocks) == 2
    try:
        for block in blocks:
            _run_checked(block)
    finally:
        from pyspark.sql import SparkSession

        s = SparkSession.getActiveSession()
        if s is not None:
            s.stop()


class _KafkaAsFiles:
    """Stands in for ``spark`` in ``start_from_kafka``: ``readStream.format("kafka")...load()`` gives a file stream
    with Kafka's record schema instead of a broker's; everything else is the real session."""

    SCHEMA = ("key binary, value binary, topic string, partition int, offset long, timestamp timestamp, "
              "timestampType int")

    def __init__(self, spark, directory: str) -> None:
        self.spark, self.directory, self.options = spark, directory, {}

    @property
    def readStream(self):  # noqa: N802 (Spark's name)
        return self

    def format(self, name: str):
        assert name == "kafka"
        return self

    def option(self, k: str, v: str):
        self.options[k] = v
        return self

    def load(self):
        return self.spark.readStream.schema(self.SCHEMA).parquet(self.directory)


@pytest.mark.spark
def test_readme_kafka_example(tmp_path) -> None:
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    import dbsp_core as dbsp

    (block,) = [b for b in _spark_blocks() if "kafka" in b]
    ns: dict = {"__name__": "__readme__"}
    exec(compile(block, "README.md", "exec"), ns)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    try:
        c = dbsp.Circuit()
        bids = c.input("bids", pa.schema([("auction", pa.int64()), ("price", pa.int64())]))
        c.output("totals", bids.group_by("auction").agg(total=dbsp.sum("price")))
        p = dbsp.Pipeline(c, storage=str(tmp_path / "pipe"))
        records = tmp_path / "records"
        records.mkdir()
        values = [json.dumps({"auction": a, "price": pr}).encode() for a, pr in [(1, 10), (1, 7), (2, 3)]]
        pq.write_table(pa.table({"key": pa.array([None] * 3, pa.binary()), "value": values,
                                 "topic": ["bids"] * 3, "partition": pa.array([0] * 3, pa.int32()),
                                 "offset": [0, 1, 2], "timestamp": pa.array([0] * 3, pa.timestamp("us")),
                                 "timestampType": pa.array([0] * 3, pa.int32())}), str(records / "0.parquet"))
        shim = _KafkaAsFiles(spark, str(records))
        q = ns["start_from_kafka"](shim, p, "broker:9092", "bids", str(tmp_path / "ck"))
        q.processAllAvailable()
        q.stop()
        assert shim.options["subscribe"] == "bids" and shim.options["kafka.bootstrap.servers"] == "broker:9092"
        view: dict = {}
        for _, z in p.read_output("totals"):
            for row, w in z.to_dict().items():
                view[row] = view.get(row, 0) + w
        assert {r for r, w in view.items() if w} == {(1, 17), (2, 3)}
        p.close()
    finally:
        spark.stop()


def test_readme_demo_commands(tmp_path) -> None:
    """The demo's shell block as written (a kill -9 and recovery, a kept directory, inspect and read)."""
    (block,) = [b for b in _blocks("bash") if "dbsp_core demo --kill-after" in b]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "verified against DuckDB" in r.stdout and "state w0" in r.stdout and "step 3:" in r.stdout
