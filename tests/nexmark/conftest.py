"""Makes the DuckDB reference of the core tests and changes.py importable here, and prints the run's Nexmark seed."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "core"))
sys.path.insert(0, os.path.dirname(__file__))


def pytest_terminal_summary(terminalreporter):
    """The run's Nexmark seed after the summary (-q shows it): the generator's events and the deletions."""
    from changes import SEED

    if any("tests/nexmark/" in r.nodeid for r in terminalreporter.stats.get("passed", [])
           + terminalreporter.stats.get("failed", [])):
        terminalreporter.write_line(f"nexmark: seed {SEED} (replay: DBSP_NEXMARK_SEED={SEED})")
