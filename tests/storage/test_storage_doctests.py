"""Runs the docstring examples of the storage modules (the public API's runnable examples)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["dbsp_core.storage.database", "dbsp_core.storage.steplog", "dbsp_core.storage.faults",
           "dbsp_core.storage.outputlog_format1", "dbsp_core.storage.consumers",
           "dbsp_core.storage.snapshot", "dbsp_core.storage.logstore", "dbsp_core.storage.store_faults",
           "dbsp_core.storage.retry"]


@pytest.mark.parametrize("name", MODULES)
def test_storage_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0
