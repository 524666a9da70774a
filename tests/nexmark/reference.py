"""The Nexmark queries in DuckDB SQL, column for column as dbsp_core.nexmark builds them (ties of ROW_NUMBER broken by the remaining columns, as top_k does; q11's sessions by LAG over each bidder's distinct times; q12's processing time as a column ``p_time`` of bid: the now of the step that brought the bid)."""

MS = "epoch_ms(dateTime)"


def win(col: str = "dateTime", size: int = 10_000, shift: int = 0) -> str:
    """The start (shift 0) or end (shift = size) of the tumbling window of ``col``, as a timestamp."""
    return f"epoch_ms(CAST(floor(epoch_ms({col}) / {size}) AS BIGINT) * {size} + {shift})"


RANKS = {"rank1": "price < 10000", "rank2": "price >= 10000 AND price < 1000000", "rank3": "price >= 1000000"}


def _report(keys: str) -> str:
    cols = ["count(*)"] + [f"count(*) FILTER (WHERE {c})" for c in RANKS.values()]
    for what in ("bidder", "auction"):
        cols += [f"count(DISTINCT {what})"] + [f"count(DISTINCT {what}) FILTER (WHERE {c})" for c in RANKS.values()]
    return ", ".join(cols)


AUCTION_BIDS = "FROM auction A, bid B WHERE A.id = B.auction AND B.dateTime BETWEEN A.dateTime AND A.expires"
DAY = "strftime(dateTime, '%Y-%m-%d')"

SQL = {
    "q0": "SELECT * FROM bid",
    "q1": "SELECT auction, bidder, CAST(price AS DOUBLE) * 0.908, dateTime, extra FROM bid",
    "q2": "SELECT auction, price FROM bid WHERE auction % 123 = 0",
    "q3": "SELECT P.name, P.city, P.state, A.id FROM auction A JOIN person P ON A.seller = P.id "
          "WHERE A.category = 10 AND P.state IN ('OR', 'ID', 'CA')",
    "q4": f"SELECT category, avg(final) FROM (SELECT max(B.price) AS final, A.category {AUCTION_BIDS} "
          f"GROUP BY A.id, A.category) GROUP BY category",
    "q5": f"WITH w AS (SELECT auction, {win(size=2000)} - to_milliseconds(2000 * i) AS ws FROM bid, range(5) r(i)), "
          f"c AS (SELECT auction, ws, count(*) AS num FROM w GROUP BY auction, ws) "
          f"SELECT auction, num FROM c JOIN (SELECT ws, max(num) AS m FROM c GROUP BY ws) M USING (ws) WHERE num >= m",
    "q6": f"WITH f AS (SELECT A.id, A.seller, A.dateTime, max(B.price) AS final {AUCTION_BIDS} "
          f"GROUP BY A.id, A.seller, A.dateTime) SELECT seller, avg(final) FROM (SELECT *, row_number() OVER "
          f"(PARTITION BY seller ORDER BY dateTime DESC, id, final) AS r FROM f) WHERE r <= 10 GROUP BY seller",
    "q7": f"SELECT B.auction, B.price, B.bidder, B.dateTime, B.extra FROM bid B JOIN (SELECT max(price) AS maxprice, "
          f"we FROM (SELECT price, {win(shift=10_000)} AS we FROM bid) GROUP BY we) B1 ON B.price = B1.maxprice "
          f"WHERE B.dateTime BETWEEN B1.we - INTERVAL 10 SECOND AND B1.we",
    "q8": f"SELECT P.id, P.name, P.ws FROM (SELECT DISTINCT id, name, {win()} AS ws FROM person) P JOIN "
          f"(SELECT DISTINCT seller, {win()} AS ws FROM auction) A ON P.id = A.seller AND P.ws = A.ws",
    "q9": f"SELECT id, itemName, description, initialBid, reserve, dateTime, expires, seller, category, auction, "
          f"bidder, price, extra, bid_dateTime, bid_extra FROM (SELECT A.*, B.auction, B.bidder, B.price, "
          f"B.dateTime AS bid_dateTime, B.extra AS bid_extra, row_number() OVER (PARTITION BY A.id ORDER BY "
          f"B.price DESC, B.dateTime, A.itemName, A.description, A.initialBid, A.reserve, A.dateTime, A.expires, "
          f"A.seller, A.category, B.auction, B.bidder, A.extra, B.extra) AS rn {AUCTION_BIDS}) WHERE rn = 1",
    "q10": "SELECT auction, bidder, price, dateTime, extra, strftime(dateTime, '%Y-%m-%d'), "
           "strftime(dateTime, '%H:%M') FROM bid",
    "q11": "WITH d AS (SELECT DISTINCT bidder, epoch_ms(dateTime) AS t FROM bid), "
           "f AS (SELECT bidder, t, CASE WHEN t - lag(t) OVER (PARTITION BY bidder ORDER BY t) <= 10000 THEN 0 "
           "ELSE 1 END AS n FROM d), "
           "g AS (SELECT bidder, t, sum(n) OVER (PARTITION BY bidder ORDER BY t) AS sid FROM f), "
           "s AS (SELECT bidder, sid, min(t) AS ss, max(t) + 10000 AS se FROM g GROUP BY bidder, sid) "
           "SELECT B.bidder, count(*), epoch_ms(s.ss), epoch_ms(s.se) FROM bid B "
           "JOIN g ON B.bidder = g.bidder AND epoch_ms(B.dateTime) = g.t "
           "JOIN s ON g.bidder = s.bidder AND g.sid = s.sid "
           "GROUP BY B.bidder, s.ss, s.se",
    "q12": f"SELECT bidder, count(*), ws, ws + INTERVAL 10 SECOND FROM (SELECT bidder, {win('p_time')} AS ws "
           f"FROM bid) GROUP BY bidder, ws",
    "q13": "SELECT B.auction, B.bidder, B.price, B.dateTime, S.value FROM bid B JOIN side_input S "
           "ON B.auction % 10000 = S.key",
    "q14": "SELECT auction, bidder, CAST(price AS DOUBLE) * 0.908, CASE WHEN hour(dateTime) BETWEEN 8 AND 18 THEN "
           "'dayTime' WHEN hour(dateTime) <= 6 OR hour(dateTime) >= 20 THEN 'nightTime' ELSE 'otherTime' END, "
           "dateTime, extra, length(extra) - length(replace(extra, 'c', '')) FROM bid "
           "WHERE CAST(price AS DOUBLE) * 0.908 > 1000000 AND CAST(price AS DOUBLE) * 0.908 < 50000000",
    "q15": f"SELECT day, {_report('day')} FROM (SELECT {DAY} AS day, * FROM bid) GROUP BY day",
    "q16": f"SELECT channel, day, max(strftime(dateTime, '%H:%M')), {_report('channel, day')} FROM "
           f"(SELECT {DAY} AS day, * FROM bid) GROUP BY channel, day",
    "q17": "SELECT auction, day, count(*), " + ", ".join(f"count(*) FILTER (WHERE {c})" for c in RANKS.values())
           + f", min(price), max(price), avg(price), CAST(sum(price) AS BIGINT) FROM (SELECT {DAY} AS day, * FROM bid) "
             f"GROUP BY auction, day",
    "q18": "SELECT * EXCLUDE (r) FROM (SELECT *, row_number() OVER (PARTITION BY bidder, auction ORDER BY "
           "dateTime DESC, price, channel, url, extra) AS r FROM bid) WHERE r = 1",
    "q19": "SELECT * EXCLUDE (r) FROM (SELECT *, row_number() OVER (PARTITION BY auction ORDER BY price DESC, "
           "bidder, channel, url, dateTime, extra) AS r FROM bid) WHERE r <= 10",
    "q20": "SELECT B.auction, B.bidder, B.price, B.channel, B.url, B.dateTime, B.extra, A.itemName, A.description, "
           "A.initialBid, A.reserve, A.dateTime, A.expires, A.seller, A.category, A.extra FROM bid B "
           "JOIN auction A ON B.auction = A.id WHERE A.category = 10",
    "q21": "SELECT auction, bidder, price, channel, CASE lower(channel) WHEN 'apple' THEN '0' WHEN 'google' THEN '1' "
           "WHEN 'facebook' THEN '2' WHEN 'baidu' THEN '3' ELSE CASE WHEN regexp_matches(url, '(&|^)channel_id=') "
           "THEN regexp_extract(url, '(&|^)channel_id=([^&]*)', 2) END END FROM bid "
           "WHERE regexp_matches(url, '(&|^)channel_id=') OR lower(channel) IN ('apple', 'google', 'facebook', 'baidu')",
    "q22": "SELECT auction, bidder, price, channel, split_part(url, '/', 4), split_part(url, '/', 5), "
           "split_part(url, '/', 6) FROM bid",
}
