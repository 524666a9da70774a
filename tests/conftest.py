"""Shared pytest configuration: the Hypothesis profile, with a seed that varies between runs, is printed and replays a run (DBSP_HYPOTHESIS_SEED), example counts from DBSP_HYPOTHESIS_EXAMPLES, and the long suite (tests marked ``slow``) kept out of the default run.

The README's test command (``python -m pytest -q tests``) runs every test not marked ``slow`` and stays within
about ten minutes on two cores. The long suite (kill loops, soaks, full corpora, large data) runs with
``python -m pytest -q tests -m slow`` (what ``.ci/run`` does after the README command), or together with the
rest with ``--long`` or ``DBSP_LONG=1``. A deselected test is counted in pytest's summary ("N deselected").
"""

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


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", default=False,
                     help="also run the long suite (tests marked slow); same as DBSP_LONG=1")


def _long_suite_wanted(config) -> bool:
    """True when the tests marked slow should run: --long, DBSP_LONG=1, or a -m expression that names them."""
    return (config.getoption("--long") or os.environ.get("DBSP_LONG") == "1"
            or "slow" in (config.getoption("markexpr", "") or ""))


def pytest_collection_modifyitems(config, items):
    """Deselect the long suite (tests marked slow) unless it is asked for (module docstring)."""
    if _long_suite_wanted(config):
        return
    keep = [item for item in items if item.get_closest_marker("slow") is None]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("slow") is not None])
        items[:] = keep


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
