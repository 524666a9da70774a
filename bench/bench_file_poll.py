"""What one FileSource poll costs as the files it has read grow: the wall and CPU of ``pending()`` over a directory of N small CSV files all read, and of a poll that finds one new file, per N, on this tree or another.

Run:  python bench/bench_file_poll.py --files 10,100,1000,10000 [--polls 200] [--tree ../other-checkout]

Each N is measured in a fresh child process (``--tree`` puts that checkout's dbsp_core first): the N files are
written and published by a rename, one source reads them all (in memory, ``read_ahead=0``), the directory is left
to age past the source's listing margin (files.py LISTING_MARGIN_NS, when the tree has one), and then ``--polls``
calls of ``pending()`` (nothing new) are timed one by one, then ``--polls // 10`` rounds of publishing one new file
and polling it in. Prints, per N, the mean and p99 wall microseconds and the mean CPU microseconds (``thread_time``)
of a ``pending()``, and the mean wall of a poll with one new file, and the ``os.stat`` calls of one ``pending()``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(tree: str, n: int, polls: int) -> dict:
    sys.path.insert(0, tree)
    import pyarrow as pa

    import dbsp_core as dbsp
    from dbsp_core.connectors import FileSource
    from dbsp_core.connectors import files as files_module

    d = tempfile.mkdtemp(prefix="bench-poll-")

    def publish(name: str, i: int) -> None:
        tmp = os.path.join(d, "." + name)
        with open(tmp, "w") as f:
            f.write(f"k,v\n{i},{i % 7}\n")
        os.replace(tmp, os.path.join(d, name))

    for i in range(n):
        publish(f"f{i:06d}.csv", i)
    c = dbsp.Circuit()
    t = c.input("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]))
    c.output("o", t)
    p = dbsp.Pipeline(c)
    src = FileSource(p, "t", d, read_ahead=0)
    assert src.poll() == n
    margin = getattr(files_module, "LISTING_MARGIN_NS", 0) / 1e9
    time.sleep(margin + 0.2)  # the directory older than the margin: a kept listing is trusted
    src.pending()
    stats = [0]
    stat = os.stat

    def counting(*a, **k):
        stats[0] += 1
        return stat(*a, **k)

    os.stat = counting
    src.pending()
    os.stat = stat
    walls, cpus = [], []
    for _ in range(polls):
        w0, c0 = time.perf_counter(), time.thread_time()
        assert src.pending() == []
        cpus.append(time.thread_time() - c0)
        walls.append(time.perf_counter() - w0)
    new = []
    for j in range(max(1, polls // 10)):
        publish(f"g{j:06d}.csv", j)
        w0 = time.perf_counter()
        assert src.poll() == 1
        new.append(time.perf_counter() - w0)
    p.close()
    walls.sort()
    return {"files": n, "pending_us_mean": 1e6 * sum(walls) / len(walls),
            "pending_us_p99": 1e6 * walls[int(0.99 * (len(walls) - 1))], "pending_cpu_us": 1e6 * sum(cpus) / len(cpus),
            "poll_new_us_mean": 1e6 * sum(new) / len(new), "stats_per_pending": stats[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", default="10,100,1000,10000")
    ap.add_argument("--polls", type=int, default=200)
    ap.add_argument("--tree", default=os.path.dirname(HERE), help="a checkout whose dbsp_core is measured")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.tree, int(a.child), a.polls)))
        return
    tree = os.path.abspath(a.tree)
    rev = subprocess.run(["git", "-C", tree, "log", "--oneline", "-1"], capture_output=True, text=True).stdout.strip()
    print(f"tree {tree} ({rev[:50]}); load {os.getloadavg()[0]:.1f}")
    print("| files read | pending() wall us, mean / p99 | pending() CPU us | poll of 1 new file, wall us | os.stat a pending() |")
    print("|---|---|---|---|---|")
    for n in map(int, a.files.split(",")):
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(n), "--polls", str(a.polls),
                            "--tree", tree], capture_output=True, text=True, cwd=tree)
        if r.returncode:
            raise SystemExit(r.stderr[-2000:])
        x = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"| {n:,} | {x['pending_us_mean']:,.0f} / {x['pending_us_p99']:,.0f} | {x['pending_cpu_us']:,.0f} | "
              f"{x['poll_new_us_mean']:,.0f} | {x['stats_per_pending']} |", flush=True)


if __name__ == "__main__":
    main()
