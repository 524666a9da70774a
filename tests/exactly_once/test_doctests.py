"""Runs the docstring examples of the durable pipeline's modules (their public API's runnable examples)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["dbsp_core.runtime.driver", "dbsp_core.storage.inspect", "dbsp_core.storage.directory", "dbsp_core.storage.outputlog", "dbsp_core.codec", "dbsp_core.operators.temporal"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0
