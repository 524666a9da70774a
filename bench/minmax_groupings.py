"""What an append-only min/max's groupings cost on a real Nexmark step (q4 or q7, W=1): the reduction's grouping and
gather then the kernel's probe of the reduced rows (operators/aggregate.py invariant 8 before r37-minmax), against
the kernel's probe of the whole change (after), best of 30 warm calls, thread CPU, against the same totals key index.

Run:  python bench/minmax_groupings.py q4 [--events 1000000]

It runs bench/nexmark_profile.py's loop and measures at the 9th step of the aggregate, before that step runs (the
index then holds eight steps' totals). The probe only reads the index.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dbsp_core.operators.aggregate as A  # noqa: E402
from dbsp_core import _zset  # noqa: E402
from dbsp_core.operators.base import conform  # noqa: E402
from dbsp_core.zset import ZSet, _take  # noqa: E402


def best_ms(f, n: int = 30) -> float:
    b = float("inf")
    for _ in range(n):
        t0 = time.thread_time()
        f()
        b = min(b, time.thread_time() - t0)
    return b * 1e3


def measure(st: "A._ExtremesState", z: ZSet, query: str) -> None:
    z = conform(z, st.op.in_schema)
    ix = st.totals.index_for_update(st.spec)
    keys, slots, w = list(st.keypos), st.slot_specs, z.weights

    def reduction():
        return _zset.group_reduce(z.data, w, keys, list(st.reduce_specs), False)

    g, _, iv, _, va = reduction()
    rows = np.ascontiguousarray(np.where(va[:, 1].astype(bool), iv[:, 1], g), dtype=np.int64)
    reduced = ZSet._make(_take(z.data, rows), np.ascontiguousarray(iv[:, 0]))
    full = _zset.BatchView(z.data, z.weights)
    small = _zset.BatchView(reduced.data, reduced.weights)
    t_red = best_ms(reduction)
    t_take = best_ms(lambda: _take(z.data, rows))
    t_small = best_ms(lambda: _zset.extremes_probe_inserts(small, keys, slots, ix))
    t_full = best_ms(lambda: _zset.extremes_probe_inserts(full, keys, slots, ix))
    st.totals.index_done(ix)
    print(f"{query}: change {z.num_rows} rows, {len(g)} groups; before: reduction {t_red:.2f} + gather {t_take:.2f} + "
          f"probe of the reduced rows {t_small:.2f} = {t_red + t_take + t_small:.2f} ms; after: probe of the whole "
          f"change {t_full:.2f} ms (best of 30, thread CPU)", file=sys.stderr)


def main() -> None:
    query = sys.argv[1]
    sys.argv = [sys.argv[0], query, "--workers", "1"] + sys.argv[2:]
    seen = [0]
    step = A._ExtremesState._step

    def _step(self, inputs, ctx):
        if seen[0] == 8 and self.reduce_specs is not None and self.spec is not None:
            measure(self, inputs[0], query)
        seen[0] += 1
        return step(self, inputs, ctx)

    A._ExtremesState._step = _step
    import nexmark_profile

    with contextlib.redirect_stdout(io.StringIO()):
        nexmark_profile.main()


if __name__ == "__main__":
    main()
