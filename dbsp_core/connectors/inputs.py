"""How a source finds the input it feeds: the pipeline's input handles and their schemas, checked once for all."""

from __future__ import annotations

from typing import Any

import pyarrow as pa


def input_schemas(pipeline: Any) -> dict[str, pa.Schema]:
    """The pipeline's input handles and schemas (the embedded runtimes keep them; others may publish them)."""
    for attr in ("input_schemas", "_inputs"):
        v = getattr(pipeline, attr, None)
        if isinstance(v, dict):
            return v
    c = pipeline.circuit
    return {name: c.nodes[i].schema for name, i in c.inputs.items()}


def source_input(who: str, pipeline: Any, handle: str | None, *, durable: bool = True) -> tuple[str, pa.Schema]:
    """``(handle, schema)`` of the input a source named ``who`` feeds, after the checks every source makes.

    ``durable``: the source's exactly once rests on the pipeline's push dedup, so it needs ``storage=``.
    ``handle=None`` picks the only input, and is refused when there are several."""
    if durable and getattr(pipeline, "storage", None) is None:
        raise ValueError(f"{who} needs a durable pipeline (storage=<dir>): exactly once rests on its dedup")
    inputs = input_schemas(pipeline)
    if handle is None:
        if len(inputs) != 1:
            raise ValueError(f"{who}: the circuit has inputs {sorted(inputs)}; name one with handle=")
        handle = next(iter(inputs))
    elif handle not in inputs:
        raise KeyError(f"{who}: unknown input handle {handle!r}; inputs are {sorted(inputs)}")
    return handle, inputs[handle]
