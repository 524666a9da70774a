"""SQLite's sqllogictest (the files vendored under tests/sql/sqllogictest) through the SQL front end: a sample of
queries drawn per run (seed printed in the header and in every failure; replay with DBSP_SLT_SEED), each at a worker
count drawn per file from the seed. No query may be answered wrongly or fail with anything but a refusal (slt.py
says how each query is judged); refusals, timeouts and dialect differences are counted and printed.

The default run draws a few queries per file; ``-m slow`` (CI's long suite) draws a few thousand in all, and
DBSP_SLT_QUERIES=N sets the number per file (``python tests/sql/slt.py`` runs whole files, see its docstring).
"""

from __future__ import annotations

import os
import random

import pytest

import slt

SEED = int(os.environ.get("DBSP_SLT_SEED", str(random.SystemRandom().randrange(2**31))))


def _run(per_file: int, timeout: float) -> slt.Runner:
    rng = random.Random(SEED)
    runners = []
    for path in slt.vendored():
        n = int(os.environ.get("DBSP_SLT_QUERIES", per_file))
        r = slt.Runner(timeout=timeout, workers=rng.choice([1, 2, 4]))
        r.run_file(path, n, rng)
        runners.append(r)
    out = slt.Runner()
    out.outcomes = [o for r in runners for o in r.outcomes]
    return out


def _check(r: slt.Runner) -> None:
    table = r.table()
    print(f"\nsqllogictest sample, seed {SEED} (replay: DBSP_SLT_SEED={SEED})\n{table}")
    bad = [o for o in r.outcomes if o.kind in ("wrong", "error") or o.detail.startswith("reference")]
    shown = "\n".join(f"[{o.kind}] {o.file}:{o.line}\n{o.sql}\n  -> {o.detail}" for o in bad[:10])
    assert not bad, (f"{len(bad)} queries answered wrongly or failed (seed {SEED}, replay: DBSP_SLT_SEED={SEED})\n"
                     f"{shown}\n\n{table}")
    counts = r.counts()
    assert counts["pass"] > 0, f"no query passed: the runner checked nothing\n{table}"


def test_sqllogictest_sample() -> None:
    """A few queries of every vendored file (about 80 in all; select4/5's joins of up to 8 tables included)."""
    _check(_run(per_file=8, timeout=3.0))


@pytest.mark.slow
def test_sqllogictest_thousands() -> None:
    """About 3,000 queries: 300 from each file."""
    _check(_run(per_file=300, timeout=5.0))
