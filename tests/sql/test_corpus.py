"""Every view of the SQL corpus (corpus.py), in every run, checked against DuckDB after random steps with deletions: groups of views share a pipeline at a worker count drawn from the run's seed, printed in the pytest header and after the summary (sql_oracle.py)."""

from __future__ import annotations

import pytest

from corpus import CORPUS, DDL, RATES, TABLES
from sql_oracle import run_views, select

SEED, GROUPS = select(CORPUS)
STEPS, MAX_ROWS = 8, 10  # per group: random steps, most rows changed per table and step (e: RATES)


@pytest.mark.parametrize("index", range(len(GROUPS)), ids=[f"{n}-W{w}" for n, _, w in GROUPS])
def test_views_match_duckdb(index: int) -> None:
    name, entries, workers = GROUPS[index]
    run_views(DDL, TABLES, entries, SEED + 1000 * index + workers, workers, steps=STEPS, max_rows=MAX_ROWS,
              label=f"corpus views {name}; replay: DBSP_SQL_SEED={SEED}", rates=RATES)


def test_every_view_runs() -> None:
    """The groups hold every view of the corpus once per worker count they run at (nothing is sampled)."""
    per_view: dict[int, int] = {}
    for _, entries, _ in GROUPS:
        for e in entries:
            per_view[id(e)] = per_view.get(id(e), 0) + 1
    assert set(per_view) == {id(e) for e in CORPUS}
    assert len(set(per_view.values())) == 1
