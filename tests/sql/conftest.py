"""Makes the reference models of tests/core (oracle.py) importable here, and prints the SQL corpus seed."""

import os
import sys

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "core"))


def pytest_report_header(config):
    from sql_oracle import corpus_selection

    from test_sqllogictest import SEED as SLT_SEED

    seed, views, total, workers = corpus_selection()
    return (f"sql corpus: seed {seed} (replay: DBSP_SQL_SEED={seed}), {views} of {total} views, workers {workers} "
            f"(DBSP_SQL_CORPUS=all runs every group at W=1, 2 and 4); "
            f"sqllogictest sample: seed {SLT_SEED} (replay: DBSP_SLT_SEED={SLT_SEED})")


def pytest_terminal_summary(terminalreporter):
    """The seed again at the end (the header is hidden by -q): the seed to rerun a failing run with."""
    if any("test_corpus" in i.nodeid or "test_sqllogictest" in i.nodeid
           for i in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", [])):
        terminalreporter.write_line(pytest_report_header(None))
