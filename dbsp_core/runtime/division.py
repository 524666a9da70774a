"""A divided step as the driver keeps it until it runs (whether divided now or read back from the input log by recovery): its input, the watermarks after it, and its pushes summarized as the input ranges its output record names."""

from __future__ import annotations

from typing import NamedTuple

from dbsp_core.runtime.executor import StepInput

__all__ = ["Divided", "ranges"]


class Divided(NamedTuple):
    """A divided step waiting to run, with the input ranges its output record names, the watermarks after it,
    the late rows its input operators drop (dbsp_core.time.watermark) and its pushes' ``(input, producer, seq)``."""

    input: StepInput
    ranges: list[dict]
    watermarks_after: dict[str, int]
    late: dict[str, int]
    entries: list[tuple[str, str, int]]


def ranges(entries: list[tuple[str, str, int]]) -> list[dict]:
    """Summarize a step's pushes as contiguous seq ranges per (handle, producer)."""
    by: dict[tuple[str, str], list[int]] = {}
    for handle, producer, seq in entries:
        by.setdefault((handle, producer), []).append(seq)
    out = []
    for (handle, producer), seqs in sorted(by.items()):
        if producer == "":
            out.append({"handle": handle, "producer": "", "first_seq": None, "last_seq": None, "pushes": len(seqs)})
            continue
        seqs.sort()
        lo = prev = seqs[0]
        for s in seqs[1:] + [None]:
            if s is not None and s == prev + 1:
                prev = s
                continue
            out.append({"handle": handle, "producer": producer, "first_seq": lo, "last_seq": prev,
                        "pushes": prev - lo + 1})
            if s is not None:
                lo = prev = s
    return out
