"""Smoke test of an installed wheel (run by .ci/run from a directory outside the checkout, in a venv with no C
compiler on PATH): the package comes from site-packages, the C extensions load, and a durable pipeline pushes,
steps, recovers after close, feeds a Parquet sink as a registered consumer and serves its metrics."""

import os
import sys
import tempfile

import pyarrow as pa

import dbsp_core as dbsp
import spark_glue  # noqa: F401  (ships in the wheel; pyspark itself is an extra)
from dbsp_core import _storage, _zset  # noqa: F401  the compiled extensions
from dbsp_core.connectors import ParquetSink, read_parquet_view
from dbsp_core.metrics import prometheus_text

assert "site-packages" in dbsp.__file__, f"dbsp_core imported from {dbsp.__file__}, not from the installed wheel"
c = dbsp.Circuit()
t = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]))
c.output("sums", t.group_by("k").agg(s=dbsp.sum("v")))
d = tempfile.mkdtemp()
p = dbsp.Pipeline(c, workers=2, storage=d)
p.push("t", pa.table({"k": [1, 1, 2], "v": [1, 2, 3]}), producer="smoke", seq=0)
assert p.step()["sums"].to_dict() == {(1, 3): 1, (2, 3): 1}
p.close()
q = dbsp.Pipeline.open(d, c, workers=3)
assert q.push("t", pa.table({"k": [1, 1, 2], "v": [1, 2, 3]}), producer="smoke", seq=0).duplicate
out = tempfile.mkdtemp()
sink = ParquetSink(q, "sums", out)
assert sink.poll() == 1 and read_parquet_view(out).to_dict() == {(1, 3): 1, (2, 3): 1}
assert "dbsp_steps_total" in prometheus_text(q)
q.close()
print(f"wheel smoke test passed: dbsp_core {dbsp.__version__} from {os.path.dirname(dbsp.__file__)}, "
      f"python {sys.version.split()[0]}")
