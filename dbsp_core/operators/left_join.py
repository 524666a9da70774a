"""The left outer join, composed from incremental operators: the inner join plus the left rows without a match, padded with nulls.

Invariants:
  1. left_join(L, R) == join(L, R) + pad(L - semijoin(L, distinct(keys(R)))): a left row appears once per
     matching right row, or once with null right columns when no right row has its key (a null key never
     matches). Every part is an incremental operator, so the law holds after every step, including when
     the last matching right row is deleted (the padded row comes back) or arrives (it goes away).
  2. Output columns are those of the inner join with the same ``on=``/``left_on``/``right_on`` naming rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from dbsp_core.circuit import Stream


def left_join(left: "Stream", right: "Stream", left_on: Sequence[str], right_on: Sequence[str],
              drop_right_keys: bool) -> "Stream":
    """Build the sub-circuit of invariant 1 and return its output stream."""
    inner = left._join(right, left_on, right_on, drop_right_keys, kind="left_join")
    keys = right.select(**{f"__k{i}": pc.field(k) for i, k in enumerate(right_on)}).distinct()
    matched = left._join(keys, left_on, [f"__k{i}" for i in range(len(right_on))], True, kind="left_join")
    lcols = left.schema.names
    matched_left = matched.select(**{c: pc.field(c) for c in lcols})
    unmatched = left._exchanged(tuple(left_on)) - matched_left
    pad = {c: pc.field(c) for c in lcols}
    for f in list(inner.schema)[len(lcols):]:
        pad[f.name] = pc.scalar(pa.scalar(None, type=f.type))
    return inner + unmatched.select(**pad)
