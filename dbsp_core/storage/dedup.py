"""The set of (producer, seq) pairs a durable pipeline has recorded: a dense watermark per producer plus the sequence numbers above it, saved with the driver's checkpoint."""

from __future__ import annotations

from dbsp_core.codec import decode_json, encode_json
from dbsp_core.storage.database import DatabaseHandle
from dbsp_core.storage.formats import DEDUP_MAGIC, DEDUP_TABLE


class SeenSet:
    """The (producer, seq) pairs already recorded (invariant 2 of the driver).

    Examples
    --------
    >>> s = SeenSet(); s.add("p", 0); s.add("p", 2)
    >>> s.has("p", 0), s.has("p", 1), s.has("p", 2), s.wm, s.above
    (True, False, True, {'p': 0}, {'p': {2}})
    >>> s.add("p", 1); s.wm, s.above
    ({'p': 2}, {})
    """

    def __init__(self) -> None:
        self.wm: dict[str, int] = {}
        self.above: dict[str, set[int]] = {}

    def has(self, producer: str, seq: int) -> bool:
        return seq <= self.wm.get(producer, -1) or seq in self.above.get(producer, ())

    def add(self, producer: str, seq: int) -> None:
        wm = self.wm.get(producer, -1)
        if seq <= wm:
            return
        s = self.above.setdefault(producer, set())
        s.add(seq)
        while wm + 1 in s:
            wm += 1
            s.discard(wm)
        self.wm[producer] = wm
        if not s:
            del self.above[producer]

    def copy(self) -> "SeenSet":
        c = SeenSet()
        c.wm = dict(self.wm)
        c.above = {p: set(s) for p, s in self.above.items()}
        return c

    def save(self, h: DatabaseHandle) -> None:
        old = {k for k, _ in h.scan(DEDUP_TABLE)}
        for p, wm in self.wm.items():
            key = p.encode("utf-8")
            h.put(DEDUP_TABLE, key, encode_json(DEDUP_MAGIC, {"wm": wm, "above": sorted(self.above.get(p, ()))}))
            old.discard(key)
        for k in old:
            h.delete(DEDUP_TABLE, k)

    def load(self, h: DatabaseHandle, where: str) -> None:
        for k, v in h.scan(DEDUP_TABLE):
            d = decode_json(DEDUP_MAGIC, v, f"{where} dedup {k!r}")
            p = k.decode("utf-8")
            self.wm[p] = int(d["wm"])
            if d["above"]:
                self.above[p] = set(int(x) for x in d["above"])
