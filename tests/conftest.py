"""Shared pytest configuration: the Hypothesis profile, with a seed that varies between runs, is printed (in the header, after the summary, which ``-q`` shows, and in every failure's report) and replays a run (DBSP_HYPOTHESIS_SEED), example counts from DBSP_HYPOTHESIS_EXAMPLES, the long suite (tests marked ``slow``) kept out of the default run, and the ``spark`` marker recorded in the JUnit report (CI's no-Spark-test-skipped check selects by it).

The README's test command (``python -m pytest -q tests``) runs every test not marked ``slow`` and stays within
about ten minutes on two cores. The long suite (kill loops, soaks, local-cluster Spark, large data) runs with
``python -m pytest -q tests -m slow`` (what ``.ci/run`` does after the README command), or together with the
rest with ``--long`` or ``DBSP_LONG=1``. A deselected test is counted in pytest's summary ("N deselected").

The test command runs on two worker processes (pytest-xdist, ``-n 2 --dist loadfile`` in pyproject.toml: a test
file's tests share one process, so a module's Spark session or server starts once). Every per-run seed of the test
modules (the ``DBSP_*_SEED`` variables they read, found by :func:`_seed_names`) is drawn here, once, in the process
that starts the workers, and handed to them through the environment: the workers collect the same parametrized
tests (the SQL corpus draws its worker counts from its seed) and run with the seeds printed after the summary,
which replay the run (``DBSP_SQL_SEED=... DBSP_HYPOTHESIS_SEED=... python -m pytest ...``). ``-n 0`` runs in one
process.
"""

import os
import random
import sys

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))  # hypothesis_profile, for tests that set their own example counts

from hypothesis_profile import DEFAULT_EXAMPLES  # noqa: E402


def _seed_names() -> list[str]:
    """The ``DBSP_*_SEED`` variables the test files read (a name followed by ``S``, a count of seeds, is not one)."""
    import re

    here = os.path.dirname(os.path.abspath(__file__))
    names = set()
    for root, _, files in os.walk(here):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(root, f), encoding="utf-8") as fh:
                    names.update(re.findall(r"\bDBSP_[A-Z0-9_]*SEED\b", fh.read()))
    return sorted(names)


DRAWN_SEEDS: dict[str, str] = {}  # the seeds this process drew (the xdist controller, or a run without -n)
if "PYTEST_XDIST_WORKER" not in os.environ:
    for _name in _seed_names():
        if not os.environ.get(_name):
            os.environ[_name] = DRAWN_SEEDS[_name] = str(random.SystemRandom().randrange(2**31))

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


def _deselect_long_suite(config, items) -> None:
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


def pytest_terminal_summary(terminalreporter, config):
    """The seed again after the summary (``-q`` hides the header), and every seed drawn for the run."""
    terminalreporter.write_line(pytest_report_header(config))
    if DRAWN_SEEDS:
        terminalreporter.write_line("seeds of this run (set them to replay it): "
                                    + " ".join(f"{k}={v}" for k, v in sorted(DRAWN_SEEDS.items())))


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
    ``marker=spark``: .ci/run checks that no test so marked was skipped. Then the long suite leaves the run
    unless it is asked for."""
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
    _deselect_long_suite(config, items)
    _heaviest_files_first(items)


# The README command's heaviest files, heaviest first (wall seconds summed over a file's tests in a README run at
# load 5-10, 2026-11-30, /work/wt/runs/rtt2: 189 ... 37). With ``--dist loadfile`` the two workers take whole files in
# collection order, and these came near its end: a worker could be left with one big file while the other sat idle.
# Given first, the small files fill the tail (a two-worker simulation over a quiet run's file times: 851-859 s in
# collection order, 827 s heaviest first). Only the order of files changes; a file's own tests keep theirs.
_HEAVY_FILES = (
    "spark/test_spark_pipeline.py", "exactly_once/test_rescale.py", "exactly_once/test_threads.py",
    "exactly_once/test_live_rescale.py", "storage/test_outputlog_crash.py", "core/test_zset.py",
    "core/test_substep.py", "storage/test_remote_staged.py", "sql/test_integer_sql.py", "test_readme.py",
    "exactly_once/test_shard_ranges.py", "core/test_circuit_group_ops.py", "c/test_kernels_c.py",
    "storage/test_batchfile.py", "exactly_once/test_kill9.py", "core/test_stages.py", "spark/test_streaming.py",
    "nexmark/test_queries.py", "core/test_spill_tiered.py", "storage/test_remote.py",
)


def _heaviest_files_first(items) -> None:
    """Stable-sorts the items so the files of ``_HEAVY_FILES`` come first, in its order (every xdist worker sorts
    the same collection the same way, as xdist requires)."""
    rank = {name: i for i, name in enumerate(_HEAVY_FILES)}

    def key(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        path = path[len("tests/"):] if path.startswith("tests/") else path
        return rank.get(path, len(rank))

    items.sort(key=key)


@pytest.fixture(scope="session")
def s3_server():
    """One S3-compatible server per session (tests/s3_server.py); skipped without ``moto[server]``, a failure under
    ``DBSP_REQUIRE_S3=1`` (CI)."""
    from s3_server import S3Server, available

    why = available()
    if why:
        if os.environ.get("DBSP_REQUIRE_S3") == "1":
            pytest.fail(f"DBSP_REQUIRE_S3=1 but the object-store tests cannot run: {why}")
        pytest.skip(why)
    server = S3Server()
    yield server
    server.stop()
