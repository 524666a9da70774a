"""The Nexmark queries q0-q22 as circuits over the inputs ``person``, ``auction`` and ``bid`` (event time ``dateTime``), each with one output named after the query.

Invariants:
  1. Every query follows the Nexmark SQL text of the Flink / Feldera suites (column names included), with the
     deviations listed in :data:`NOTES`; its integrated output equals that SQL over the events pushed so far that
     are not late (tests/nexmark checks each against DuckDB at several step boundaries).
  2. Every input declares ``event_time="dateTime"`` with the given lateness, so windowed queries (q5, q7, q8, q11,
     q12) drop closed windows from their state; the generator emits every stream in event-time order, so no row
     is late.
  3. q12's windows follow processing time: the step's logged now (``Pipeline(clock=...)``), not the events, so
     its output depends on how the events are divided into steps; a replayed step gives the same output.
"""

from __future__ import annotations

import datetime
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc

import dbsp_core as dbsp
from dbsp_core.circuit import Circuit, Stream
from dbsp_core.nexmark.generator import AUCTION, BID, PERSON
from dbsp_core.operators.expr import split_parts, strftime
from dbsp_core.operators.window import _window

WINDOW_MS = 10_000
F = pc.field

NOTES = {
    "q6": "Flink does not run q6; here: per seller, the average final price of its 10 latest auctions (by auction "
          "start), the final price being an auction's highest bid between its start and expiry",
    "q10": "the filesystem sink is the output consumer's business; the query is the projection with the two "
           "formatted dates",
    "q11": "the view holds open sessions too (Flink emits a session once the watermark closes it); a step "
           "recomputes and re-emits the sessions it touches, so a bidder who never pauses 10 s (a hot bidder of "
           "the generator) costs its whole open session on every step that brings one of its bids",
    "q12": "PROCTIME() is the step's logged now: every bid counts in the 10 s window of the step that brought it; "
           "the bids are projected to (bidder, dateTime) first, so a deleted bid retracts the latest copy of its "
           "(bidder, dateTime)",
    "q13": "the side input is a fourth input, 'side_input' (key, value), pushed once (nexmark.side_input())",
    "q19": "no rank_number column: the view is the set of top-10 rows per auction",
}


def _inputs(c: Circuit, lateness: int, append_only: bool) -> tuple[Stream, Stream, Stream]:
    kw = {"event_time": "dateTime", "lateness": lateness, "append_only": append_only}
    return c.input("person", PERSON, **kw), c.input("auction", AUCTION, **kw), c.input("bid", BID, **kw)


# DATE_FORMAT of the bids' dateTime, by the date cast and field kernels (operators/expr.py), not Arrow's strftime
DAY = strftime(F("dateTime"), "%Y-%m-%d", BID.field("dateTime").type)
MINUTE = strftime(F("dateTime"), "%H:%M", BID.field("dateTime").type)
# the same string from a date32 column "day" (q17 groups by the date and formats its output rows)
DAY_OF_DATE = strftime(F("day"), "%Y-%m-%d", pa.date32())


def _keep(s: Stream, *names: str, **renames: str) -> Stream:
    return s.select(**{n: n for n in names}, **renames)


def _auction_bids(auction: Stream, bid: Stream) -> Stream:
    """Auctions joined with their bids placed between the auction's start and expiry (q4, q6, q9)."""
    j = auction.join(bid, left_on="id", right_on="auction")
    return j.filter((F("dateTime_right") >= F("dateTime")) & (F("dateTime_right") <= F("expires")))


def q0(p: Stream, a: Stream, b: Stream) -> Stream:
    return b


def q1(p: Stream, a: Stream, b: Stream) -> Stream:
    return b.select(auction="auction", bidder="bidder", price=F("price").cast(pa.float64()) * 0.908,
                    dateTime="dateTime", extra="extra")


def q2(p: Stream, a: Stream, b: Stream) -> Stream:
    return _keep(b.filter(F("auction") - F("auction") / 123 * 123 == 0), "auction", "price")


def q3(p: Stream, a: Stream, b: Stream) -> Stream:
    people = p.filter((F("state") == "OR") | (F("state") == "ID") | (F("state") == "CA"))
    j = a.filter(F("category") == 10).join(people, left_on="seller", right_on="id")
    return _keep(j, "name", "city", "state", "id")


def q4(p: Stream, a: Stream, b: Stream) -> Stream:
    # the columns the view reads (the projections a SQL planner pushes down, as sql/joinplan.py does): the join's
    # traces and its output hold 4 + 3 integer columns, not every auction and bid column with their strings
    a, b = _keep(a, "id", "category", "dateTime", "expires"), _keep(b, "auction", "price", "dateTime")
    final = _keep(_auction_bids(a, b), "id", "category", "price").group_by("id", "category").agg(
        final=dbsp.max("price"))
    return final.group_by("category").agg(avg=dbsp.avg("final"))


def q5(p: Stream, a: Stream, b: Stream) -> Stream:
    counts = b.hop("dateTime", WINDOW_MS, 2_000).group_by("auction", "window_start", "window_end").agg(
        num=dbsp.count())
    return _keep(counts.group_by("window_start", "window_end").argmax("num"), "auction", "num")


def q6(p: Stream, a: Stream, b: Stream) -> Stream:
    final = _auction_bids(a, b).group_by("id", "seller", "dateTime").agg(final=dbsp.max("price"))
    latest = final.group_by("seller").top_k(10, ("dateTime", "descending"))
    return latest.group_by("seller").agg(avg=dbsp.avg("final"))


def q7(p: Stream, a: Stream, b: Stream) -> Stream:
    # the columns the view reads (the projections a SQL planner pushes down): the aggregate indexes (price, time)
    # rows, and the join's trace of bids holds no channel or url
    maxes = _keep(b, "price", "dateTime").tumble("dateTime", WINDOW_MS).group_by("window_end").agg(
        maxprice=dbsp.max("price"))
    # each bid with the window ends e (multiples of 10 s) in [dateTime, dateTime + 10 s]: BETWEEN e - 10 s AND e;
    # one e for most bids, two for a bid on a multiple of 10 s (window.py invariant 4)
    bids = _keep(b, "auction", "price", "bidder", "dateTime", "extra")
    ends = _window(bids, "dateTime", "points", WINDOW_MS, 0, 0, WINDOW_MS, "wend", None, "q7")
    j = ends.join(maxes, left_on=["wend", "price"], right_on=["window_end", "maxprice"])
    j = j.filter(F("dateTime").cast(pa.int64()) >= F("wend").cast(pa.int64()) - WINDOW_MS)
    j = j.filter(F("dateTime") <= F("wend"))
    return _keep(j, "auction", "price", "bidder", "dateTime", "extra")


def q8(p: Stream, a: Stream, b: Stream) -> Stream:
    people = _keep(p.tumble("dateTime", WINDOW_MS), "id", "name", "window_start", "window_end").distinct()
    sellers = _keep(a.tumble("dateTime", WINDOW_MS), "seller", "window_start", "window_end").distinct()
    j = people.join(sellers, left_on=["id", "window_start", "window_end"],
                    right_on=["seller", "window_start", "window_end"])
    return j.select(id="id", name="name", stime="window_start")


def q9(p: Stream, a: Stream, b: Stream) -> Stream:
    j = _keep(_auction_bids(a, b), *AUCTION.names[:-1], "auction", "bidder", "price", extra="extra",
              bid_dateTime="dateTime_right", bid_extra="extra_right")
    return j.group_by("id").top_k(1, [("price", "descending"), ("bid_dateTime", "ascending")])


def q10(p: Stream, a: Stream, b: Stream) -> Stream:
    return b.select(auction="auction", bidder="bidder", price="price", dateTime="dateTime", extra="extra",
                    dt=DAY, hm=MINUTE)


def q11(p: Stream, a: Stream, b: Stream) -> Stream:
    # the sessions keep only what the view reads: each stored row is 16 bytes, not a whole bid with its strings
    sessions = _keep(b, "bidder", "dateTime").group_by("bidder").session("dateTime", WINDOW_MS)
    counts = sessions.group_by("bidder", "session_start", "session_end").agg(bid_count=dbsp.count())
    return counts.select(bidder="bidder", bid_count="bid_count", starttime="session_start", endtime="session_end")


def q12(p: Stream, a: Stream, b: Stream) -> Stream:
    windows = _keep(b, "bidder", "dateTime").proc_tumble(WINDOW_MS, unit="ms")  # dateTime: cleanup by watermark
    counts = windows.group_by("bidder", "window_start", "window_end").agg(bid_count=dbsp.count())
    return counts.select(bidder="bidder", bid_count="bid_count", starttime="window_start", endtime="window_end")


def q13(p: Stream, a: Stream, b: Stream, side: Stream) -> Stream:
    keyed = b.select(auction="auction", bidder="bidder", price="price", dateTime="dateTime",
                     key=F("auction") - F("auction") / 10_000 * 10_000)
    return _keep(keyed.join(side, on="key"), "auction", "bidder", "price", "dateTime", "value")


def q14(p: Stream, a: Stream, b: Stream) -> Stream:
    eur = F("price").cast(pa.float64()) * 0.908
    hour = pc.hour(F("dateTime"))
    kind = pc.if_else((hour >= 8) & (hour <= 18), "dayTime",
                      pc.if_else((hour <= 6) | (hour >= 20), "nightTime", "otherTime"))
    return b.filter((eur > 1_000_000) & (eur < 50_000_000)).select(
        auction="auction", bidder="bidder", price=eur, bidTimeType=kind, dateTime="dateTime", extra="extra",
        c_counts=pc.count_substring(F("extra"), "c"))


# a rank's flag column is its condition cast to int64 (1, 0, null where the condition is null: IF(c, 1, 0)'s
# values), a third of if_else's CPU
_RANKS = {"rank1": F("price") < 10_000, "rank2": (F("price") >= 10_000) & (F("price") < 1_000_000),
          "rank3": F("price") >= 1_000_000}


def _report(b: Stream, keys: tuple[str, ...], extra: dict) -> Stream:
    """q15/q16: bid, bidder and auction counts per rank of price, as counts and count_distincts."""
    cols = {k: k for k in keys}
    cols.update(bidder="bidder", auction="auction")
    for r, cond in _RANKS.items():
        cols[f"{r}_n"] = cond.cast(pa.int64())
        cols[f"{r}_b"] = pc.if_else(cond, F("bidder"), pa.scalar(None, pa.int64()))
        cols[f"{r}_a"] = pc.if_else(cond, F("auction"), pa.scalar(None, pa.int64()))
    aggs = {"total_bids": dbsp.count()}
    aggs.update({f"{r}_bids": dbsp.sum(f"{r}_n") for r in _RANKS})
    aggs["total_bidders"] = dbsp.count_distinct("bidder")
    aggs.update({f"{r}_bidders": dbsp.count_distinct(f"{r}_b") for r in _RANKS})
    aggs["total_auctions"] = dbsp.count_distinct("auction")
    aggs.update({f"{r}_auctions": dbsp.count_distinct(f"{r}_a") for r in _RANKS})
    return b.select(**cols, **extra).group_by(*keys).agg(**aggs)


def q15(p: Stream, a: Stream, b: Stream) -> Stream:
    return _report(b.select(day=DAY, bidder="bidder", auction="auction", price="price"), ("day",), {})


def q16(p: Stream, a: Stream, b: Stream) -> Stream:
    days = b.select(channel="channel", day=DAY, minute=MINUTE,
                    bidder="bidder", auction="auction", price="price")
    counts = _report(days, ("channel", "day"), {})
    minutes = days.group_by("channel", "day").agg(minute=dbsp.max("minute"))
    j = counts.join(minutes, on=["channel", "day"])
    return j.select(**{n: n for n in ["channel", "day", "minute"] + counts.schema.names[2:]})


def q17(p: Stream, a: Stream, b: Stream) -> Stream:
    # grouped by the bid's date (date32), formatted once per output row: DATE_FORMAT(dateTime, 'yyyy-MM-dd') is
    # one string per date and a different one for every other date, so the groups are the SQL's; the change's
    # rows are hashed, exchanged and grouped on a 4-byte key instead of a string, and only the view's changed
    # rows are formatted, not every bid
    days = b.select(auction="auction", day=F("dateTime").cast(pa.date32()), price="price",
                    **{f"{r}_n": c.cast(pa.int64()) for r, c in _RANKS.items()})
    agg = days.group_by("auction", "day").agg(
        total_bids=dbsp.count(), **{f"{r}_bids": dbsp.sum(f"{r}_n") for r in _RANKS},
        min_price=dbsp.min("price"), max_price=dbsp.max("price"), avg_price=dbsp.avg("price"),
        sum_price=dbsp.sum("price"))
    return agg.select(**{n: (DAY_OF_DATE if n == "day" else n) for n in agg.schema.names})


def q18(p: Stream, a: Stream, b: Stream) -> Stream:
    return b.group_by("bidder", "auction").top_k(1, ("dateTime", "descending"))


def q19(p: Stream, a: Stream, b: Stream) -> Stream:
    return b.group_by("auction").top_k(10, ("price", "descending"))


def q20(p: Stream, a: Stream, b: Stream) -> Stream:
    j = b.join(a.filter(F("category") == 10), left_on="auction", right_on="id")
    return j.select(auction="auction", bidder="bidder", price="price", channel="channel", url="url",
                    bid_dateTime="dateTime", bid_extra="extra", itemName="itemName", description="description",
                    initialBid="initialBid", reserve="reserve", auction_dateTime="dateTime_right",
                    expires="expires", seller="seller", category="category", auction_extra="extra_right")


_HOT = {"apple": "0", "google": "1", "facebook": "2", "baidu": "3"}
Q21 = pa.schema([("auction", pa.int64()), ("bidder", pa.int64()), ("price", pa.int64()), ("channel", pa.string()),
                 ("channel_id", pa.string())])
Q22 = pa.schema([("auction", pa.int64()), ("bidder", pa.int64()), ("price", pa.int64()), ("channel", pa.string()),
                 ("dir1", pa.string()), ("dir2", pa.string()), ("dir3", pa.string())])


def _channel_ids(batch: pa.RecordBatch) -> pa.RecordBatch:
    """q21's CASE over lower(channel), else the channel_id URL parameter (null when absent), and its WHERE."""
    low = pc.utf8_lower(batch.column("channel"))
    from_url = pc.struct_field(pc.extract_regex(batch.column("url"), r"(?P<sep>&|^)channel_id=(?P<id>[^&]*)"), "id")
    cid = from_url
    for name, code in _HOT.items():
        cid = pc.if_else(pc.equal(low, name), code, cid)
    keep = pc.is_valid(cid)
    cols = [batch.column(n) for n in Q21.names[:4]] + [cid]
    return pa.RecordBatch.from_arrays(cols, schema=Q21).filter(keep)


def _url_dirs(batch: pa.RecordBatch) -> pa.RecordBatch:
    """q22's SPLIT_INDEX(url, '/', 3..5): the parts of the URL between slashes, null when there are fewer."""
    dirs = split_parts(batch.column("url"), "/", (3, 4, 5))
    return pa.RecordBatch.from_arrays([batch.column(n) for n in Q22.names[:4]] + dirs, schema=Q22)


def q21(p: Stream, a: Stream, b: Stream) -> Stream:
    return b.flat_map(_channel_ids, schema=Q21)


def q22(p: Stream, a: Stream, b: Stream) -> Stream:
    return b.flat_map(_url_dirs, schema=Q22)


QUERIES: dict[str, Callable[..., Stream]] = {
    "q0": q0, "q1": q1, "q2": q2, "q3": q3, "q4": q4, "q5": q5, "q6": q6, "q7": q7, "q8": q8, "q9": q9,
    "q10": q10, "q11": q11, "q12": q12, "q13": q13, "q14": q14, "q15": q15, "q16": q16, "q17": q17, "q18": q18,
    "q19": q19, "q20": q20, "q21": q21, "q22": q22}


def circuit(query: str, lateness: int | datetime.timedelta = datetime.timedelta(seconds=4),
            append_only: bool = True) -> Circuit:
    """The circuit of Nexmark query ``query`` ("q0".."q22"): inputs person, auction, bid (and side_input for q13),
    one output named ``query``. Nexmark's streams only insert, so they are declared ``append_only`` (a top-k then
    keeps its shown rows alone, operators/top_k.py invariant 5); ``append_only=False`` takes deletions too.

    >>> c = circuit("q4")
    >>> sorted(c.inputs), list(c.outputs), c.nodes[c.outputs["q4"]].schema.names
    (['auction', 'bid', 'person'], ['q4'], ['category', 'avg'])
    """
    if query not in QUERIES:
        raise KeyError(f"unknown Nexmark query {query!r}; the queries are q0..q22")
    c = Circuit()
    p, a, b = _inputs(c, lateness, append_only)
    if query == "q13":
        side = c.input("side_input", pa.schema([("key", pa.int64()), ("value", pa.string())]))
        c.output(query, q13(p, a, b, side))
    else:
        c.output(query, QUERIES[query](p, a, b))
    return c
