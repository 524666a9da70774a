"""Microbenchmarks of the step log's reads: reopening a log of many segments and reading every record, the
work a recovery or a consumer catching up does (csrc/steplog.c: the last segment stays open, sealed ones are
opened when read, at most 16 cached)."""

from __future__ import annotations

import pytest

from dbsp_core.storage import StepLog

SEGMENTS = 1_000


@pytest.fixture(scope="module")
def long_log(tmp_path_factory) -> str:
    """A log of ~1,000 small segments (4 KiB; two 3,000-byte records each, fsynced one by one)."""
    d = str(tmp_path_factory.mktemp("steplog") / "log")
    with StepLog(d, segment_bytes=4096) as log:
        for i in range(SEGMENTS):
            log.append(i, "h", b"x" * 3000, seq=i)
        assert log.segments >= SEGMENTS
    return d


def test_steplog_open_1000_segments(benchmark, long_log) -> None:
    """A writer's open: every segment scanned and checked (invariant 6), then closed (past the cache)."""
    def reopen() -> None:
        StepLog(long_log, segment_bytes=4096).close()

    benchmark.pedantic(reopen, rounds=10, warmup_rounds=1)


def test_steplog_read_all_1000_segments(benchmark, long_log) -> None:
    """Every record of an open log, oldest first: each sealed segment opened again once it left the cache."""
    with StepLog(long_log, segment_bytes=4096) as log:
        n = benchmark.pedantic(lambda: sum(1 for _ in log.iter_from(0)), rounds=10, warmup_rounds=1)
    assert n == SEGMENTS
