"""The C core is linked once per process: every C function and global of csrc/ is in exactly one of the two
extensions (setup.py), read from their symbol tables with nm."""

from __future__ import annotations

import shutil
import subprocess

import pytest

import dbsp_core._storage
import dbsp_core._zset

# Process-wide state of the C core (file-static globals, named as in csrc/), each of which must exist once:
# the key-index budget and its total (keyindex.c), the scratch and region caches (scratch.c), consolidate's
# small-batch threshold (zset.c), the CRC-32C table (crc32c.c), the process-wide fault VFS (vfs.c), the storage
# error message (storage_status.c), the format-2 decoder's read-buffer limit (groupdecode.c).
GLOBALS = ["g_limit", "g_total", "cached_bytes", "region_cache", "dbsp_small_rows", "crc_table", "fault_vfs",
           "err_msg", "keep_limit"]


def symbols(path: str) -> dict[str, set[str]]:
    """name -> the nm types of the symbols defined under that name in the shared object at `path`."""
    out = subprocess.run(["nm", path], capture_output=True, text=True, check=True).stdout
    defined: dict[str, set[str]] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] != "U":
            defined.setdefault(parts[2], set()).add(parts[1])
    return defined


@pytest.fixture(scope="module")
def tables() -> dict[str, dict[str, set[str]]]:
    if shutil.which("nm") is None:
        pytest.skip("no nm on PATH (binutils) to read the extensions' symbol tables")
    found = {m.__name__: symbols(m.__file__) for m in (dbsp_core._zset, dbsp_core._storage)}
    for name, syms in found.items():
        assert any(s.startswith("dbsp_") for s in syms), f"{name} has no dbsp_ symbols: is it stripped?"
    return found


def test_each_c_function_is_in_one_extension(tables):
    zset, storage = (tables[m] for m in ("dbsp_core._zset", "dbsp_core._storage"))
    both = sorted(s for s in zset if s.startswith("dbsp_") and s in storage)
    assert both == [], f"{len(both)} C symbols are linked into both extensions, e.g. {both[:8]}"
    # each side holds its own part of the core: the kernels in _zset, the storage engine in _storage
    assert "dbsp_zset_consolidate" in zset and "dbsp_pagestore_open" in storage


@pytest.mark.parametrize("name", GLOBALS)
def test_each_global_exists_once_per_process(tables, name):
    where = [(m, sorted(syms[name])) for m, syms in tables.items() if name in syms]
    assert len(where) == 1, f"{name} is defined in {where or 'neither extension'}"
    assert set(where[0][1]) <= set("bBdD"), f"{name} is not a data symbol: {where}"
