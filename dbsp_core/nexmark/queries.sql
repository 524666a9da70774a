-- The Nexmark queries q0-q22 as SQL views over person, auction and bid, except q11 and q12: the SQL compiler
-- has no SESSION or PROCTIME() windows (the hand-built circuits use Stream.session and proc_tumble). Each view
-- gives the same rows as the hand-built circuit of the same name (dbsp_core/nexmark/queries.py;
-- tests/nexmark/test_sql_queries.py checks it); ties of a ranking are broken by the other columns, as the
-- hand-built top-k does. Column names in camel case are quoted.

CREATE TABLE person (id BIGINT, name VARCHAR, "emailAddress" VARCHAR, "creditCard" VARCHAR, city VARCHAR,
    state VARCHAR, "dateTime" TIMESTAMP(3), extra VARCHAR,
    WATERMARK FOR "dateTime" AS "dateTime" - INTERVAL '4' SECOND);
CREATE TABLE auction (id BIGINT, "itemName" VARCHAR, description VARCHAR, "initialBid" BIGINT, reserve BIGINT,
    "dateTime" TIMESTAMP(3), expires TIMESTAMP(3), seller BIGINT, category BIGINT, extra VARCHAR,
    WATERMARK FOR "dateTime" AS "dateTime" - INTERVAL '4' SECOND);
CREATE TABLE bid (auction BIGINT, bidder BIGINT, price BIGINT, channel VARCHAR, url VARCHAR,
    "dateTime" TIMESTAMP(3), extra VARCHAR,
    WATERMARK FOR "dateTime" AS "dateTime" - INTERVAL '4' SECOND);
CREATE TABLE side_input (key BIGINT, value VARCHAR);

CREATE VIEW q0 AS SELECT * FROM bid;

CREATE VIEW q1 AS SELECT auction, bidder, CAST(price AS DOUBLE) * 0.908 AS price, "dateTime", extra FROM bid;

CREATE VIEW q2 AS SELECT auction, price FROM bid WHERE auction % 123 = 0;

CREATE VIEW q3 AS
SELECT P.name, P.city, P.state, A.id
FROM auction AS A JOIN person AS P ON A.seller = P.id
WHERE A.category = 10 AND (P.state = 'OR' OR P.state = 'ID' OR P.state = 'CA');

CREATE VIEW q4 AS
SELECT category, avg(final) AS avg
FROM (SELECT max(B.price) AS final, A.category
      FROM auction AS A, bid AS B
      WHERE A.id = B.auction AND B."dateTime" BETWEEN A."dateTime" AND A.expires
      GROUP BY A.id, A.category) AS Q
GROUP BY category;

CREATE VIEW q5 AS
SELECT auction, num
FROM (SELECT auction, num, RANK() OVER (PARTITION BY window_start, window_end ORDER BY num DESC) AS r
      FROM (SELECT auction, window_start, window_end, count(*) AS num
            FROM TABLE(HOP(TABLE bid, DESCRIPTOR("dateTime"), INTERVAL '2' SECOND, INTERVAL '10' SECOND))
            GROUP BY auction, window_start, window_end) AS counts) AS ranked
WHERE r <= 1;

CREATE VIEW q6 AS
SELECT seller, avg(final) AS avg
FROM (SELECT seller, final, ROW_NUMBER() OVER (PARTITION BY seller ORDER BY "dateTime" DESC, id, final) AS rn
      FROM (SELECT A.id, A.seller, A."dateTime", max(B.price) AS final
            FROM auction AS A, bid AS B
            WHERE A.id = B.auction AND B."dateTime" BETWEEN A."dateTime" AND A.expires
            GROUP BY A.id, A.seller, A."dateTime") AS F) AS L
WHERE rn <= 10
GROUP BY seller;

CREATE VIEW q7 AS
SELECT B.auction, B.price, B.bidder, B."dateTime", B.extra
FROM bid AS B
JOIN (SELECT max(price) AS maxprice, window_end
      FROM TABLE(TUMBLE(TABLE bid, DESCRIPTOR("dateTime"), INTERVAL '10' SECOND))
      GROUP BY window_end) AS B1
  ON B.price = B1.maxprice
WHERE B."dateTime" BETWEEN B1.window_end - INTERVAL '10' SECOND AND B1.window_end;

CREATE VIEW q8 AS
SELECT P.id, P.name, P.starttime AS stime
FROM (SELECT DISTINCT id, name, window_start AS starttime, window_end AS endtime
      FROM TABLE(TUMBLE(TABLE person, DESCRIPTOR("dateTime"), INTERVAL '10' SECOND))) AS P
JOIN (SELECT DISTINCT seller, window_start AS starttime, window_end AS endtime
      FROM TABLE(TUMBLE(TABLE auction, DESCRIPTOR("dateTime"), INTERVAL '10' SECOND))) AS A
  ON P.id = A.seller AND P.starttime = A.starttime AND P.endtime = A.endtime;

CREATE VIEW q9 AS
SELECT * EXCLUDE (rn)
FROM (SELECT A.id, A."itemName", A.description, A."initialBid", A.reserve, A."dateTime", A.expires, A.seller,
             A.category, B.auction, B.bidder, B.price, A.extra, B."dateTime" AS "bid_dateTime", B.extra AS bid_extra,
             ROW_NUMBER() OVER (PARTITION BY A.id ORDER BY B.price DESC, B."dateTime", B.bidder, B.extra) AS rn
      FROM auction AS A, bid AS B
      WHERE A.id = B.auction AND B."dateTime" BETWEEN A."dateTime" AND A.expires) AS W
WHERE rn = 1;

CREATE VIEW q10 AS
SELECT auction, bidder, price, "dateTime", extra, DATE_FORMAT("dateTime", 'yyyy-MM-dd') AS dt,
       DATE_FORMAT("dateTime", 'HH:mm') AS hm
FROM bid;

CREATE VIEW q13 AS
SELECT B.auction, B.bidder, B.price, B."dateTime", S.value
FROM bid AS B JOIN side_input AS S ON B.auction % 10000 = S.key;

CREATE VIEW q14 AS
SELECT auction, bidder, CAST(price AS DOUBLE) * 0.908 AS price,
       CASE WHEN hour("dateTime") BETWEEN 8 AND 18 THEN 'dayTime'
            WHEN hour("dateTime") <= 6 OR hour("dateTime") >= 20 THEN 'nightTime'
            ELSE 'otherTime' END AS "bidTimeType",
       "dateTime", extra, length(extra) - length(replace(extra, 'c', '')) AS c_counts
FROM bid
WHERE CAST(price AS DOUBLE) * 0.908 > 1000000 AND CAST(price AS DOUBLE) * 0.908 < 50000000;

CREATE VIEW q15 AS
SELECT day,
       count(*) AS total_bids,
       count(*) FILTER (WHERE price < 10000) AS rank1_bids,
       count(*) FILTER (WHERE price >= 10000 AND price < 1000000) AS rank2_bids,
       count(*) FILTER (WHERE price >= 1000000) AS rank3_bids,
       count(DISTINCT bidder) AS total_bidders,
       count(DISTINCT bidder) FILTER (WHERE price < 10000) AS rank1_bidders,
       count(DISTINCT bidder) FILTER (WHERE price >= 10000 AND price < 1000000) AS rank2_bidders,
       count(DISTINCT bidder) FILTER (WHERE price >= 1000000) AS rank3_bidders,
       count(DISTINCT auction) AS total_auctions,
       count(DISTINCT auction) FILTER (WHERE price < 10000) AS rank1_auctions,
       count(DISTINCT auction) FILTER (WHERE price >= 10000 AND price < 1000000) AS rank2_auctions,
       count(DISTINCT auction) FILTER (WHERE price >= 1000000) AS rank3_auctions
FROM (SELECT DATE_FORMAT("dateTime", 'yyyy-MM-dd') AS day, bidder, auction, price FROM bid) AS D
GROUP BY day;

CREATE VIEW q16 AS
SELECT channel, day, max(minute) AS minute,
       count(*) AS total_bids,
       count(*) FILTER (WHERE price < 10000) AS rank1_bids,
       count(*) FILTER (WHERE price >= 10000 AND price < 1000000) AS rank2_bids,
       count(*) FILTER (WHERE price >= 1000000) AS rank3_bids,
       count(DISTINCT bidder) AS total_bidders,
       count(DISTINCT bidder) FILTER (WHERE price < 10000) AS rank1_bidders,
       count(DISTINCT bidder) FILTER (WHERE price >= 10000 AND price < 1000000) AS rank2_bidders,
       count(DISTINCT bidder) FILTER (WHERE price >= 1000000) AS rank3_bidders,
       count(DISTINCT auction) AS total_auctions,
       count(DISTINCT auction) FILTER (WHERE price < 10000) AS rank1_auctions,
       count(DISTINCT auction) FILTER (WHERE price >= 10000 AND price < 1000000) AS rank2_auctions,
       count(DISTINCT auction) FILTER (WHERE price >= 1000000) AS rank3_auctions
FROM (SELECT channel, DATE_FORMAT("dateTime", 'yyyy-MM-dd') AS day, DATE_FORMAT("dateTime", 'HH:mm') AS minute,
             bidder, auction, price FROM bid) AS D
GROUP BY channel, day;

CREATE VIEW q17 AS
SELECT auction, day,
       count(*) AS total_bids,
       count(*) FILTER (WHERE price < 10000) AS rank1_bids,
       count(*) FILTER (WHERE price >= 10000 AND price < 1000000) AS rank2_bids,
       count(*) FILTER (WHERE price >= 1000000) AS rank3_bids,
       min(price) AS min_price, max(price) AS max_price, avg(price) AS avg_price, sum(price) AS sum_price
FROM (SELECT auction, DATE_FORMAT("dateTime", 'yyyy-MM-dd') AS day, price FROM bid) AS D
GROUP BY auction, day;

CREATE VIEW q18 AS
SELECT auction, bidder, price, channel, url, "dateTime", extra
FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY bidder, auction
                                   ORDER BY "dateTime" DESC, price, channel, url, extra) AS rank_number
      FROM bid) AS R
WHERE rank_number <= 1;

CREATE VIEW q19 AS
SELECT * EXCLUDE (rank_number)
FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY auction
                                   ORDER BY price DESC, bidder, channel, url, "dateTime", extra) AS rank_number
      FROM bid) AS R
WHERE rank_number <= 10;

CREATE VIEW q20 AS
SELECT B.auction, B.bidder, B.price, B.channel, B.url, B."dateTime" AS "bid_dateTime", B.extra AS bid_extra,
       A."itemName", A.description, A."initialBid", A.reserve, A."dateTime" AS "auction_dateTime", A.expires,
       A.seller, A.category, A.extra AS auction_extra
FROM bid AS B JOIN auction AS A ON B.auction = A.id
WHERE A.category = 10;

CREATE VIEW q21 AS
SELECT auction, bidder, price, channel,
       CASE lower(channel) WHEN 'apple' THEN '0' WHEN 'google' THEN '1' WHEN 'facebook' THEN '2'
            WHEN 'baidu' THEN '3'
            ELSE CASE WHEN regexp_matches(url, '(&|^)channel_id=')
                      THEN regexp_extract(url, '(&|^)channel_id=([^&]*)', 2) END END AS channel_id
FROM bid
WHERE regexp_matches(url, '(&|^)channel_id=') OR lower(channel) IN ('apple', 'google', 'facebook', 'baidu');

CREATE VIEW q22 AS
SELECT auction, bidder, price, channel, split_part(url, '/', 4) AS dir1, split_part(url, '/', 5) AS dir2,
       split_part(url, '/', 6) AS dir3
FROM bid;
