"""Bounded retries of object-store calls: a transient failure is retried with exponential backoff, each retry logged
(naming the store by :attr:`Location.shown`, never its credentials), and a store that stays down raises
:class:`~dbsp_core.errors.StoreUnavailableError`.

Rules (enforced here):
  1. Only transient failures are retried: ``OSError`` (what pyarrow's store clients raise for network errors,
     timeouts, throttling and 5xx replies) except the ones that say the request itself is wrong, which no retry
     changes (a missing object, a directory where a file was asked for, a permission refused).
  2. At most ``policy.attempts`` calls are made; the waits between them double from ``first_delay_s`` up to
     ``max_delay_s``, with up to 50% random jitter so that retrying writers do not move in lockstep.
  3. The call must be idempotent: writers retry a PUT of the same bytes under the same name, so a PUT that landed
     although it reported a failure is written again identically.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from dbsp_core.errors import StoreUnavailableError
from dbsp_core.storage.location import Location

__all__ = ["RetryPolicy", "DEFAULT_POLICY", "call", "transient"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_PERMANENT = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError)


@dataclass(frozen=True)
class RetryPolicy:
    """How many calls one store operation may take (``attempts`` >= 1) and how long to wait between them."""

    attempts: int = 6
    first_delay_s: float = 0.05
    max_delay_s: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"RetryPolicy: attempts must be an int >= 1, got {self.attempts!r}")
        if not 0 <= self.first_delay_s <= self.max_delay_s:
            raise ValueError(f"RetryPolicy: need 0 <= first_delay_s <= max_delay_s, got {self.first_delay_s!r} and "
                             f"{self.max_delay_s!r}")

    def delay(self, retry: int) -> float:
        """The wait before retry number ``retry`` (from 1), without jitter."""
        return min(self.max_delay_s, self.first_delay_s * 2 ** (retry - 1))


DEFAULT_POLICY = RetryPolicy()


def transient(exc: BaseException) -> bool:
    """Whether a retry may succeed where ``exc`` failed (rule 1)."""
    return isinstance(exc, OSError) and not isinstance(exc, _PERMANENT)


def call(fn: Callable[[], T], what: str, where: Location | str, policy: RetryPolicy = DEFAULT_POLICY,
         sleep: Callable[[float], Any] = time.sleep) -> T:
    """``fn()``, retried under ``policy`` while it fails transiently; ``what`` (e.g. ``"PUT input log segment 7"``)
    and ``where`` (a Location, shown without secrets, or a name already free of them) name it in the log and in
    the StoreUnavailableError raised when the attempts run out.

    >>> tries = []
    >>> def flaky():
    ...     tries.append(1)
    ...     if len(tries) < 3:
    ...         raise ConnectionResetError("reset by peer")
    ...     return "ok"
    >>> call(flaky, "GET x", "s3://b/p", RetryPolicy(first_delay_s=0.0, max_delay_s=0.0)), len(tries)
    ('ok', 3)
    """
    shown = where.shown if isinstance(where, Location) else where
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except BaseException as exc:
            if not transient(exc):
                raise
            if attempt == policy.attempts:
                raise StoreUnavailableError(
                    f"{what} on {shown} failed {attempt} times ({type(exc).__name__}: {exc}); the store seems down: "
                    f"check its endpoint, credentials and health, then reopen the pipeline (Pipeline.open), which "
                    f"recovers everything acknowledged") from exc
            wait = policy.delay(attempt) * (1 + 0.5 * random.random())
            log.warning("%s on %s failed (attempt %d of %d: %s: %s); retrying in %.2f s", what, shown, attempt,
                        policy.attempts, type(exc).__name__, exc, wait)
            sleep(wait)
    raise AssertionError("unreachable")
