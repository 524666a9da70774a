"""The (producer, seq) dedup set of the durable pipeline against a plain Python set, including a save/load round trip through a worker Database."""

from __future__ import annotations

import os

from hypothesis import given
from hypothesis import strategies as st

from dbsp_core.storage.dedup import SeenSet as _Seen
from dbsp_core.storage import Database

pairs = st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 40)), max_size=120)


@given(pairs, pairs)
def test_seen_matches_a_set_and_survives_save_load(tmp_path_factory, added, probes):
    seen, model = _Seen(), set()
    for p, s in added:
        assert seen.has(p, s) == ((p, s) in model)
        seen.add(p, s)
        model.add((p, s))
    for p, s in probes + added:
        assert seen.has(p, s) == ((p, s) in model)
    # compact: the seqs kept explicitly are exactly those above each producer's dense prefix
    for p, wm in seen.wm.items():
        assert all((p, s) in model for s in range(wm + 1)) and (p, wm + 1) not in model
    d = tmp_path_factory.mktemp("db")
    with Database(os.path.join(d, "w0.db")) as db:
        with db.open(0) as h:
            seen.save(h)
            h.commit()
        with db.open(1) as h:
            back = _Seen()
            back.load(h, "test")
    for p, s in probes + added:
        assert back.has(p, s) == ((p, s) in model)
