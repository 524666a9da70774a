"""Fuzzing every on-disk file type of a storage directory: random byte flips, zeroed ranges and truncations of input and output segments, the step log's LOG, META, LAYOUT, RESCALE, worker, stage and driver databases, the staged JOB record and result files; then ``open`` (and ``dbsp repair`` when open refuses).

Required: 0 crashes (a signal, or an exception other than a typed DbspError / OSError), 0 hangs, 0 wrong answers
(views that differ from the model of the pushes the output log names, a push counted twice, or an acknowledged
push neither present nor reported lost by name). A typed refusal is allowed: the directory names its damage.
DBSP_FUZZ_CASES sets the number of cases (500 by default, as in CI; 10000 for the long run), DBSP_FUZZ_SEED
replays a run; both and the counts are printed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from fuzz_workload import build, build_mid_rescale  # noqa: E402

CASES = int(os.environ.get("DBSP_FUZZ_CASES", "500"))
SEED = int(os.environ.get("DBSP_FUZZ_SEED", random.randrange(10**9)))
HANG_S = 120  # a case takes well under a second; one still running after this long is a hang
CHILD = os.path.join(HERE, "fuzz_files_child.py")


def _kind(rel: str) -> str:
    """The file type of a path inside a storage directory (the unit the cases are spread over)."""
    base = os.path.basename(rel)
    if rel.startswith("input/"):
        return "input LOG" if base == "LOG" else "input segment"
    if rel.startswith("output/"):
        return "output segment"
    if rel.startswith("state/stage-"):
        return "stage database" if base.endswith(".db") else "result file" if base.endswith(".result") else ""
    if rel.startswith("state/"):
        return "worker database" if base.endswith(".db") else "job file" if base == "JOB" else ""
    return {"META": "META", "LAYOUT": "LAYOUT", "RESCALE": "RESCALE", "driver.db": "driver.db"}.get(rel, "")


def _files(d: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r, _, fs in os.walk(d):
        for f in fs:
            rel = os.path.relpath(os.path.join(r, f), d)
            k = _kind(rel)
            if k:
                out.setdefault(k, []).append(rel)
    return out


def _damage(path: str, rng: random.Random) -> str:
    """One random damage of a file: flipped bytes, a zeroed range or a truncation; returns what was done."""
    size = os.path.getsize(path)
    how = rng.choice(["flip", "flip", "zero", "truncate"])
    if size == 0:
        return "empty"
    with open(path, "r+b") as f:
        if how == "flip":
            offs = sorted(rng.randrange(size) for _ in range(rng.randint(1, 3)))
            for off in offs:
                f.seek(off)
                b = f.read(1)[0]
                f.seek(off)
                f.write(bytes([b ^ rng.randint(1, 255)]))
            return f"flip {offs}"
        if how == "zero":
            start = rng.randrange(size)
            n = min(size - start, rng.choice([1, 8, 64, 512, 4096]))
            f.seek(start)
            f.write(b"\0" * n)
            return f"zero {start}+{n}"
        cut = rng.randrange(size)
        f.truncate(cut)
        return f"truncate {cut}"


class _Worker:
    """The child that judges cases; restarted when it dies (a crash) or hangs."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(HERE))]
                                            + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.proc = subprocess.Popen([sys.executable, CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)

    def judge(self, d: str, kind: str) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"dir": d, "kind": kind}) + "\n")
        self.proc.stdin.flush()
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout=HANG_S):
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            return {"verdict": "hang"}
        line = self.proc.stdout.readline()
        if not line:  # the child died: a signal (or an exit) in the middle of a case
            rc = self.proc.wait()
            err = self.proc.stderr.read()[-2000:] if self.proc.stderr else ""
            self.proc = None
            return {"verdict": "crash", "traceback": f"child exited with {rc}\n{err}"}
        return json.loads(line)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


@pytest.mark.slow
def test_damaged_files_never_crash_hang_or_answer_wrong(tmp_path):
    print(f"\n[file fuzz] DBSP_FUZZ_SEED={SEED} DBSP_FUZZ_CASES={CASES}")
    templates = {}
    for kind in ("embedded", "staged"):
        d = str(tmp_path / f"template-{kind}")
        build(d, kind)
        templates[kind] = d
    d = str(tmp_path / "template-rescale")
    build_mid_rescale(d)
    templates["rescale"] = d
    by_type: dict[str, list[tuple[str, str]]] = {}  # file type -> [(template, relative path)]
    for t, d in templates.items():
        for k, rels in _files(d).items():
            by_type.setdefault(k, []).extend((t, r) for r in rels)
    assert set(by_type) == {"input segment", "input LOG", "output segment", "META", "LAYOUT", "RESCALE",
                            "worker database", "stage database", "driver.db", "job file", "result file"}, by_type
    rng = random.Random(SEED)
    verdicts: Counter = Counter()
    per_type: dict[str, Counter] = {}
    bad: list[dict] = []
    worker = _Worker()
    t0 = time.monotonic()
    try:
        for i in range(CASES):
            ftype = rng.choice(sorted(by_type))
            t, rel = rng.choice(by_type[ftype])
            case = str(tmp_path / "case")
            if os.path.exists(case):
                shutil.rmtree(case)
            shutil.copytree(templates[t], case)
            what = _damage(os.path.join(case, rel), rng)
            out = worker.judge(case, "staged" if t == "staged" else "embedded")
            v = out["verdict"]
            verdicts[v] += 1
            per_type.setdefault(ftype, Counter())[v] += 1
            if v in ("crash", "hang", "wrong"):
                bad.append({"case": i, "template": t, "file": rel, "damage": what, **out})
                keep = str(tmp_path / f"bad-{i}")
                shutil.copytree(templates[t], keep)  # the template; the damage is in the record above
    finally:
        worker.stop()
    took = time.monotonic() - t0
    print(f"[file fuzz] {CASES} cases in {took:.0f} s: " + ", ".join(f"{k} {verdicts[k]}" for k in
          ("opened", "repaired", "refused", "crash", "hang", "wrong")))
    for ftype in sorted(per_type):
        print(f"[file fuzz]   {ftype:16} " + ", ".join(f"{k} {n}" for k, n in sorted(per_type[ftype].items())))
    assert not bad, json.dumps(bad[:5], indent=1)[:6000]
    assert verdicts["opened"] > 0 and verdicts["refused"] + verdicts["repaired"] > 0
