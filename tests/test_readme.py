"""Runs the README's Python examples and checks every printed value against the comment beside its print()."""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _blocks() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_readme_examples_print_what_they_say() -> None:
    blocks = _blocks()
    assert len(blocks) >= 2
    for block in blocks:
        expected = [ast.literal_eval(m.group(1)) for m in re.finditer(r"print\(.*\)\s+# (\{.*?\})", block)]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, "README.md", "exec"), {})
        printed = [ast.literal_eval(line) for line in out.getvalue().splitlines()]
        assert printed == expected
