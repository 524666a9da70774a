"""FileSource and ParquetSink on an object store (moto's S3 server, tests/s3_server.py): files listed and read through
pyarrow.fs, a restart that pushes nothing twice, quarantine by copy and delete, step files written as single PUTs,
and no credential in any name or message."""

from __future__ import annotations

import io
import logging
import os
import random

import duckdb
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

import dbsp_core as dbsp
from dbsp_core.connectors import FileSource, ParquetSink, read_parquet_view
from dbsp_core.errors import InputFileError
from dbsp_core.storage.location import mask_uri, resolve

SEED = int(os.environ.get("DBSP_FILES_SEED", random.randrange(2**31)))
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def _circuit() -> dbsp.Circuit:
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("s", t.group_by("k").agg(n=dbsp.count(), s=dbsp.sum("v")))
    return c


def _put(fs, path: str, data: bytes) -> None:
    with fs.open_output_stream(path) as f:
        f.write(data)


def _parquet(table: pa.Table, row_group_size: int) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=row_group_size)
    return buf.getvalue()


def _csv(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pacsv.write_csv(table, buf)
    return buf.getvalue()


def _expected(tables: list[pa.Table]) -> dict:
    all_rows = pa.concat_tables(tables)  # noqa: F841 - read by DuckDB below
    rows = duckdb.sql("SELECT k, count(*), sum(v) FROM all_rows GROUP BY k").fetchall()
    return {tuple(r): 1 for r in rows}


def test_file_source_reads_a_bucket_once_across_restarts(s3_server, tmp_path, caplog):
    rng = random.Random(SEED)
    print(f"object-store file source: seed {SEED} (replay: DBSP_FILES_SEED={SEED})")
    fs, bucket = s3_server.filesystem(), s3_server.bucket()
    tables = []
    for i in range(6):
        n = rng.randrange(1, 400)
        t = pa.table({"k": [rng.randrange(20) for _ in range(n)], "v": [rng.randrange(-50, 50) for _ in range(n)]})
        tables.append(t)
        if i % 2:
            _put(fs, f"{bucket}/in/sub/f{i}.csv", _csv(t))
        else:
            _put(fs, f"{bucket}/in/f{i}.parquet", _parquet(t, row_group_size=max(1, n // 3)))
    _put(fs, f"{bucket}/in/_ignored/x.csv", b"k,v\n1,1\n")  # names starting with '_' are never read
    _put(fs, f"{bucket}/in/.tmp.csv", b"k,v\n1,1\n")
    _put(fs, f"{bucket}/in/bad.csv", b"k,v\n1,one\n")
    uri = s3_server.uri(bucket, "in")
    store = str(tmp_path / "p")

    p = dbsp.Pipeline(_circuit(), storage=store)
    src = FileSource(p, "t", uri, recursive=True, on_error="quarantine")
    assert "secret" not in src.name and "?" not in src.name and src.name.startswith("t@s3://")
    pushes = src.poll()
    assert pushes >= 6, pushes  # every Parquet row group and every CSV file, each a push
    view = dict(p.step()["s"].to_dict())
    assert view == _expected(tables)
    assert src.stats["quarantined"] == 1 and src.errors[0][0] == "bad.csv"
    names = {i.path for i in fs.get_file_info(pafs.FileSelector(f"{bucket}/in", recursive=True))}
    assert f"{bucket}/in/_quarantine/bad.csv" in names and f"{bucket}/in/_quarantine/bad.csv.error" in names
    assert f"{bucket}/in/bad.csv" not in names  # moved: copied, then deleted
    assert src.poll() == 0  # nothing new
    p.close()

    # a restart with a source made again: every file is acknowledged, nothing is pushed twice; a new file is read
    extra = pa.table({"k": [1, 2, 3], "v": [7, 8, 9]})
    _put(fs, f"{bucket}/in/z.parquet", _parquet(extra, 2))
    p = dbsp.Pipeline.open(store, _circuit())
    src = FileSource(p, "t", uri, recursive=True, on_error="quarantine")
    assert src.poll() == 2  # z.parquet's two row groups only
    assert src.stats["skipped"] > 0  # the old files' row groups, known acknowledged without reading them
    out = p.step()["s"].to_dict()
    total = dict(view)
    for r, w in out.items():
        total[r] = total.get(r, 0) + w
    assert {r: w for r, w in total.items() if w} == _expected(tables + [extra])

    # a rewritten object (another size) is not read again, but warned about and counted
    with caplog.at_level(logging.WARNING):
        _put(fs, f"{bucket}/in/z.parquet", _parquet(pa.table({"k": [5], "v": [5]}), 1))
        assert src.poll() == 0
    assert src.stats["rewritten"] == 1 and "rewritten" in caplog.text
    p.close()


def test_file_source_with_a_filesystem_object_and_a_bad_file(s3_server, tmp_path):
    fs, bucket = s3_server.filesystem(), s3_server.bucket()
    _put(fs, f"{bucket}/d/a.csv", b"k,v\n1,2\n")
    _put(fs, f"{bucket}/d/b.csv", b"k,v\n1,two\n")
    p = dbsp.Pipeline(_circuit(), storage=str(tmp_path / "p"))
    src = FileSource(p, "t", f"{bucket}/d", filesystem=fs)
    with pytest.raises(InputFileError, match="b.csv"):
        src.poll()
    assert dict(p.step()["s"].to_dict()) == {(1, 1, 2): 1}
    p.close()


def test_parquet_sink_writes_step_files_to_a_bucket(s3_server, tmp_path):
    fs, bucket = s3_server.filesystem(), s3_server.bucket()
    p = dbsp.Pipeline(_circuit(), storage=str(tmp_path / "p"))
    uri = s3_server.uri(bucket, "out/view")
    sink = ParquetSink(p, "s", uri)
    rng = random.Random(SEED)
    pushed, live = [], {}
    for _ in range(5):
        t = pa.table({"k": [rng.randrange(10) for _ in range(50)], "v": [rng.randrange(9) for _ in range(50)]})
        pushed.append(t)
        p.push("t", t)
        for r, w in p.step()["s"].to_dict().items():
            live[r] = live.get(r, 0) + w
    assert sink.poll() == 5
    names = sorted(i.path.rsplit("/", 1)[1] for i in fs.get_file_info(
        pafs.FileSelector(f"{bucket}/out/view")))
    assert names == ["_next"] + [f"step-{s:020d}.parquet" for s in range(5)]
    with fs.open_input_stream(f"{bucket}/out/view/_next") as f:
        assert f.read() == b"5\n"
    got = read_parquet_view(uri, SCHEMA).to_dict()
    assert dict(got) == {r: w for r, w in live.items() if w} == _expected(pushed)
    assert dict(read_parquet_view(f"{bucket}/out/view", filesystem=fs).to_dict()) == dict(got)
    sink.close()
    p.close()


def test_credentials_never_shown():
    uri = "s3://AKIAXXX:s3cr3t@bucket/p?endpoint_override=127.0.0.1:9&secret_key=s3cr3t&access_key=AKIAXXX&region=r"
    shown = mask_uri(uri)
    assert "s3cr3t" not in shown and "AKIAXXX" not in shown
    assert "endpoint_override=127.0.0.1:9" in shown and "region=r" in shown
    with pytest.raises(ValueError) as e:
        resolve("nosuchscheme://s3cr3t@x/y?secret_key=s3cr3t", what="d")
    assert "s3cr3t" not in str(e.value)
