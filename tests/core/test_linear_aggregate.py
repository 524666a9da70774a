"""The linear aggregate's step (old totals read in place, trace batches built in index order) against a dict model."""

from __future__ import annotations

import pyarrow as pa
from hypothesis import given
from hypothesis import strategies as st

import dbsp_core as dbsp
from dbsp_core import _zset

SCHEMA = pa.schema([("k", pa.int64()), ("s", pa.string()), ("v", pa.int64())])

rows = st.tuples(st.one_of(st.none(), st.integers(0, 6)), st.sampled_from(["a", "b", None]),
                 st.one_of(st.none(), st.integers(-5, 5)))


def _model(bag: dict) -> dict:
    """{(k, s): (count, sum or None, count(v))} over rows with non-zero multiplicity, as SQL GROUP BY does."""
    out: dict = {}
    for (k, s, v), m in bag.items():
        c, t, n = out.get((k, s), (0, 0, 0))
        out[(k, s)] = (c + m, t + (v or 0) * m, n + (m if v is not None else 0))
    return {key: (c, t if n else None, n) for key, (c, t, n) in out.items() if c != 0}


@given(st.lists(st.lists(st.tuples(rows, st.sampled_from([1, 1, 2, -1])), max_size=12), min_size=1, max_size=6),
       st.sampled_from([1, 2]))
def test_linear_aggregate_matches_model_and_keeps_trace_batches_in_index_order(steps, workers):
    c = dbsp.Circuit()
    t = c.input("t", SCHEMA)
    c.output("g", t.group_by("k", "s").agg(n=dbsp.count(), total=dbsp.sum("v"), nv=dbsp.count("v")))
    bag: dict = {}
    view: dict = {}
    with dbsp.Pipeline(c, workers=workers) as p:
        for step in steps:
            for r, w in step:
                if w < 0 and bag.get(r, 0) <= 0:
                    continue  # delete only rows that are there (a relation)
                bag[r] = bag.get(r, 0) + w
                p.push("t", dbsp.ZSet.from_rows([r], SCHEMA, weights=[w]))
            for row, w in p.step()["g"].to_dict().items():
                view[row] = view.get(row, 0) + w
            view = {r: w for r, w in view.items() if w}
            assert all(w == 1 for w in view.values())
            assert {(k, s): (n, tot, nv) for (k, s, n, tot, nv) in view} == _model(bag)
            for wk in range(workers):
                for trace in p.traces(wk).values():
                    for b in trace.batches:
                        keypos = [b.schema.get_field_index(k) for k in b.key]
                        assert _zset.check_order(b.zset.data, b.zset.weights, b.key_hash, keypos)
