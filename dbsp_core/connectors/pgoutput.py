"""A decoder of PostgreSQL's ``pgoutput`` logical replication messages (protocol version 1, text values) into transactions of row changes, each a row's text values with a weight of +1 or -1.

Invariants (enforced here):
  1. A transaction is the messages from its Begin to its Commit; it is identified by its commit's end LSN (the
     position a slot confirms to skip it). Messages outside a Begin/Commit pair, or an unknown message type, raise
     DbspError (the stream is not what this decoder understands).
  2. An Insert is +1 of the new row; a Delete is -1 of the old row; an Update is -1 of the old row and +1 of the
     new. The old row must be whole (the table has ``REPLICA IDENTITY FULL``): an Update or Delete with only the
     key ('K') or no old row raises DbspError. A new row's unchanged TOASTed value ('u') is the old row's value.
  3. A Truncate raises DbspError: its rows are not in the stream, so no change could say what it removed.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from dbsp_core.errors import DbspError

__all__ = ["Transaction", "Relation", "decode"]


class Relation(NamedTuple):
    relid: int
    schema: str
    name: str
    replident: str
    columns: list[str]


class Transaction(NamedTuple):
    end_lsn: int
    xid: int
    changes: list[tuple[int, list[str | None], int]]  # (relid, text values in the relation's column order, weight)


def _string(buf: bytes, pos: int) -> tuple[str, int]:
    end = buf.index(b"\0", pos)
    return buf[pos:end].decode("utf-8"), end + 1


def _tuple(buf: bytes, pos: int) -> tuple[list, int]:
    (n,) = struct.unpack_from("!h", buf, pos)
    pos += 2
    values: list = []
    for _ in range(n):
        kind = buf[pos:pos + 1]
        pos += 1
        if kind == b"n":
            values.append(None)
        elif kind == b"u":
            values.append(_UNCHANGED)
        elif kind == b"t":
            (ln,) = struct.unpack_from("!i", buf, pos)
            values.append(buf[pos + 4:pos + 4 + ln].decode("utf-8"))
            pos += 4 + ln
        else:
            raise DbspError(f"pgoutput: tuple value kind {kind!r} (binary values are not requested)")
    return values, pos


_UNCHANGED = object()


def decode(messages: list[bytes], relations: dict[int, Relation], where: str) -> list[Transaction]:
    """The complete transactions of ``messages`` (pgoutput messages in stream order, as
    ``pg_logical_slot_peek_binary_changes`` returns them); ``relations`` gathers the Relation messages seen."""
    out: list[Transaction] = []
    cur: list | None = None
    xid = 0
    for m in messages:
        kind = m[:1]
        if kind == b"B":
            if cur is not None:
                raise DbspError(f"{where}: pgoutput Begin inside a transaction")
            _, _, xid = struct.unpack_from("!qqI", m, 1)
            cur = []
        elif kind == b"C":
            if cur is None:
                raise DbspError(f"{where}: pgoutput Commit outside a transaction")
            _, _, end, _ = struct.unpack_from("!bqqq", m, 1)
            out.append(Transaction(end, xid, cur))
            cur = None
        elif kind == b"R":
            (relid,) = struct.unpack_from("!I", m, 1)
            ns, pos = _string(m, 5)
            name, pos = _string(m, pos)
            replident = chr(m[pos])
            (n,) = struct.unpack_from("!h", m, pos + 1)
            pos += 3
            cols = []
            for _ in range(n):
                col, pos = _string(m, pos + 1)
                cols.append(col)
                pos += 8
            relations[relid] = Relation(relid, ns, name, replident, cols)
        elif kind in (b"Y", b"O", b"M"):
            continue  # a type, an origin, a logical message: nothing of the rows
        elif kind in (b"I", b"U", b"D"):
            if cur is None:
                raise DbspError(f"{where}: pgoutput change outside a transaction")
            (relid,) = struct.unpack_from("!I", m, 1)
            pos = 5
            old = None
            tag = m[pos:pos + 1]
            if kind != b"I" and tag in (b"K", b"O"):
                if tag == b"K":
                    raise _not_full(where, relations.get(relid))
                old, pos = _tuple(m, pos + 1)
                tag = m[pos:pos + 1]
            if kind != b"I" and old is None:
                raise _not_full(where, relations.get(relid))
            if old is not None:
                cur.append((relid, old, -1))
            if kind != b"D":
                if tag != b"N":
                    raise DbspError(f"{where}: pgoutput {kind.decode()} without a new tuple")
                new, pos = _tuple(m, pos + 1)
                if old is not None:
                    new = [o if v is _UNCHANGED else v for v, o in zip(new, old)]
                elif any(v is _UNCHANGED for v in new):
                    raise _not_full(where, relations.get(relid))
                cur.append((relid, new, 1))
        elif kind == b"T":
            names = ", ".join(f"{r.schema}.{r.name}" for r in relations.values())
            raise DbspError(f"{where}: a TRUNCATE of {names or 'the source table'} reached the replication stream; "
                            f"its rows are not in the stream, so the source cannot follow it. Delete rows with "
                            f"DELETE, or reload the table under a new source name")
        else:
            raise DbspError(f"{where}: unknown pgoutput message type {kind!r}")
    return out


def _not_full(where: str, rel: Relation | None) -> DbspError:
    name = f"{rel.schema}.{rel.name}" if rel else "the source table"
    return DbspError(f"{where}: an UPDATE or DELETE of {name} came without the whole old row; the source needs "
                     f"ALTER TABLE {name} REPLICA IDENTITY FULL (set before the changes were made)")
