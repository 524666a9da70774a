"""The built _zset extension still prefetches where its C source asks to: GCC's interprocedural analysis finds a helper
that only loads and prefetches free of effects and deletes the calls to it (csrc/keyindex.c prefetch_row, csrc/lookup.c
dbsp_prefetch_row), which left the key index's add and lookups and the trace walks waiting on every cache miss; this
reads the machine code (objdump) of the functions that must prefetch."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# function name prefix (GCC may split a function into name.part.N, name.constprop.N, ...): what must be in its code
MUST_PREFETCH = {
    "dbsp_keyindex_add_before": "prefetch",  # prefetch_row: the slot, then the home slot's entry (a distinct's step)
    "get_into": "prefetch",  # the lookups' slots and entries (a linear group-by's probes)
    "dbsp_match_weights_rh": "dbsp_prefetch_row",  # the trace walk's rows ahead (a call: dbsp_prefetch_row is noipa)
    "dbsp_match_sums": "dbsp_prefetch_row",
}


def functions(path: str) -> dict[str, str]:
    """Each function's disassembly in the shared object, by symbol name."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], capture_output=True, text=True,
                         check=True).stdout
    funcs, name, body = {}, None, []
    for line in out.splitlines():
        m = re.match(r"^[0-9a-f]+ <([^>]+)>:$", line)
        if m:
            if name:
                funcs[name] = "\n".join(body)
            name, body = m.group(1), []
        elif name:
            body.append(line)
    if name:
        funcs[name] = "\n".join(body)
    return funcs


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump")
def test_the_hot_probes_keep_their_prefetches():
    so = glob.glob(os.path.join(ROOT, "dbsp_core", "_zset*.so"))
    assert so, "build the extension first (python setup.py build_ext --inplace)"
    funcs = functions(so[0])
    for prefix, needle in MUST_PREFETCH.items():
        code = [body for name, body in funcs.items() if name == prefix or name.startswith(prefix + ".")]
        assert code, f"no function {prefix} in {so[0]} (renamed? update MUST_PREFETCH)"
        found = any(re.search(rf"\bprefetch\w*\s" if needle == "prefetch" else rf"call\s.*<{needle}>", body)
                    for body in code)
        assert found, f"{prefix} in {os.path.basename(so[0])} has no {needle}: the compiler dropped its prefetches"
