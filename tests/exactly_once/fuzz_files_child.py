"""Worker process of the file-damage fuzz test: for each case (a damaged copy of a storage directory) read from stdin as a JSON line, open the pipeline (or, if open refuses, run ``dbsp repair``, with the ``--drop-output`` consent its refusal names if it names one, and open again), step, and judge the outcome against the workload's pushes; print the verdict as a JSON line.

Verdicts: ``opened`` or ``repaired`` (the views equal the model, and every acknowledged push is in exactly one
output step, reported lost by name, or of a step below the output log's first one, whose output alone is gone),
``refused`` (open raised a typed error naming ``dbsp repair`` or what to do, and repair raised one too or listed
what it left unrepaired with what to do), ``crash`` (any other exception, with its traceback), ``wrong`` (the
views differ, a push is counted twice or lost unnamed, a refusal that names no way forward, or a repair that
reported nothing unrepaired but left a directory that does not open).
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dbsp_core as dbsp  # noqa: E402
from dbsp_core.errors import DbspError  # noqa: E402
from dbsp_core.runtime.staged import StagedExecutor  # noqa: E402
from dbsp_core.storage.repair import repair  # noqa: E402
from fuzz_workload import ACKED, circuit, minus, model  # noqa: E402

WAYS = ("dbsp repair", "restore", "Pipeline.open", "open it with")  # a refusal names one of these ways forward


def _open(d: str, kind: str) -> dbsp.Pipeline:
    return dbsp.Pipeline.open(d, circuit(), executor=StagedExecutor() if kind == "staged" else None,
                              checkpoint_interval=None)


def _says_what_to_do(exc: BaseException) -> bool:
    return any(w in str(exc) for w in WAYS)


def judge(d: str, kind: str) -> dict:
    lost: set = set()
    how = "opened"
    dropped = None
    try:
        p = _open(d, kind)
    except (DbspError, OSError) as first:
        if not _says_what_to_do(first):
            return {"verdict": "wrong", "problems": [f"open refused naming no way forward: {type(first).__name__}: "
                                                     f"{first}"[:400]]}
        try:
            try:
                rep = repair(d)
            except (DbspError, OSError) as e:
                m = re.search(r"--drop-output (\d+)\.\.(\d+)", str(e))
                if m is None:
                    raise
                rep = repair(d, drop_output=(int(m.group(1)), int(m.group(2))))  # the consent the refusal names
            dropped = rep["output_dropped"]
            lost = {(x["producer"], x["seq"]) for x in rep["lost"]}
            unrepaired = rep["unrepaired"]
        except (DbspError, OSError) as e:
            if not _says_what_to_do(e):
                return {"verdict": "wrong", "problems": [f"repair refused naming no way forward: {e}"[:400]]}
            return {"verdict": "refused", "error": f"{type(first).__name__}: {first}"[:300],
                    "repair": f"{type(e).__name__}: {e}"[:300]}
        if any(not u.get("action") for u in unrepaired):
            return {"verdict": "wrong", "problems": [f"repair left damage without saying what to do: {unrepaired}"]}
        try:
            p = _open(d, kind)
            how = "repaired"
        except (DbspError, OSError) as e:
            if not unrepaired:
                return {"verdict": "wrong", "problems": [f"repair reported nothing unrepaired ({rep['result']!r}) "
                                                         f"but open still fails: {type(e).__name__}: {e}"[:600]]}
            if not _says_what_to_do(e):
                return {"verdict": "wrong", "problems": [f"open after repair refused naming no way forward: {e}"]}
            return {"verdict": "refused", "error": f"{type(first).__name__}: {first}"[:300],
                    "repair": f"unrepaired: {unrepaired}"[:300]}
    try:
        p.step()  # the pushes that waited for a step (and those a repair logged again)
        names = sorted(p._out_schemas)
        start = p.output_steps.start
        views: dict = {n: {} for n in names}
        seen: list = []
        for s in p.output_steps:
            for r in p.output_inputs(s):
                seen += [(r["producer"], q) for q in range(r["first_seq"], r["last_seq"] + 1)]
        for n in names:
            for _, z in p.read_output(n, start):
                acc = views[n]
                for row, w in z.to_dict().items():
                    acc[row] = acc.get(row, 0) + w
                    if not acc[row]:
                        del acc[row]
        p.close()
    except (DbspError, OSError) as e:  # open worked but the pipeline cannot go on: a refusal, typed
        try:  # closed now: left to the garbage collector, its logs would write into the next case's directory
            p.close()
        except (DbspError, OSError):
            pass
        if not _says_what_to_do(e):
            return {"verdict": "wrong", "problems": [f"after open, an error naming no way forward: {e}"[:400]]}
        return {"verdict": "refused", "error": f"after open: {type(e).__name__}: {e}"[:300]}
    problems = []
    if len(seen) != len(set(seen)):
        problems.append(f"pushes counted twice: {sorted(x for x in set(seen) if seen.count(x) > 1)[:5]}")
    # the pushes of the steps below the output log's first step: their effect is in the state, their output
    # alone is gone (dropped by repair with consent, or a deleted oldest segment, which reads as retention)
    before = {x for x in ACKED if x[1] < start}
    missing = set(ACKED) - set(seen) - lost - before
    if missing:
        problems.append(f"acknowledged pushes neither present nor reported lost: {sorted(missing)[:10]}")
    if before & (set(seen) | lost):
        problems.append(f"pushes of steps below the first output step {start} are also in later steps or lost")
    if dropped is not None and dropped[1] + 1 != start:
        problems.append(f"repair dropped output steps {dropped} but the output log starts at step {start}")
    if lost & set(seen):
        problems.append(f"pushes reported lost but present: {sorted(lost & set(seen))[:5]}")
    if views != minus(model(sorted(set(seen) | before)), model(sorted(before))):
        problems.append("the views differ from the model of the pushes the output log names")
    if problems:
        return {"verdict": "wrong", "problems": problems, "start": start, "lost": sorted(lost)[:20]}
    return {"verdict": how, "lost": len(lost), "start": start}


def main() -> int:
    for line in sys.stdin:
        case = json.loads(line)
        try:
            out = judge(case["dir"], case["kind"])
        except BaseException:
            out = {"verdict": "crash", "traceback": traceback.format_exc()[-3000:]}
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
