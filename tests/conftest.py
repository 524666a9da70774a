"""Shared pytest configuration: the Hypothesis profile, with a seed that varies between runs, is printed (in the header, after the summary, which ``-q`` shows, and in every failure's report) and replays a run (DBSP_HYPOTHESIS_SEED), example counts from DBSP_HYPOTHESIS_EXAMPLES, the long suite (tests marked ``slow``) kept out of the default run, and the ``spark`` marker recorded in the JUnit report (CI's no-Spark-test-skipped check selects by it).

The README's test command (``python -m pytest -q tests``) runs every test not marked ``slow`` and stays within
about ten minutes on two cores. The long suite (kill loops, soaks, local-cluster Spark, large data) runs with
``python -m pytest -q tests -m slow`` (what ``.ci/run`` does after the README command), or together with the
rest with ``--long`` or ``DBSP_LONG=1``. A deselected test is counted in pytest's summary ("N deselected").

The test command runs on two worker processes (pytest-xdist, ``-n 2 --dist loadfile`` in pyproject.toml: a test
file's tests share one process, so a module's Spark session or server starts once; in the README command every
Spark file shares one: pytest_xdist_make_scheduler). Every per-run seed of the test
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


_FROZEN_AT = [""]  # the test file whose first test froze the garbage collector's old objects (pytest_runtest_setup)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """At the first test of each file: a full collection, then ``gc.freeze()`` of every object still alive (test
    modules, Hypothesis' strategies, pyarrow, DuckDB, pyspark, caches; late in a run a worker holds millions), so
    the collector's later full collections, the tests' own ``gc.collect()`` calls (crash loops call it once per
    point) and Python's automatic ones, traverse only what was made since. Garbage is collected before it is frozen,
    and a frozen object is still freed when its last reference goes; only a cycle formed later among frozen
    objects is never collected (memory only, for the rest of the process). Measured: three gc-heavy files
    (test_spill_checkpoint, test_spill_tiered, test_linrun_shared) after collecting the whole suite, -n 0, load
    6-8: 36.9 s of garbage collection and 44 CPU s without, 9.4 s and 27 CPU s with the freeze at collection."""
    import gc

    path = item.nodeid.split("::", 1)[0]
    if path != _FROZEN_AT[0]:
        _FROZEN_AT[0] = path
        gc.collect()
        gc.freeze()


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
# load 5-7, 2026-12-02, /work/wt/runs/s67-testtime/base1.xml: 144 ... 18; these 40 hold 1,854 s of its 2,772).
# With ``--dist loadfile`` the two workers take whole files (the Spark files one unit: _Scheduling) in collection
# order, so the big files start first and the small files fill the two workers' tail. xdist (3.7 and later)
# would reorder the files by their number of tests (``--loadscope-reorder``, on by default), which put the
# one-test heavy files (test_kernels_c, test_sqllogictest, test_kill) last: _Scheduling turns that off.
# Only the order of files changes; a file's own tests keep theirs.
_HEAVY_FILES = (
    "spark/test_spark_pipeline.py", "spark/test_spark_spill.py", "spark/test_sql_on_spark.py",
    "spark/test_spark_autoscale.py", "spark/test_streaming.py", "test_readme.py",
    "exactly_once/test_threads.py", "exactly_once/test_rescale.py", "core/test_zset.py", "c/test_kernels_c.py",
    "storage/test_spill_checkpoint.py", "storage/test_remote_staged.py", "storage/test_outputlog_crash.py",
    "exactly_once/test_kill9.py", "exactly_once/test_live_rescale.py", "storage/test_remote.py",
    "storage/test_steplog.py", "core/test_linrun_shared.py", "nexmark/test_queries.py",
    "exactly_once/test_shard_ranges.py", "storage/test_spill_in_place_crash.py", "sql/test_integer_sql.py",
    "core/test_spill_tiered.py", "sql/test_sqllogictest.py", "core/test_stages.py",
    "storage/test_spill_compaction_crash.py", "exactly_once/test_range_format.py", "storage/test_stage_check.py",
    "core/test_totals_per_key.py", "storage/test_kill.py", "core/test_circuit_group_ops.py",
    "core/test_trace_hold.py", "core/test_totals_hold.py", "core/test_substep.py", "core/test_values_hold.py",
    "exactly_once/test_fuzz_files.py", "storage/test_remote_upload.py", "storage/test_logstore.py",
    "sql/test_corpus.py", "storage/test_crash_exhaustive.py", "exactly_once/test_remote_kill.py",
    "storage/test_worker_recovery.py", "exactly_once/test_scenarios.py",
)


def _spark_unit(path: str) -> bool:
    """True for the files that run in the one xdist unit of Spark files: every file under tests/spark and the
    README's (its Spark blocks start a session of their own after stopping the shared one)."""
    return path.startswith(("tests/spark/", "spark/")) or path in ("tests/test_readme.py", "test_readme.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the Spark files as one unit and the collection order kept (module comment above
    _HEAVY_FILES): one worker process runs every Spark test, so one JVM and one set of Spark Python workers start
    (each file alone, split over both workers, started a JVM in each: 15-25 s, and Python workers that import
    dbsp_core and Arrow: ~20 s more, at load 5). The long suite's runs (its Spark files start sessions of other
    masters and stop them) and other ``--dist`` modes are left to xdist as they were."""
    if getattr(config.option, "dist", None) != "loadfile" or _long_suite_wanted(config):
        return None
    from xdist.scheduler import LoadFileScheduling

    class _Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "spark files" if _spark_unit(path) else path

    config.option.loadscopereorder = False  # keep _HEAVY_FILES' order (xdist 3.7+ sorts by test count)
    return _Scheduling(config, log)


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
