"""Worker process of the file-damage fuzz test: for each case (a damaged copy of a storage directory) read from stdin as a JSON line, open the pipeline (or, if open refuses, run ``dbsp repair`` and open again), step, and judge the outcome against the workload's pushes; print the verdict as a JSON line.

Verdicts: ``opened`` or ``repaired`` (the views equal the model of the pushes the output log names, and every
acknowledged push is in exactly one step or reported lost by name), ``refused`` (open and repair raised a typed
error: a DbspError or an OSError), ``crash`` (any other exception, with its traceback) or ``wrong``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dbsp_core as dbsp  # noqa: E402
from dbsp_core.errors import DbspError  # noqa: E402
from dbsp_core.runtime.staged import StagedExecutor  # noqa: E402
from dbsp_core.storage.repair import repair  # noqa: E402
from fuzz_workload import ACKED, circuit, model  # noqa: E402


def _open(d: str, kind: str) -> dbsp.Pipeline:
    return dbsp.Pipeline.open(d, circuit(), executor=StagedExecutor() if kind == "staged" else None,
                              checkpoint_interval=None)


def judge(d: str, kind: str) -> dict:
    lost: set = set()
    how = "opened"
    try:
        p = _open(d, kind)
    except (DbspError, OSError) as first:
        try:
            rep = repair(d)
            lost = {(x["producer"], x["seq"]) for x in rep["lost"]}
            p = _open(d, kind)
            how = "repaired"
        except (DbspError, OSError) as e:
            return {"verdict": "refused", "error": f"{type(first).__name__}: {first}"[:300],
                    "repair": f"{type(e).__name__}: {e}"[:300]}
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
        return {"verdict": "refused", "error": f"after open: {type(e).__name__}: {e}"[:300]}
    problems = []
    if len(seen) != len(set(seen)):
        problems.append(f"pushes counted twice: {sorted(x for x in set(seen) if seen.count(x) > 1)[:5]}")
    missing = set(ACKED) - set(seen) - lost
    if start != 0:
        problems.append(f"the output log starts at step {start}: steps before it were lost")
    if missing:
        problems.append(f"acknowledged pushes neither present nor reported lost: {sorted(missing)[:10]}")
    if lost & set(seen):
        problems.append(f"pushes reported lost but present: {sorted(lost & set(seen))[:5]}")
    if views != model(sorted(set(seen))):
        problems.append("the views differ from the model of the pushes the output log names")
    if problems:
        return {"verdict": "wrong", "problems": problems}
    return {"verdict": how, "lost": len(lost)}


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
