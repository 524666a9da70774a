"""Example counts for Hypothesis tests: ``examples(n)`` is a test's own count ``n`` scaled by DBSP_HYPOTHESIS_EXAMPLES (relative to the default count), so the variable raises or lowers every test's examples, also those that set their own."""

from __future__ import annotations

import os

DEFAULT_EXAMPLES = 60


def examples(n: int) -> int:
    """``n`` examples at the default setting, scaled by DBSP_HYPOTHESIS_EXAMPLES / DEFAULT_EXAMPLES (at least 1).

    >>> examples(6) if "DBSP_HYPOTHESIS_EXAMPLES" not in os.environ else 6
    6
    """
    want = os.environ.get("DBSP_HYPOTHESIS_EXAMPLES")
    return n if want is None else max(1, round(n * int(want) / DEFAULT_EXAMPLES))
