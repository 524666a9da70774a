"""Shared pytest configuration: the Hypothesis profile, with a seed that varies between runs, is printed and replays a run (DBSP_HYPOTHESIS_SEED), and example counts from DBSP_HYPOTHESIS_EXAMPLES."""

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
