"""Compiled SQL views (a join, a top-k per group, a recursive view, NOT IN) on SparkPipeline: the same changes as the embedded runtime, with the fixpoint gathered in one stage task, across a reopen at another worker count."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("pyspark")

import dbsp_core as dbsp  # noqa: E402
from dbsp_core import sql  # noqa: E402
from spark_glue import SparkPipeline  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "sql"))
from test_compile import VIEWS, _feed  # noqa: E402

pytestmark = pytest.mark.spark


def test_compiled_views_on_spark_match_embedded(spark_local, tmp_path) -> None:
    c = sql.compile(VIEWS)
    p = dbsp.Pipeline(c, workers=2)
    want = [_feed(p, s) for s in range(5)]
    p.close()
    p = SparkPipeline(spark_local, c, workers=2, storage=str(tmp_path))
    got = [_feed(p, s) for s in range(3)]
    p.close()
    p = SparkPipeline.open(spark_local, str(tmp_path), c, workers=3)
    got += [_feed(p, s) for s in range(3, 5)]
    p.close()
    assert got == want
