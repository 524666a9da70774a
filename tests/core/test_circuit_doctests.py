"""Runs the docstring examples of the circuit and runtime modules (the public API's runnable examples)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["dbsp_core.circuit", "dbsp_core.runtime.driver", "dbsp_core.runtime.executor",
           "dbsp_core.operators.context", "dbsp_core.layout", "dbsp_core.trace.levels", "dbsp_core.aggregates",
           "dbsp_core.demo", "dbsp_core.time.watermark", "dbsp_core.operators.window", "dbsp_core.operators.proctime",
           "dbsp_core.nexmark.generator", "dbsp_core.nexmark.queries", "dbsp_core.nexmark.sql_queries", "dbsp_core.sql",
           "dbsp_core.sql.explain", "dbsp_core.metrics", "dbsp_core.profile", "dbsp_core.progress",
           "dbsp_core.trace.merge_thread", "dbsp_core.trace.keyindex", "dbsp_core.trace.sizing", "dbsp_core.operators.upsert",
           "dbsp_core.runtime.readable", "dbsp_core.rows",
           "dbsp_core.runtime.prune"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0
