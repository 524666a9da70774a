"""The runs bench/spill_state_runs.sh appended to a JSON-lines file, one markdown row per configuration (query, rows, budget, format, tree, flags): the spread (lowest-highest over its runs) of CPU a step (user + sys), the engine's mean and p99 and the wall mean and p99 a step, faults a step and the load.

    python bench/spill_state_table.py /work/wt/state100/logs/table.jsonl [more.jsonl ...]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    lo, hi = min(xs), max(xs)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def main() -> int:
    rows: dict[tuple, list[dict]] = defaultdict(list)
    for path in sys.argv[1:]:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                tree = "main" if "base" in r.get("tree", "") else "branch"
                fmt = "memory" if r["limit"] == "none" else ("f1" if r["grouped"] == "off" else "f2")
                rows[(r["query"], r["state"], r["limit"], fmt, tree, r.get("flags", ""))].append(r)
    print("| query | rows | budget | state | tree | flags | runs | CPU a step ms (user + sys) | sys | engine mean | "
          "engine p99 | wall mean | wall p99 | minor faults | major | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (q, n, limit, fmt, tree, flags), rs in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][3], kv[0][5], kv[0][4])):
        print(f"| {q} | {n // 10**6}M | {limit} | {fmt} | {tree} | {flags or '-'} | {len(rs)} | "
              f"{spread([r['user'] + r['sys'] for r in rs])} | {spread([r['sys'] for r in rs])} | "
              f"{spread([r['engine_mean'] for r in rs])} | {spread([r['engine_p99'] for r in rs])} | "
              f"{spread([r['mean'] for r in rs])} | {spread([r['p99'] for r in rs])} | "
              f"{spread([r['minflt'] for r in rs], '{:.0f}')} | {spread([r['majflt'] for r in rs], '{:.1f}')} | "
              f"{spread([r['loadavg'] for r in rs], '{:.1f}')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
