"""The Nexmark queries written in SQL (dbsp_core/nexmark/queries.sql) against the hand-built circuits of dbsp_core.nexmark on the same generated events, with a few earlier rows deleted in every later step (changes.py): the same view after every step, at two step sizes and worker counts. The run's seed is printed after the summary and in every failure (``DBSP_NEXMARK_SEED`` replays it)."""

from __future__ import annotations

import pytest

import dbsp_core as dbsp
from dbsp_core import nexmark
from changes import SEED, Retractions
from oracle import _diff, normalize

EVENTS, RATE = 6000, 300
SPLITS = [(1700, 2), (3000, 1)]


def _run(c: dbsp.Circuit, query: str, per_step: int, workers: int) -> list[dict]:
    views, view = [], {}
    changes = Retractions(SEED + workers)  # the same deletions for both circuits
    with dbsp.Pipeline(c, workers=workers) as p:
        if "side_input" in c.inputs:
            p.push("side_input", nexmark.side_input())
        for batch in nexmark.generate(EVENTS, seed=SEED, batch=per_step, rate=RATE):
            for name, t, weights in changes.step(batch):
                p.push(name, t, weights)
            for row, w in p.step()[query].to_dict().items():
                view[row] = view.get(row, 0) + w
            view = {r: w for r, w in view.items() if w}
            views.append(normalize(view))
        assert sum(p.late_rows.values()) == 0
    assert per_step == EVENTS or changes.deleted > 0, "no row was deleted: the run checks inserts only"
    return views


@pytest.mark.parametrize("query", nexmark.sql_queries())
def test_sql_query_matches_the_hand_built_circuit(query: str) -> None:
    hand, compiled = nexmark.circuit(query, append_only=False), nexmark.sql_circuit(query)  # both take deletions
    assert [f.type for f in compiled.nodes[compiled.outputs[query]].schema] == \
        [f.type for f in hand.nodes[hand.outputs[query]].schema] or query in ("q14",), "column types differ"
    for per_step, workers in SPLITS:
        want = _run(hand, query, per_step, workers)
        got = _run(compiled, query, per_step, workers)
        assert any(want), f"{query}: the hand-built view stays empty; the test shows nothing"
        for step, (g, w) in enumerate(zip(got, want)):
            assert g == w, (f"{query} (SQL) differs from the hand-built circuit after step {step} ({per_step} events "
                            f"per step, W={workers}; replay: DBSP_NEXMARK_SEED={SEED})\nonly in SQL: {dict(list(_diff(g, w).items())[:4])}\n"
                            f"only hand-built: {dict(list(_diff(w, g).items())[:4])}")
