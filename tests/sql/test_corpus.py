"""Every selected view of the SQL corpus (corpus.py) checked against DuckDB after random steps with deletions; the selection and its seed are printed in the pytest header (sql_oracle.py)."""

from __future__ import annotations

import pytest

from corpus import CORPUS, DDL, RATES, TABLES
from sql_oracle import run_views, select

SEED, CHOSEN = select(CORPUS)


@pytest.mark.parametrize("entry,workers", CHOSEN, ids=[f"{e.name}-W{w}" for e, w in CHOSEN])
def test_view_matches_duckdb(entry, workers: int) -> None:
    run_views(DDL, TABLES, [entry], SEED + workers, workers, label=f"corpus view {entry.name}",
              rates=RATES)
