"""The Nexmark event generator: persons, auctions and bids of an online auction as Arrow tables in event-time order, with the reference generator's proportions, id ranges and hot keys, vectorized with numpy and independent of the batch size.

Invariants (enforced here):
  1. Event ``i`` (0-based) is a person when ``i % 50 == 0``, an auction when ``1 <= i % 50 <= 3`` and a bid otherwise
     (1 : 3 : 46, the reference proportions). Its time is ``base_time + i / rate`` (milliseconds, truncated), so
     every stream is in event-time order, within and across batches.
  2. Ids follow the reference generator (Beam / Flink Nexmark ``GeneratorConfig``): person ids start at 1000 and
     auction ids at 1000, one per person / auction event; categories are 10..14. A bid's auction is, with
     probability 1/2, the *hot* auction ``last // 100 * 100`` of the last 100 auctions, else one of the last 100
     in-flight auctions or the next 10; its bidder is, with probability 3/4, the hot bidder
     ``last // 100 * 100 + 1``, else one of the last 1000 active persons or the next 10; an auction's seller is,
     with probability 3/4, the hot seller ``last // 100 * 100``, else chosen like a bidder. Prices are
     ``round(10 ** (6u) * 100)`` for uniform u; half the bids come from the 4 hot channels, the others from
     ``channel-<n>`` for n < 10000. Auctions expire ``1 + uniform(0, 2 * horizon)`` ms after they start, where
     the horizon is the time of 1666 events (the reference's in-flight auction count).
  3. Every random draw is a hash of (seed, event id, field) (splitmix64), so an event depends only on its id and
     the seed: any batch size gives the same events. Strings come from pools drawn once per seed (names, emails,
     cities, URLs), so no per-row Python runs; the ``extra`` columns are short strings, not the reference's
     padding to an average record size.
"""

from __future__ import annotations

import datetime
import functools
from typing import Iterator

import numpy as np
import pyarrow as pa

PERSON_PROPORTION, AUCTION_PROPORTION, BID_PROPORTION = 1, 3, 46
TOTAL_PROPORTION = PERSON_PROPORTION + AUCTION_PROPORTION + BID_PROPORTION
FIRST_PERSON_ID, FIRST_AUCTION_ID, FIRST_CATEGORY_ID, NUM_CATEGORIES = 1000, 1000, 10, 5
NUM_ACTIVE_PEOPLE, PERSON_ID_LEAD, NUM_IN_FLIGHT_AUCTIONS, AUCTION_ID_LEAD = 1000, 10, 100, 10
HOT_RATIO = 100  # hot ids are the first of each run of 100
HOT_AUCTION_PROB, HOT_BIDDER_PROB, HOT_SELLER_PROB, HOT_CHANNEL_PROB = 1 / 2, 3 / 4, 3 / 4, 1 / 2
CHANNELS = 10_000
BASE_TIME = datetime.datetime(2015, 7, 15, tzinfo=datetime.timezone.utc)  # the reference's base time
DEFAULT_RATE = 10_000_000  # events per second of event time

TS = pa.timestamp("ms")
PERSON = pa.schema([("id", pa.int64()), ("name", pa.string()), ("emailAddress", pa.string()),
                    ("creditCard", pa.string()), ("city", pa.string()), ("state", pa.string()),
                    ("dateTime", TS), ("extra", pa.string())])
AUCTION = pa.schema([("id", pa.int64()), ("itemName", pa.string()), ("description", pa.string()),
                     ("initialBid", pa.int64()), ("reserve", pa.int64()), ("dateTime", TS), ("expires", TS),
                     ("seller", pa.int64()), ("category", pa.int64()), ("extra", pa.string())])
BID = pa.schema([("auction", pa.int64()), ("bidder", pa.int64()), ("price", pa.int64()), ("channel", pa.string()),
                 ("url", pa.string()), ("dateTime", TS), ("extra", pa.string())])
SCHEMAS = {"person": PERSON, "auction": AUCTION, "bid": BID}

US_STATES = ["AZ", "CA", "ID", "OR", "WA", "WY"]
US_CITIES = ["Phoenix", "Los Angeles", "San Francisco", "Boise", "Portland", "Bend", "Redmond", "Seattle", "Kent",
             "Cheyenne"]
FIRST_NAMES = ["Peter", "Paul", "Luke", "John", "Saul", "Vicky", "Kate", "Julie", "Sarah", "Deiter", "Walter"]
LAST_NAMES = ["Shultz", "Abrams", "Spencer", "White", "Bartels", "Walton", "Smith", "Jones", "Noris"]
HOT_CHANNELS = ["Google", "Facebook", "Baidu", "Apple"]
POOL = 4096  # strings per pool

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def hashes(seed: int, ids: np.ndarray, field: int) -> np.ndarray:
    """64 random bits per event id: a hash of (seed, id, field) (invariant 3)."""
    key = np.uint64((seed * 0x632BE59BD9B4E019 + field * 0x8CB92BA72F3D8DD7) & 0xFFFFFFFFFFFFFFFF)
    with np.errstate(over="ignore"):
        return _mix(ids.view(np.uint64) * _GOLD + key)


def uniform(seed: int, ids: np.ndarray, field: int) -> np.ndarray:
    """Uniform floats in [0, 1), one per event id (invariant 3)."""
    return (hashes(seed, ids, field) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _below(seed: int, ids: np.ndarray, field: int, n: np.ndarray | int) -> np.ndarray:
    """Uniform ints in [0, n) per id."""
    return (uniform(seed, ids, field) * n).astype(np.int64)


def _strings(rng: np.random.Generator, n: int, lo: int, hi: int, alphabet: str = "abcdefghijklmnopqrstuvwxyz"
             ) -> list[str]:
    letters = np.array(list(alphabet))
    lens = rng.integers(lo, hi + 1, n)
    flat = letters[rng.integers(0, len(letters), int(lens.sum()))]
    cuts = np.cumsum(lens)[:-1]
    return ["".join(p) for p in np.split(flat, cuts)]


@functools.lru_cache(maxsize=4)
def _pools(seed: int) -> "_Pools":
    return _Pools(seed)


class _Pools:
    """The string pools of one seed (drawn once per process; rows take from them by index)."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng([seed, 0x4E58])
        self.names = pa.array([f"{a} {b}" for a in FIRST_NAMES for b in LAST_NAMES])
        self.emails = pa.array([f"{a}@{b}.com" for a, b in zip(_strings(rng, POOL, 7, 7), _strings(rng, POOL, 5, 5))])
        digits = rng.integers(0, 10, (POOL, 16)).astype(str)
        self.cards = pa.array([" ".join("".join(d[i:i + 4]) for i in range(0, 16, 4)) for d in digits])
        self.cities, self.states = pa.array(US_CITIES), pa.array(US_STATES)
        self.items = pa.array(_strings(rng, POOL, 20, 20))
        self.descriptions = pa.array(_strings(rng, POOL, 100, 100))
        self.extras = pa.array(_strings(rng, POOL, 0, 16, "abcdefghijklmnopqrstuvwxyz "))

        def base_url() -> str:
            a, b, c = _strings(rng, 3, 5, 5, "abcdefghijklmnopqrstuvwxyz_")
            return f"https://www.nexmark.com/{a}/{b}/{c}/item.htm?query=1"

        nums = np.arange(CHANNELS, dtype=np.uint32)
        rev = np.zeros(CHANNELS, dtype=np.uint32)
        for bit in range(32):  # Integer.reverse over the channel numbers, vectorized by bit
            rev |= ((nums >> np.uint32(bit)) & np.uint32(1)) << np.uint32(31 - bit)
        ids = np.abs(rev.view(np.int32).astype(np.int64))
        with_id = rng.integers(0, 10, CHANNELS) > 0
        urls = [base_url() for _ in range(len(HOT_CHANNELS))]
        urls += [base_url() + (f"&channel_id={i}" if w else "") for i, w in zip(ids.tolist(), with_id.tolist())]
        self.channels = pa.array(HOT_CHANNELS + [f"channel-{i}" for i in range(CHANNELS)])
        self.urls = pa.array(urls)


def _price(seed: int, ids: np.ndarray, field: int) -> np.ndarray:
    return np.rint(np.power(10.0, uniform(seed, ids, field) * 6.0) * 100.0).astype(np.int64)


def _last_person(ids: np.ndarray) -> np.ndarray:
    """Base-0 id of the last person created at or before each event."""
    return ids // TOTAL_PROPORTION  # the person is the first event of each run of 50


def _last_auction(ids: np.ndarray) -> np.ndarray:
    """Base-0 id of the last auction created at or before each event."""
    epoch, off = ids // TOTAL_PROPORTION, ids % TOTAL_PROPORTION
    before = off < PERSON_PROPORTION
    off = np.where(before, AUCTION_PROPORTION - 1,
                   np.minimum(off - PERSON_PROPORTION, AUCTION_PROPORTION - 1))
    return (epoch - before) * AUCTION_PROPORTION + off


def _next_person(seed: int, ids: np.ndarray, field: int) -> np.ndarray:
    n = _last_person(ids) + 1
    active = np.minimum(n, NUM_ACTIVE_PEOPLE)
    return n - active + _below(seed, ids, field, active + PERSON_ID_LEAD)


def _times(ids: np.ndarray, rate: int, base_ms: int) -> pa.Array:
    return pa.array(base_ms + (ids * 1_000_000 // rate) // 1000, pa.int64()).cast(TS)


def _take(pool: pa.Array, idx: np.ndarray) -> pa.Array:
    return pool.take(pa.array(idx, pa.int64()))


def generate(events: int, seed: int = 0, batch: int = 1_000_000, rate: int = DEFAULT_RATE, first_event: int = 0,
             base_time: datetime.datetime = BASE_TIME) -> Iterator[dict[str, pa.Table]]:
    """Yield ``{"person": table, "auction": table, "bid": table}`` for consecutive batches of ``batch`` events.

    ``events`` events in all, starting at event number ``first_event``; ``rate`` events per second of event time
    set the ``dateTime`` spacing (the reference default of the published benchmarks, 10M/s). The tables have
    the Nexmark column names (:data:`PERSON`, :data:`AUCTION`, :data:`BID`) and are in event-time order.

    >>> sizes = [{k: t.num_rows for k, t in b.items()} for b in generate(100, batch=50)]
    >>> sizes
    [{'person': 1, 'auction': 3, 'bid': 46}, {'person': 1, 'auction': 3, 'bid': 46}]
    >>> b = next(generate(50))
    >>> b["auction"].column("id").to_pylist(), b["bid"].column_names
    ([1000, 1001, 1002], ['auction', 'bidder', 'price', 'channel', 'url', 'dateTime', 'extra'])
    """
    if events < 0 or batch < 1 or rate < 1:
        raise ValueError(f"generate: events >= 0, batch >= 1 and rate >= 1 are needed, got {events}, {batch}, {rate}")
    pools = _pools(seed)
    base_ms = int(base_time.timestamp() * 1000)
    horizon_ms = (NUM_IN_FLIGHT_AUCTIONS * TOTAL_PROPORTION // AUCTION_PROPORTION) * 1000 // rate
    for start in range(first_event, first_event + events, batch):
        ids = np.arange(start, min(start + batch, first_event + events), dtype=np.int64)
        off = ids % TOTAL_PROPORTION
        pid = ids[off < PERSON_PROPORTION]
        aid = ids[(off >= PERSON_PROPORTION) & (off < PERSON_PROPORTION + AUCTION_PROPORTION)]
        bid = ids[off >= PERSON_PROPORTION + AUCTION_PROPORTION]
        yield {"person": _persons(seed, pid, pools, rate, base_ms),
               "auction": _auctions(seed, aid, pools, rate, base_ms, horizon_ms),
               "bid": _bids(seed, bid, pools, rate, base_ms)}


def _persons(seed: int, ids: np.ndarray, pools: _Pools, rate: int, base_ms: int) -> pa.Table:
    n = len(ids)
    cols = [pa.array(_last_person(ids) + FIRST_PERSON_ID, pa.int64()),
            _take(pools.names, _below(seed, ids, 1, len(pools.names))),
            _take(pools.emails, _below(seed, ids, 2, POOL)),
            _take(pools.cards, _below(seed, ids, 3, POOL)),
            _take(pools.cities, _below(seed, ids, 4, len(US_CITIES))),
            _take(pools.states, _below(seed, ids, 5, len(US_STATES))),
            _times(ids, rate, base_ms),
            _take(pools.extras, _below(seed, ids, 6, POOL))]
    return pa.Table.from_arrays(cols, schema=PERSON) if n else PERSON.empty_table()


def _auctions(seed: int, ids: np.ndarray, pools: _Pools, rate: int, base_ms: int, horizon_ms: int) -> pa.Table:
    if len(ids) == 0:
        return AUCTION.empty_table()
    hot = uniform(seed, ids, 10) < HOT_SELLER_PROB
    seller = np.where(hot, _last_person(ids) // HOT_RATIO * HOT_RATIO, _next_person(seed, ids, 11)) + FIRST_PERSON_ID
    initial = _price(seed, ids, 12)
    start = base_ms + (ids * 1_000_000 // rate) // 1000
    length = 1 + _below(seed, ids, 13, max(horizon_ms * 2, 1))
    cols = [pa.array(_last_auction(ids) + FIRST_AUCTION_ID, pa.int64()),
            _take(pools.items, _below(seed, ids, 14, POOL)),
            _take(pools.descriptions, _below(seed, ids, 15, POOL)),
            pa.array(initial), pa.array(initial + _price(seed, ids, 16)),
            pa.array(start, pa.int64()).cast(TS), pa.array(start + length, pa.int64()).cast(TS),
            pa.array(seller), pa.array(FIRST_CATEGORY_ID + _below(seed, ids, 17, NUM_CATEGORIES)),
            _take(pools.extras, _below(seed, ids, 18, POOL))]
    return pa.Table.from_arrays(cols, schema=AUCTION)


def _bits(h: np.ndarray, lo: int, n: int) -> np.ndarray:
    """Bits ``lo .. lo + n - 1`` of a uint64 array, as int64."""
    return ((h >> np.uint64(lo)) & np.uint64((1 << n) - 1)).astype(np.int64)


def _bids(seed: int, ids: np.ndarray, pools: _Pools, rate: int, base_ms: int) -> pa.Table:
    if len(ids) == 0:
        return BID.empty_table()
    h = hashes(seed, ids, 20)  # one 64-bit draw holds the small choices (invariant 3): bit fields below
    h2 = hashes(seed, ids, 21)  # two 32-bit draws: the non-hot auction and bidder
    last_p, last_a = _last_person(ids), _last_auction(ids)
    n_a = last_a + 1
    act_a = np.minimum(n_a, NUM_IN_FLIGHT_AUCTIONS)
    auction = np.where(_bits(h, 0, 1) == 0, last_a // HOT_RATIO * HOT_RATIO,  # hot with probability 1/2
                       n_a - act_a + ((act_a + AUCTION_ID_LEAD) * _bits(h2, 0, 32) >> 32))
    n_p = last_p + 1
    act_p = np.minimum(n_p, NUM_ACTIVE_PEOPLE)
    bidder = np.where(_bits(h, 1, 2) > 0, last_p // HOT_RATIO * HOT_RATIO + 1,  # hot with probability 3/4
                      n_p - act_p + ((act_p + PERSON_ID_LEAD) * _bits(h2, 32, 32) >> 32))
    channel = np.where(_bits(h, 3, 1) == 0, _bits(h, 4, 2),  # a hot channel with probability 1/2
                       len(HOT_CHANNELS) + (_bits(h, 6, 24) * CHANNELS >> 24))
    cols = [pa.array(auction + FIRST_AUCTION_ID), pa.array(bidder + FIRST_PERSON_ID), pa.array(_price(seed, ids, 26)),
            _take(pools.channels, channel), _take(pools.urls, channel), _times(ids, rate, base_ms),
            _take(pools.extras, _bits(h, 30, 12))]
    return pa.Table.from_arrays(cols, schema=BID)


def side_input(keys: int = 10_000) -> pa.Table:
    """Query 13's bounded side table: ``key`` 0..keys-1 and ``value`` (the key as a string)."""
    k = np.arange(keys, dtype=np.int64)
    return pa.table({"key": k, "value": pa.array(k).cast(pa.string())})
