"""``StoreFaults``: a fault-injecting ``pyarrow.fs`` filesystem for tests, wrapping any real FileSystem (an S3 client
on moto's server, a local one) and failing, delaying or timing out its PUT, GET, LIST and DELETE calls.

What it injects (the kinds, :data:`KINDS`), at chosen operations (``plan``), at random ones (``rate``, drawn from
a seeded ``random.Random``, so a run replays from its seed) or at every one (:meth:`StoreFaults.down`):

  - ``error``: the call raises ``OSError`` before reaching the store (a PUT writes nothing);
  - ``timeout``: the call waits ``timeout_s`` then raises ``TimeoutError`` (an ``OSError``) without reaching it;
  - ``delay``: the call waits ``delay_s`` then runs normally;
  - ``landed`` (PUT only): the object is written whole, then the call raises, as when the reply of a PUT that
    succeeded is lost: the writer cannot tell the object is there.

:meth:`StoreFaults.hold` makes the PUTs of chosen objects wait until :meth:`StoreFaults.release` (a store slow to
answer them), so a test can act while one is in flight.

Operations: ``put`` (closing a stream of ``open_output_stream`` / ``open_append_stream``: the bytes go to the store
in one call to the wrapped filesystem, as one S3 PUT), ``get`` (``open_input_file``, ``open_input_stream``),
``list`` (``get_file_info`` of paths or of a selector) and ``delete`` (``delete_file``, ``delete_dir``,
``delete_dir_contents``). ``create_dir``, ``move`` and ``copy_file`` pass through uncounted. Every operation is
counted by kind of operation (:attr:`StoreFaults.ops`) and every fault injected by (operation, kind)
(:attr:`StoreFaults.injected`).

Examples
--------
>>> import tempfile, pyarrow.fs as pafs
>>> faults = StoreFaults(pafs.LocalFileSystem(), plan={("put", 1): "landed"})
>>> d = tempfile.mkdtemp()
>>> try:
...     with faults.fs.open_output_stream(d + "/x") as f:
...         _ = f.write(b"abc")
... except OSError as e:
...     print("PUT failed:", "landed" in str(e))
PUT failed: True
>>> faults.fs.open_input_file(d + "/x").read(), dict(faults.injected)
(b'abc', {('put', 'landed'): 1})
"""

from __future__ import annotations

import io
import random
import threading
import time
from collections import Counter
from typing import Any, Iterable, Mapping

import pyarrow as pa
import pyarrow.fs as pafs

__all__ = ["StoreFaults", "InjectedFault", "KINDS", "OPS"]

OPS = ("put", "get", "list", "delete")
KINDS = ("error", "timeout", "delay", "landed")
_KINDS_OF = {"put": KINDS, "get": KINDS[:3], "list": KINDS[:3], "delete": KINDS[:3]}


class InjectedFault(OSError):
    """A failure :class:`StoreFaults` injected (a transient store error, as a real client reports one)."""


class InjectedTimeout(InjectedFault, TimeoutError):
    """A timeout :class:`StoreFaults` injected."""


class StoreFaults:
    """Wraps ``fs`` (a ``pyarrow.fs.FileSystem``); :attr:`fs` is the wrapped filesystem to hand to the code under
    test.

    Parameters
    ----------
    fs
        The real filesystem every call that is not failed reaches.
    seed
        Seeds the random choices (which operations fail, and how).
    rate
        Probability that an operation of ``ops`` gets a random fault of ``kinds`` (those that apply to it).
    ops, kinds
        What random faults hit (default: every operation, every kind).
    plan
        ``{(op, n): kind}``: the n-th (from 1) operation ``op`` gets fault ``kind``, whatever ``rate`` says.
    delay_s, timeout_s
        How long a ``delay`` and a ``timeout`` wait.
    """

    def __init__(self, fs: pafs.FileSystem, *, seed: int = 0, rate: float = 0.0, ops: Iterable[str] = OPS,
                 kinds: Iterable[str] = KINDS, plan: Mapping[tuple[str, int], str] | None = None,
                 delay_s: float = 0.01, timeout_s: float = 0.02) -> None:
        if not isinstance(fs, pafs.FileSystem):
            raise TypeError(f"StoreFaults wraps a pyarrow.fs.FileSystem, not {type(fs).__name__}")
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"StoreFaults: rate is a probability in [0, 1], got {rate!r}")
        self.ops_enabled = tuple(ops)
        self.kinds_enabled = tuple(kinds)
        for o in self.ops_enabled:
            if o not in OPS:
                raise ValueError(f"StoreFaults: unknown operation {o!r}; operations are {OPS}")
        for k in self.kinds_enabled:
            if k not in KINDS:
                raise ValueError(f"StoreFaults: unknown fault kind {k!r}; kinds are {KINDS}")
        self.plan = dict(plan or {})
        for (o, n), k in self.plan.items():
            if o not in OPS or k not in _KINDS_OF[o] or not isinstance(n, int) or n < 1:
                raise ValueError(f"StoreFaults: plan entry ({o!r}, {n!r}): {k!r} is not an operation of {OPS}, a "
                                 f"count from 1 and a kind that applies to it ({_KINDS_OF.get(o, KINDS)})")
        self.real = fs
        self.rate = rate
        self.delay_s = delay_s
        self.timeout_s = timeout_s
        self.ops: Counter = Counter()  # operations seen, by operation
        self.injected: Counter = Counter()  # faults injected, by (operation, kind)
        self._rng = random.Random(seed)
        self._down: str | None = None
        self._lock = threading.Lock()
        self._hold: str | None = None  # PUTs of paths containing it wait for _gate (hold, release)
        self._gate = threading.Event()
        self._gate.set()
        self.holding = threading.Event()
        self.fs = pafs.PyFileSystem(_Handler(self))

    def down(self, is_down: bool = True, kind: str = "error") -> None:
        """From now on every counted operation fails with ``kind`` (the store is down: ``error`` or ``timeout``;
        ``landed``: every PUT lands and reports a failure, other operations fail with ``error``), until
        ``down(False)``."""
        if kind not in ("error", "timeout", "landed"):
            raise ValueError(f"StoreFaults.down: kind is error, timeout or landed, not {kind!r}")
        with self._lock:
            self._down = kind if is_down else None

    def hold(self, match: str) -> None:
        """From now on a PUT whose path contains ``match`` waits before it reaches the store (a store slow to answer
        it), until :meth:`release`; :attr:`holding` is set once one waits."""
        with self._lock:
            self._hold = match
            self._gate.clear()
            self.holding.clear()

    def release(self) -> None:
        """The PUTs :meth:`hold` keeps waiting go on, and later ones do not wait."""
        with self._lock:
            self._hold = None
        self._gate.set()

    def _wait_hold(self, path: str) -> None:
        with self._lock:
            match = self._hold
        if match is not None and match in path:
            self.holding.set()
            self._gate.wait()

    def set_rate(self, rate: float) -> None:
        """Change the probability of a random fault (0 stops them)."""
        with self._lock:
            self.rate = rate

    def injected_by_kind(self) -> dict[str, int]:
        """Faults injected so far, summed by kind."""
        out: Counter = Counter()
        for (_, kind), n in self.injected.items():
            out[kind] += n
        return dict(out)

    def _decide(self, op: str) -> str | None:
        """Counts one ``op`` and returns the fault it gets (None: none)."""
        with self._lock:
            self.ops[op] += 1
            kind = self.plan.get((op, self.ops[op]))
            if kind is None and self._down:
                kind = self._down if self._down in _KINDS_OF[op] else "error"
            if kind is None and self.rate and op in self.ops_enabled and self._rng.random() < self.rate:
                choices = [k for k in self.kinds_enabled if k in _KINDS_OF[op]]
                kind = self._rng.choice(choices) if choices else None
            if kind is not None:
                self.injected[(op, kind)] += 1
            return kind

    def _before(self, op: str, path: str) -> str | None:
        """Applies the fault of one operation that happens before it reaches the store; returns ``landed`` for a
        PUT that must fail after writing."""
        kind = self._decide(op)
        if kind == "delay":
            time.sleep(self.delay_s)
        elif kind == "timeout":
            time.sleep(self.timeout_s)
            raise InjectedTimeout(f"injected timeout of {op.upper()} {path}")
        elif kind == "error":
            raise InjectedFault(f"injected error of {op.upper()} {path}")
        return kind


class _PutStream(io.RawIOBase):
    """The bytes of one PUT, sent to the wrapped filesystem in one call when the stream is closed."""

    def __init__(self, owner: StoreFaults, path: str, metadata: Any) -> None:
        super().__init__()
        self._owner, self._path, self._metadata = owner, path, metadata
        self._buf = io.BytesIO()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self._buf.write(data)

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self._owner._wait_hold(self._path)
        kind = self._owner._before("put", self._path)
        with self._owner.real.open_output_stream(self._path, metadata=self._metadata) as out:
            out.write(self._buf.getvalue())
        if kind == "landed":
            raise InjectedFault(f"injected failure of PUT {self._path} after the object landed")


class _Handler(pafs.FileSystemHandler):
    def __init__(self, owner: StoreFaults) -> None:
        self.o = owner

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Handler) and other.o is self.o

    def __ne__(self, other: object) -> bool:
        return not self == other

    def get_type_name(self) -> str:
        return "faulty+" + self.o.real.type_name

    def normalize_path(self, path: str) -> str:
        return self.o.real.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        self.o._before("list", ",".join(paths))
        return self.o.real.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        self.o._before("list", selector.base_dir)
        return self.o.real.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self.o.real.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.o._before("delete", path)
        self.o.real.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.o._before("delete", path)
        self.o.real.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        raise OSError("StoreFaults: refusing to delete the root of the wrapped filesystem")

    def delete_file(self, path: str) -> None:
        self.o._before("delete", path)
        self.o.real.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self.o.real.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.o.real.copy_file(src, dest)

    def open_input_stream(self, path: str) -> Any:
        self.o._before("get", path)
        return self.o.real.open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        self.o._before("get", path)
        return self.o.real.open_input_file(path)

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        return pa.PythonFile(_PutStream(self.o, path, metadata), mode="w")

    def open_append_stream(self, path: str, metadata: Any) -> Any:
        raise OSError("StoreFaults: object stores have no append; write a new object")
