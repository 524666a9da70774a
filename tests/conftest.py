"""Shared pytest configuration: the Hypothesis profile, with a seed that varies between runs, is printed (in the header, after the summary, which ``-q`` shows, and in every failure's report) and replays a run (DBSP_HYPOTHESIS_SEED), example counts from DBSP_HYPOTHESIS_EXAMPLES, and the ``spark`` marker recorded in the JUnit report (CI's no-Spark-test-skipped check selects by it)."""

import os
import random
import sys

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))  # hypothesis_profile, for tests that set their own example counts

from hypothesis_profile import DEFAULT_EXAMPLES  # noqa: E402

_SEED_ENV = os.environ.get("DBSP_HYPOTHESIS_SEED", "")
DERANDOMIZE = _SEED_ENV == "derandomize"
SEED = None if DERANDOMIZE else int(_SEED_ENV) if _SEED_ENV else random.randrange(2**32)

settings.register_profile(
    "ci",
    derandomize=DERANDOMIZE,
    database=None,  # a run depends on its seed only
    deadline=None,
    max_examples=int(os.environ.get("DBSP_HYPOTHESIS_EXAMPLES", str(DEFAULT_EXAMPLES))),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile("ci")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Hand the seed to Hypothesis's pytest plugin (unless --hypothesis-seed was given)."""
    if SEED is not None and config.getoption("hypothesis_seed", None) is None:
        config.option.hypothesis_seed = str(SEED)


def pytest_report_header(config):
    seed = config.getoption("hypothesis_seed", None)
    how = "derandomized" if DERANDOMIZE else f"seed {seed} (replay: DBSP_HYPOTHESIS_SEED={seed})"
    return (f"hypothesis: {how}, {settings.default.max_examples} examples per test "
            f"(DBSP_HYPOTHESIS_EXAMPLES)")


def pytest_terminal_summary(terminalreporter, config):
    """The seed again after the summary: ``-q`` hides the header."""
    terminalreporter.write_line(pytest_report_header(config))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report names the Hypothesis seed of the run (shown with the failure, also under -q)."""
    report = yield
    if report.failed:
        report.sections.append(("hypothesis seed", pytest_report_header(item.config)))
    return report


SPARK_FIXTURES = {"spark_local", "spark_cluster", "spark_session_factory"}


def pytest_collection_modifyitems(config, items):
    """Every test that starts Spark carries the ``spark`` marker (a test under tests/spark or using a Spark
    fixture without it is a usage error), and the marker goes into the JUnit report as the property
    ``marker=spark``: .ci/run checks that no test so marked was skipped."""
    unmarked = []
    for item in items:
        spark_path = "tests/spark/" in item.nodeid or item.nodeid.startswith("spark/")
        uses = SPARK_FIXTURES & set(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("spark") is not None:
            item.user_properties.append(("marker", "spark"))
        elif spark_path or uses:
            unmarked.append(item.nodeid)
    if unmarked:
        raise pytest.UsageError(f"tests that start Spark without the spark marker (add pytestmark = "
                                f"pytest.mark.spark): {unmarked[:10]}")
