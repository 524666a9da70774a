"""Sub-steps: under a memory budget, a step whose pushed input is bigger than a share of the budget runs inside the executor as several sub-steps over slices of its input, so its working memory follows the budget while the user still sees one step.

Invariants (enforced here and by the embedded executor's ``_run_one``, dbsp_core/runtime/embedded.py):
  1. When. Only with a memory budget (the executor holds a batch store, trace invariant 12) and only when the
     step's pushes together hold more than :func:`piece_bytes` of Arrow data (data buffers and weights,
     ``profile.zset_bytes``): ``DBSP_SUBSTEP_BYTES`` when set, else ``memory_limit * SUBSTEP_SHARE``, at least
     ``MIN_PIECE_BYTES``. Without a budget nothing changes, nor for a step under that size.
  2. What. :func:`pieces` cuts the step's pushes, in their order, by cumulative bytes into ``k = ceil(total /
     piece_bytes)`` pieces of about equal bytes (at most ``MAX_PIECES``, and no more than the rows): each piece a
     list of ``(handle, change)`` like a step's pushes, each change a zero-copy slice (Arrow ``slice`` and a view of
     the weights) of one push, a push that crosses a boundary cut there. Python work per push and per piece,
     never per row. ``k`` is decided once per step on the executor's calling thread, before any worker runs, so
     every worker runs the same k pieces (each exchange is a barrier all W workers meet).
  3. How. Each piece runs as a whole step of the circuit on every worker with the step's context: the same step
     number, now, previous now, seed and watermarks for every piece. The workers are joined after each piece (the
     exchange mailboxes are cleared, as between steps) and the batch store enforces its budget between pieces (no
     worker runs there, as between steps), so a piece's batches are spilled or handed to the spill thread before
     the next piece adds its own. The step's output per view is the sum of the pieces' outputs made distinct (a
     multiset: weights summed, zero weights dropped; zset.py invariant 2). The step counts once everywhere: one
     step number, one division record and one output-log record (the driver never sees the pieces), one
     ``advance`` of the worker stores, one rollback capture (a StepError in any piece puts every operator back as
     before the step, executor.py invariant 4: the store switches spilled batches in place, rollback.py keeps
     them, trace invariant 12). Not bounded by the pieces: the pushes themselves (held until the step ends), the
     pieces' outputs until they are summed (dropped once concatenated, before the sum is hashed), and the batches
     the rollback capture keeps from before the step.
     The cost: each piece's batches are spilled, where a whole step inserts one batch: more bytes written and more
     CPU (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, "A whole table in one push": a 10M-row push under 100 MiB wrote 3.5x the bytes for half
     the peak memory when each piece was merged with the levels below); ``DBSP_SUBSTEP_BYTES`` trades one for the
     other. A step of at least FAN_IN pieces holds the batch store's tiered merges while its pieces run
     (``BatchStore.holding``, trace invariant 15) and merges each trace's batches placed by its pieces once at its
     end (``EmbeddedExecutor._run_one``), so each piece's rows are written once alone and once merged (bench/history/RESULTS-2026-11-28-to-2026-12-02.md,
     "Write amplification of q4 and of a load in pieces").
  4. Why it is exact. A circuit whose live nodes are all split-safe (operators/base.py invariant 6) is
     time-invariant: each view's output at a step is ``V(I + d) - V(I)``, a function of the integrated inputs
     ``I`` before the step and the step's change ``d`` only. Its pieces ``d = p1 + ... + pk`` give ``V(I + p1) -
     V(I) + V(I + p1 + p2) - V(I + p1) + ...``, which telescopes to the whole step's output as a Z-set (not row for
     row: the sum is consolidated). A fixpoint iterates each piece to its fixed point (fixpoint.py invariant 1).
     Upsert is split-safe because the driver keeps the last row of each key over the whole step before the
     executor sees it (upsert.py invariant 2): every key is in one piece, and its ``-old + new`` is the same.
  5. What is not split. A circuit with a live node that is not split-safe runs every step whole, as before: a
     delay, integrate or differentiate (the output depends on step boundaries), a constant (emitted at the step
     with no previous now: every piece would emit it), processing-time windows and temporal filters (they read
     the step's now and the previous step's), and inputs that declare event time (late rows and the state a
     watermark lets operators drop are judged per step; not proven safe in pieces). :func:`split_off` names the
     first such node and why; the executor puts it in ``stats["substeps"]["off"]`` (``Pipeline.metrics()["spill"]
     ["substeps"]``) and logs it once at DEBUG (logger ``dbsp_core.substep``) at the first step big enough to split.
  6. Durable pipelines. The input log and the output log record the step once, as without pieces; a crash in the
     middle of a split step replays the whole step from the checkpoint before it (the state of earlier pieces is
     in memory only until a checkpoint, and checkpoints run between steps), and the replay's output is compared
     with the logged one as a multiset (``ZSet.__eq__``), so a replay split differently (another budget) or not
     at all matches.
  7. Other executors. The staged executor (and Spark through it) runs steps whole. It could reuse :func:`pieces`
     (a job per piece over the same StepInput), but its stage databases commit per job, so a crash between two
     pieces would leave a state that is neither before nor after the step: it would need the piece number in its
     job records (staged.py invariant 2). Not built.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from dbsp_core.envvars import settings
from dbsp_core.profile import zset_bytes
from dbsp_core.zset import ZSet

if TYPE_CHECKING:
    from dbsp_core.circuit import Circuit

__all__ = ["MAX_PIECES", "MIN_PIECE_BYTES", "SUBSTEP_SHARE", "piece_bytes", "pieces", "split_off"]

SUBSTEP_SHARE = 1 / 8  # a piece holds at most this share of memory_limit in pushed Arrow bytes: a step's working
# memory is several times its input (a 10M-row join's first step: ~100 B a pushed row of 16 B, bench/history/RESULTS-2026-11-28-to-2026-12-02.md
# "Where the anonymous memory goes"), and the batch a piece inserts waits in memory for the spill thread
MIN_PIECE_BYTES = 4 << 20  # never smaller pieces from the budget's share (a tiny budget, the CI's 1 byte): a
# piece costs a pass over the circuit, and a step of a few MiB has a working memory of a few tens of MiB
MAX_PIECES = 4096  # a step is never cut into more pieces (a bound on the per-piece Python work of a step)

_WHY = {  # invariant 5: why a kind of node is not split-safe
    "delay": "its output is the previous step's input",
    "integrate": "its output is the running total at each step",
    "differentiate": "its output is the change from the previous step",
    "constant": "it emits at the pipeline's first step (no previous now), which every piece would be",
    "proc_tumble": "it windows rows by the step's now and the previous step's",
    "within_last": "it reads the step's now and the previous step's",
    "filter_now": "it re-evaluates its input at the step's now",
    "input": "it declares event time (late rows and watermark cleanup are judged per step)",
}


def split_off(circuit: "Circuit", live: list[int]) -> str | None:
    """Why steps of ``circuit`` (its ``live`` nodes) must run whole (invariant 5), or None when every live node is
    split-safe (operators/base.py invariant 6)."""
    for i in live:
        op = circuit.nodes[i]
        if not op.split_safe:
            why = _WHY.get(op.kind, "it is not known to give the same output when its step runs in pieces")
            return f"{op.label}: {why}"
    return None


def piece_bytes(memory_limit: int) -> int:
    """The most pushed bytes a piece of a step holds under a budget of ``memory_limit`` bytes (invariant 1)."""
    forced = settings().substep_bytes
    if forced is not None:
        return max(1, forced)
    return max(MIN_PIECE_BYTES, int(memory_limit * SUBSTEP_SHARE))


def pieces(pushes: list[tuple[str, ZSet]], limit: int) -> list[list[tuple[str, ZSet]]]:
    """``pushes`` (a step's, in order) cut into pieces of at most about ``limit`` bytes each (invariant 2); a single
    piece, ``[pushes]`` itself, when they hold no more than ``limit``.

    >>> import pyarrow as pa
    >>> z = ZSet.from_arrow(pa.table({"x": list(range(10))}))
    >>> [[(h, p.num_rows) for h, p in piece] for piece in pieces([("t", z), ("u", z)], 120)]  # 160 bytes each
    [[('t', 7)], [('t', 3), ('u', 4)], [('u', 6)]]
    >>> len(pieces([("t", z)], 1000))
    1
    """
    sizes = [zset_bytes(z) for _, z in pushes]
    total = sum(sizes)
    rows = sum(z.num_rows for _, z in pushes)
    if total <= limit or rows < 2:
        return [pushes]
    k = min(math.ceil(total / limit), MAX_PIECES, rows)
    out: list[list[tuple[str, ZSet]]] = [[] for _ in range(k)]
    before = 0  # bytes of the pushes before this one
    for (handle, z), size in zip(pushes, sizes):
        n = z.num_rows
        if n == 0:
            continue
        start = 0
        while start < n:
            at = before + size * start / n  # the byte offset of row ``start`` in the step, rows of a push equal-sized
            piece = min(int(at * k / total), k - 1)
            end_bytes = total * (piece + 1) / k  # where this piece ends
            stop = n if piece == k - 1 else min(n, max(start + 1, math.ceil((end_bytes - before) * n / size)))
            part = z if start == 0 and stop == n else ZSet._make(z.data.slice(start, stop - start),
                                                                 z.weights[start:stop])
            out[piece].append((handle, part))
            start = stop
        before += size
    return [p for p in out if p]
