"""Runs the docstring examples of the Z-set module (the public API's runnable examples)."""

from __future__ import annotations

import doctest

import dbsp_core.zset


def test_zset_docstring_examples() -> None:
    result = doctest.testmod(dbsp_core.zset, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted >= 8
