"""Settings from the environment (dbsp_core/envvars.py): a value that does not parse is refused with the variable's
name when dbsp_core is imported, never read as 0 by the C core or met half way through a recovery; envvars.py is
the one place that reads them and lists every ``DBSP_*`` variable; importing dbsp_core sizes nothing (no cgroup
file read, no budget set in the C core) until the first key index is built."""

from __future__ import annotations

import doctest
import json
import os
import re
import subprocess
import sys

import pytest

import dbsp_core.envvars as envvars
from dbsp_core.envvars import SETTINGS, check_native, env_number, load, parse_number

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_numbers_parse_and_bad_ones_name_the_variable():
    assert parse_number("0", "X") == 0.0 and parse_number("2.5", "X", positive=True) == 2.5
    assert parse_number(" 12 ", "X", integer=True) == 12
    for text, kw in (("", {}), ("abc", {}), ("-1", {}), ("nan", {}), ("inf", {}), ("0", {"positive": True}),
                     ("1.5", {"integer": True}), ("1e3", {"integer": True})):
        with pytest.raises(ValueError, match="^DBSP_X must be"):
            parse_number(text, "DBSP_X", **kw)
    assert env_number("DBSP_X", environ={}) is None and env_number("DBSP_X", environ={"DBSP_X": "  "}) is None
    assert env_number("DBSP_X", environ={"DBSP_X": "3"}, integer=True) == 3


def test_the_native_settings_are_checked():
    check_native({"DBSP_SCRATCH_MB": "0", "DBSP_REGION_CACHE_MB": "256"})
    for name in ("DBSP_SCRATCH_MB", "DBSP_REGION_CACHE_MB"):
        with pytest.raises(ValueError, match=name):
            check_native({name: "-5"})  # strtoull would have read it as 2**64 - 5 MiB: no limit at all


@pytest.mark.parametrize("name,value", [("DBSP_SCRATCH_MB", "lots"), ("DBSP_PROGRESS_DELAY", "soon"),
                                        ("DBSP_KEY_INDEX_MB", "0"), ("DBSP_KEY_INDEX_TOTAL_MB", "-1"),
                                        ("DBSP_PAGE_CACHE_MB", "0"), ("DBSP_KEY_INDEX", "yes"),
                                        ("DBSP_PROGRESS", "2"), ("DBSP_CRASHPOINT", "commit:x"),
                                        ("DBSP_HUGEPAGES", "yes")])
def test_importing_with_a_bad_setting_fails_at_once_with_its_name(name, value):
    env = dict(os.environ, PYTHONPATH=ROOT, **{name: value})
    r = subprocess.run([sys.executable, "-c", "import dbsp_core"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    assert f"ValueError: {name} must be" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]


def test_the_docstring_examples_run():
    result = doctest.testmod(envvars, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_every_setting_is_typed_with_its_default_and_refuses_a_bad_value_with_its_name():
    """Unset or blank: the default; a good value: its type; a bad one: ValueError naming the variable."""
    defaults = load({})
    assert defaults == load({s.name: "  " for s in SETTINGS})
    assert (defaults.key_index, defaults.key_index_mb, defaults.key_index_total_mb, defaults.page_cache_mb,
            defaults.progress, defaults.progress_delay, defaults.crashpoint, defaults.scratch_mb,
            defaults.region_cache_mb, defaults.memory_limit) == (True, None, None, 32, None, 1.0, "", None, None, None)
    good = {"flag": ("0", False), "number": ("2.5", 2.5), "whole": ("7", 7), "crashpoint": (" commit:3 ", "commit:3"),
            "bytes": ("4GiB", 4 << 30)}
    bad = {"flag": ["yes", "true", "01", "-1"], "number": ["lots", "-1", "nan", "inf"],
           "whole": ["1.5", "-3", "1e3", "x"], "crashpoint": ["commit", "commit:", ":3", "commit:0", "commit:x"],
           "bytes": ["lots", "0", "-1", "4 gigs"]}
    for s in SETTINGS:
        text, value = good[s.kind]
        got = getattr(load({s.name: text}), s.field)
        assert got == value and type(got) is type(value), (s.name, got)
        for b in bad[s.kind] + (["0"] if s.positive else []):
            with pytest.raises(ValueError, match=f"^{s.name} must be .*got {re.escape(repr(b))}$"):
                load({s.name: b})


def test_the_settings_are_read_once():
    assert envvars.settings() is envvars.settings()


_NO_SIZING_AT_IMPORT = r"""
import json, sys
opened = []
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" else None)
memory_files = lambda: [p for p in opened if "/cgroup" in p and "memory" in p]
import dbsp_core
from dbsp_core import _zset
print(json.dumps({"cgroup": memory_files(), "budget": _zset.keyindex_budget()}), flush=True)
import pyarrow as pa
from dbsp_core.trace import Trace, sizing
sized = sizing._sizing is not None
t = Trace(pa.schema([("k", pa.int64())]), ("k",))
kept = t.keep_index((None,))
s = sizing.key_index_sizing()
print(json.dumps({"sized_before": sized, "kept": kept, "cgroup": memory_files(), "budget": _zset.keyindex_budget(),
                  "total": int(s.total_mb * 2**20)}))
"""


def test_importing_dbsp_core_reads_no_cgroup_file_and_sets_no_budget():
    """Sizing happens when the first key index is built, not at import: an audit hook in a fresh process sees no
    cgroup memory file opened by ``import dbsp_core`` and the C core's budget is still unset (0); building a trace's
    first key index then reads the cgroup files and sets the budget to the computed total."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DBSP_KEY_INDEX")}
    env["PYTHONPATH"] = ROOT
    r = subprocess.run([sys.executable, "-c", _NO_SIZING_AT_IMPORT], env=env, capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    lines = r.stdout.strip().splitlines()
    assert lines, r.stderr[-2000:]
    assert json.loads(lines[0]) == {"cgroup": [], "budget": 0}, lines[0]  # nothing sized by the import
    assert r.returncode == 0 and len(lines) == 2, r.stderr[-2000:]
    got = json.loads(lines[1])
    assert not got["sized_before"] and got["kept"] and got["budget"] == got["total"] > 0, got
    assert sorted(got["cgroup"]) == ["/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"], got


_QUOTED = re.compile(r"""["'](DBSP_[A-Z0-9_]+)["']""")
_READS = re.compile(r"""(?:environ(?:\.get)?\s*[(\[]\s*|getenv\s*\(\s*|env_number\s*\(\s*)["'](DBSP_[A-Z0-9_]+)""")


def _files(*tops: str, ext: tuple[str, ...] = (".py",)):
    for top in tops:
        path = os.path.join(ROOT, top)
        if os.path.isfile(path):
            yield path
            continue
        for d, _, names in os.walk(path):
            yield from (os.path.join(d, n) for n in names if n.endswith(ext))


def test_every_dbsp_variable_is_listed_and_only_envvars_reads_runtime_settings():
    """Every ``DBSP_*`` name the repository's code, tests, benchmarks and CI script use is a setting of
    :data:`SETTINGS` or listed in envvars.py's docstring; in dbsp_core and spark_glue only envvars.py reads one."""
    doc = envvars.__doc__
    names = {s.name for s in SETTINGS}
    assert all(f"``{n}``" in doc for n in names)
    here = os.path.abspath(__file__)
    unlisted = {}
    for path in list(_files("dbsp_core", "spark_glue", "tests", "bench", "setup.py", ".ci/run")) + list(
            _files("csrc", ext=(".c", ".h"))):
        if os.path.abspath(path) == here:
            continue
        text = open(path, encoding="utf-8").read()
        for n in set(_QUOTED.findall(text)):
            if n not in names and f"``{n}``" not in doc:
                unlisted.setdefault(n, os.path.relpath(path, ROOT))
    assert not unlisted, f"DBSP_* variables read but not listed in dbsp_core/envvars.py: {unlisted}"
    readers = {}
    for path in _files("dbsp_core", "spark_glue"):
        if os.path.basename(path) == "envvars.py":
            continue
        found = _READS.findall(open(path, encoding="utf-8").read())
        if found:
            readers[os.path.relpath(path, ROOT)] = found
    assert not readers, f"read DBSP_* settings through dbsp_core.envvars.settings(), not directly: {readers}"
