"""Runs the docstring examples of the storage module (the public API's runnable examples)."""

from __future__ import annotations

import doctest

import dbsp_core.storage


def test_storage_docstring_examples() -> None:
    result = doctest.testmod(dbsp_core.storage, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0
