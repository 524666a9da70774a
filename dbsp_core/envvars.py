"""Settings read from the environment (``DBSP_*``), checked where they are read: a value that does not parse is
refused with the variable's name, instead of being read as 0 by C's ``strtoull`` or failing with a bare
``float()`` error in the middle of a recovery.

The C core reads ``DBSP_SCRATCH_MB`` and ``DBSP_REGION_CACHE_MB`` itself (csrc/scratch.c); :func:`check_native`
validates them when dbsp_core is imported, before the first kernel call reads them.
"""

from __future__ import annotations

import math
import os
from typing import Mapping

__all__ = ["parse_number", "env_number", "check_native"]

NATIVE = ("DBSP_SCRATCH_MB", "DBSP_REGION_CACHE_MB")  # whole MiB >= 0, read by csrc/scratch.c


def parse_number(text: str, name: str, *, integer: bool = False, positive: bool = False) -> float:
    """``text`` as a finite number >= 0 (> 0 with ``positive``; a whole number with ``integer``), else ValueError
    naming ``name``.

    >>> parse_number(" 1.5 ", "X"), parse_number("7", "X", integer=True)
    (1.5, 7)
    >>> parse_number("-1", "DBSP_SCRATCH_MB", integer=True)
    Traceback (most recent call last):
    ...
    ValueError: DBSP_SCRATCH_MB must be a whole number >= 0, got '-1'
    """
    what = ("a whole number" if integer else "a number") + (" > 0" if positive else " >= 0")
    try:
        value = int(text.strip(), 10) if integer else float(text)
    except ValueError:
        raise ValueError(f"{name} must be {what}, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {what}, got {text!r}")
    return value


def env_number(name: str, *, integer: bool = False, positive: bool = False,
               environ: Mapping[str, str] | None = None) -> float | None:
    """The number in environment variable ``name`` (:func:`parse_number`'s rules), None when unset or blank."""
    text = (os.environ if environ is None else environ).get(name)
    if text is None or not text.strip():
        return None
    return parse_number(text, name, integer=integer, positive=positive)


def check_native(environ: Mapping[str, str] | None = None) -> None:
    """Validate the settings the C core reads from the environment itself (:data:`NATIVE`): whole MiB >= 0."""
    for name in NATIVE:
        env_number(name, integer=True, environ=environ)
