#!/bin/bash
# Alternated runs of bench/spill_state.py over saved states: ROUNDS rounds, each state once a round, in the order
# given; every run's figures appended to OUT (JSON lines) and its printout to OUT.log, with `uptime` before each.
#   ROUNDS=3 OUT=/tmp/r.jsonl TREE=/work/wt/base-s65 bench/spill_state_runs.sh /work/wt/state100/join-10M-mem ...
# TREE: the tree whose dbsp_core runs (default: this one); bench/ is always this tree's.
set -e
here=$(cd "$(dirname "$0")/.." && pwd)
tree=${TREE:-$here}
out=${OUT:-/tmp/spill_state_runs.jsonl}
for r in $(seq 1 "${ROUNDS:-3}"); do
  for d in "$@"; do
    echo "== round $r $d tree $tree $(date -u +%T) $(uptime)" | tee -a "$out.log"
    (cd "$here" && BENCH_TREE="$tree" PYTHONPATH="$tree" nice -n "${NICE:-5}" python bench/spill_state.py run "$d" \
        --steps "${STEPS:-100}" --warmup "${WARMUP:-10}" --cold "${COLD:-3}" --json "$out" ${EXTRA:-}) \
        2>&1 | grep -v "^  " | tee -a "$out.log"
  done
done
