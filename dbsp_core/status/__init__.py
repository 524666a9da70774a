"""The status page of a running pipeline: what the metrics server (dbsp_core.metrics.serve) answers at ``/`` (the static page, page.html) and ``/status.json`` (the figures it polls: metrics, profile, layout, newest step latencies, checkpoint and rescale history)."""

from __future__ import annotations

import json
import math
import time
from importlib import resources
from typing import Any

import numpy as np

__all__ = ["page", "status", "status_json"]

LATENCIES = 300
"""The newest steps whose latency status.json carries."""


def page() -> bytes:
    """The page (UTF-8 HTML; one file, no external assets)."""
    return resources.files(__package__).joinpath("page.html").read_bytes()


def status(p: Any) -> dict:
    """What the page shows of pipeline ``p``: ``metrics`` (``p.metrics()``, with the state figures where the
    executor keeps state in memory, so a poll never reads state databases), ``latencies`` (``[step, seconds]`` of
    the newest steps), ``checkpoints`` (``[unix time, steps run, seconds]``), ``layout``, ``last_rescale``,
    ``rescale_progress``, ``executor`` and ``now``."""
    m = p.metrics(state=p.executor.state_in_memory)
    lay = p.layout
    owners = np.bincount(np.asarray(lay.shard_map.part_of_shard), minlength=lay.workers)
    return {"now": time.time(), "executor": p.executor.kind, "metrics": m,
            "latencies": p._metrics.recent_latencies()[-LATENCIES:],
            "checkpoints": p._metrics.checkpoint_history(),
            "layout": {"workers": lay.workers, "shards": lay.shards, "epoch": lay.epoch,
                       "shards_per_worker": [int(n) for n in owners]},
            "last_rescale": p.last_rescale, "rescale_progress": p.rescale_progress}


def _plain(x: Any) -> Any:
    """``x`` with every float that JSON cannot hold (inf, nan) as None and numpy scalars as Python ones."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def status_json(p: Any) -> bytes:
    """:func:`status` as JSON (UTF-8); anything JSON lacks a form for is written as its text."""
    return json.dumps(_plain(status(p)), default=str, allow_nan=False).encode()
