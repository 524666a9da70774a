"""The SQL view corpus: views written for this project, each checked against DuckDB running the same SQL (test_corpus.py).

An entry with ``duck`` is checked against that DuckDB text instead (windows, which DuckDB spells otherwise).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pyarrow as pa

DDL = """
CREATE TABLE t (id INT, k INT, v BIGINT, s VARCHAR, f DOUBLE, b BOOLEAN, d DATE);
CREATE TABLE u (id INT, k INT, w BIGINT, s VARCHAR);
CREATE TABLE e (src INT, dst INT);
CREATE TABLE ev (k INT, v BIGINT, ts TIMESTAMP(3));
"""
TABLES = {
    "t": pa.schema([("id", pa.int32()), ("k", pa.int32()), ("v", pa.int64()), ("s", pa.string()),
                    ("f", pa.float64()), ("b", pa.bool_()), ("d", pa.date32())]),
    "u": pa.schema([("id", pa.int32()), ("k", pa.int32()), ("w", pa.int64()), ("s", pa.string())]),
    "e": pa.schema([("src", pa.int32()), ("dst", pa.int32())]),
    "ev": pa.schema([("k", pa.int32()), ("v", pa.int64()), ("ts", pa.timestamp("ms"))]),
}
RATES = {"e": (9, 0.04)}  # (most rows changed per step, null rate): a graph of a dozen edges on six nodes


@dataclass
class V:
    """One corpus entry: CREATE VIEW statements (the last one may read the others) and what it covers."""

    sql: str
    duck: str | None = None
    always: bool = False  # in every run's subset

    @property
    def name(self) -> str:
        return re.findall(r"VIEW\s+(\w+)", self.sql, re.I)[-1].lower()


def _views(prefix: str, queries: list[str]) -> list[V]:
    return [V(f"CREATE VIEW {prefix}{i} AS {q};") for i, q in enumerate(queries)]


PROJECT = _views("p", [
    "SELECT * FROM t",
    "SELECT id, v + 1, v - k, v * 2, -v FROM t",
    "SELECT id, v / 2, v // 2, v % 3, f / 2 FROM t",
    "SELECT id, f * 2 + v, f - 0.25 FROM t",
    "SELECT k, s || 'x', concat(s, '-', k) FROM t",
    "SELECT upper(s), lower(s), length(s) FROM t",
    "SELECT substring(s, 1, 1), substring(s, 2), left(s, 1) FROM t",
    "SELECT replace(s, 'b', 'z'), trim(s), strpos(s, 'b') FROM t",
    "SELECT s LIKE 'a%', s LIKE '%b', s NOT LIKE 'd_' FROM t",
    "SELECT s ILIKE 'a%' AS i FROM t",
    "SELECT CASE WHEN v > 3 THEN 'hi' WHEN v > 1 THEN 'mid' ELSE 'lo' END AS band, id FROM t",
    "SELECT CASE k WHEN 1 THEN 'one' WHEN 2 THEN 'two' END AS name FROM t",
    "SELECT CASE WHEN f IS NULL THEN -1 ELSE v END FROM t",
    "SELECT coalesce(v, k, 0), coalesce(s, 'none') FROM t",
    "SELECT nullif(k, 3), nullif(s, '') FROM t",
    "SELECT CAST(v AS DOUBLE) * 0.5, CAST(k AS BIGINT), CAST(f AS INT) FROM t",
    "SELECT CAST(k AS VARCHAR), CAST(v AS VARCHAR) || '!' FROM t",
    "SELECT CAST(b AS INT), CAST(k AS BOOLEAN) FROM t",
    "SELECT abs(f), round(f), floor(f), ceil(f) FROM t",
    "SELECT greatest(k, v), least(k, v, 2) FROM t",
    "SELECT year(d), month(d), day(d), dayofweek(d) FROM t",
    "SELECT EXTRACT(YEAR FROM d), EXTRACT(DOY FROM d) FROM t",
    "SELECT d + INTERVAL 1 DAY AS nd, d FROM t",
    "SELECT ts, hour(ts), minute(ts), second(ts) FROM ev",
    "SELECT date_trunc('minute', ts) AS m, k FROM ev",
    "SELECT ts + INTERVAL 30 SECOND AS later FROM ev",
    "SELECT CAST(ts AS DATE) AS day, v FROM ev",
    "SELECT strftime(ts, '%H:%M') AS hm FROM ev",
    "SELECT id, k BETWEEN 1 AND 3, v NOT BETWEEN 2 AND 4 FROM t",
    "SELECT k IN (1, 2), k IN (1, NULL), k NOT IN (1, NULL) FROM t",
    "SELECT k = v, k <> v, k < v, k >= v FROM t",
    "SELECT k IS NULL, v IS NOT NULL, b IS TRUE, b IS NOT FALSE FROM t",
    "SELECT k IS DISTINCT FROM id, k IS NOT DISTINCT FROM id FROM t",
    "SELECT b AND k > 2, b OR k > 2, NOT b FROM t",
    "SELECT (k > 1) AND (v IS NULL), (k > 1) OR (v IS NULL) FROM t",
    "SELECT 1 AS one, 'lit' AS word, NULL AS nothing FROM t",
    "SELECT id, id FROM t",
    "SELECT t.id AS a, t.k AS b FROM t AS t",
    "SELECT s, sign(v), v * v FROM t",
    "SELECT sqrt(CAST(k AS DOUBLE)), power(k, 2) FROM t",
    "SELECT lpad(s, 3, '*'), rpad(s, 3, '.') FROM t WHERE length(s) <= 3",
    "SELECT starts_with(s, 'a'), split_part(s, 'b', 1) FROM t",
    "SELECT CASE WHEN b THEN 'yes' WHEN NOT b THEN 'no' ELSE 'unknown' END FROM t",
    "SELECT IF(k > 2, 'big', 'small') AS sz FROM t",
])

FILTER = _views("w", [
    "SELECT * FROM t WHERE v > 2",
    "SELECT * FROM t WHERE v > 2 AND s = 'a'",
    "SELECT * FROM t WHERE v > 2 OR s = 'a'",
    "SELECT * FROM t WHERE NOT (v > 2)",
    "SELECT * FROM t WHERE k IS NULL",
    "SELECT * FROM t WHERE k IS NOT NULL AND f < 0",
    "SELECT * FROM t WHERE b",
    "SELECT * FROM t WHERE NOT b",
    "SELECT * FROM t WHERE b IS NOT TRUE",
    "SELECT * FROM t WHERE k IN (1, 3, 5)",
    "SELECT * FROM t WHERE k NOT IN (1, 3)",
    "SELECT * FROM t WHERE k NOT IN (1, NULL)",
    "SELECT * FROM t WHERE s LIKE '%d%' OR s = ''",
    "SELECT * FROM t WHERE coalesce(k, 0) = 0",
    "SELECT * FROM t WHERE f BETWEEN -1 AND 1",
    "SELECT * FROM t WHERE k = v",
    "SELECT * FROM t WHERE k <> v OR k IS NULL",
    "SELECT * FROM t WHERE d >= DATE '2024-02-01'",
    "SELECT * FROM ev WHERE ts < TIMESTAMP '2024-03-01 12:02:00'",
    "SELECT * FROM t WHERE CASE WHEN k > 2 THEN v > 1 ELSE s = 'b' END",
    "SELECT id, v FROM t WHERE v * 2 > k + 3",
    "SELECT * FROM t WHERE (k > 1 AND v < 3) OR (f IS NULL AND NOT b)",
])

JOIN = _views("j", [
    "SELECT t.id, t.v, u.w FROM t JOIN u ON t.id = u.id",
    "SELECT t.id, u.w FROM t JOIN u ON t.id = u.id AND t.k = u.k",
    "SELECT t.id, u.w FROM t JOIN u ON t.id = u.id AND t.v < u.w",
    "SELECT t.id, u.w FROM t, u WHERE t.id = u.id AND u.w > 2",
    "SELECT t.id, u.id FROM t CROSS JOIN u WHERE t.k < u.k",
    "SELECT t.id, u.w FROM t JOIN u ON t.v < u.w",
    "SELECT t.id, t.s, u.s FROM t LEFT JOIN u ON t.id = u.id",
    "SELECT t.id, u.w FROM t LEFT JOIN u ON t.id = u.id AND u.w > 2",
    "SELECT t.id, u.w FROM t LEFT JOIN u ON t.id = u.id AND t.v < u.w",
    "SELECT t.id, u.w FROM t RIGHT JOIN u ON t.id = u.id",
    "SELECT t.k, u.k, u.w FROM t RIGHT JOIN u ON t.k = u.k AND t.v <> u.w",
    "SELECT t.id, u.id, t.v, u.w FROM t FULL JOIN u ON t.id = u.id",
    "SELECT t.id, u.id FROM t FULL JOIN u ON t.id = u.id AND t.s = u.s",
    "SELECT t.id, u.id FROM t FULL OUTER JOIN u ON t.k = u.k AND t.v > u.w",
    "SELECT * FROM t JOIN u USING (id)",
    "SELECT id, t.k, u.k FROM t LEFT JOIN u USING (id)",
    "SELECT id, t.v, u.w FROM t FULL JOIN u USING (id)",
    "SELECT id, k, v, w FROM t JOIN u USING (id, k)",
    "SELECT a.id, b.id FROM t a JOIN t b ON a.k = b.id",
    "SELECT a.id, b.v FROM t a JOIN t b ON a.id = b.id AND a.v < b.v",
    "SELECT t.id, u.w, e.dst FROM t JOIN u ON t.id = u.id JOIN e ON u.k = e.src",
    "SELECT t.id, u.w, e.dst FROM t LEFT JOIN u ON t.id = u.id LEFT JOIN e ON t.k = e.src",
    "SELECT t.s, u.s FROM t JOIN u ON t.s = u.s",
    "SELECT t.id, u.id FROM t JOIN u ON t.v = u.k",
    "SELECT t.id, u.id FROM t JOIN u ON t.f = u.w",
    "SELECT t.id, u.w FROM t JOIN u ON t.k + 1 = u.k",
    "SELECT t.id, u.w FROM t JOIN u ON upper(t.s) = upper(u.s)",
    "SELECT t.id, u.w FROM t LEFT JOIN u ON t.id = u.id WHERE u.w IS NULL",
    "SELECT t.id, x.c FROM t JOIN (SELECT k, count(*) AS c FROM u GROUP BY k) x ON t.k = x.k",
    "SELECT t.id, u.w FROM t LEFT JOIN u ON t.k < u.k",
    "SELECT t.id, u.id FROM t FULL JOIN u ON t.k > u.k",
])

AGG = _views("g", [
    "SELECT k, count(*) FROM t GROUP BY k",
    "SELECT k, count(*), count(v), sum(v), min(v), max(v), avg(v) FROM t GROUP BY k",
    "SELECT k, sum(f), avg(f), min(f), max(f) FROM t GROUP BY k",
    "SELECT s, min(d), max(d), min(s) FROM t GROUP BY s",
    "SELECT k, s, count(*) FROM t GROUP BY k, s",
    "SELECT k % 2 AS parity, count(*) FROM t GROUP BY k % 2",
    "SELECT upper(s) AS us, sum(v) FROM t GROUP BY upper(s)",
    "SELECT k, count(*) FROM t GROUP BY 1",
    "SELECT k AS kk, count(*) FROM t GROUP BY kk",
    "SELECT count(*) FROM t",
    "SELECT count(*), sum(v), min(s), max(f), avg(v) FROM t",
    "SELECT count(*) FROM t WHERE v > 100",
    "SELECT sum(v) FROM t WHERE v > 100",
    "SELECT k, count(*) FROM t GROUP BY k HAVING count(*) > 1",
    "SELECT k, sum(v) AS sv FROM t GROUP BY k HAVING sum(v) > 3 OR k IS NULL",
    "SELECT k, max(v) - min(v) AS spread FROM t GROUP BY k",
    "SELECT k, count(DISTINCT s) FROM t GROUP BY k",
    "SELECT count(DISTINCT k), count(DISTINCT s) FROM t",
    "SELECT k, count(DISTINCT s), sum(v) FROM t GROUP BY k",
    "SELECT k, count(DISTINCT s), max(f) FROM t GROUP BY k",
    "SELECT k, sum(DISTINCT v), avg(DISTINCT v) FROM t GROUP BY k",
    "SELECT sum(DISTINCT v), count(*) FROM t",
    "SELECT k, count(*) FILTER (WHERE v > 2), sum(v) FILTER (WHERE s = 'a') FROM t GROUP BY k",
    "SELECT count(*) FILTER (WHERE b), count(DISTINCT s) FILTER (WHERE v > 1) FROM t",
    "SELECT DISTINCT k FROM t",
    "SELECT DISTINCT k, s FROM t",
    "SELECT DISTINCT s FROM t WHERE v > 1",
    "SELECT k, s FROM t GROUP BY k, s",
    "SELECT b, count(*), sum(CASE WHEN v > 2 THEN 1 ELSE 0 END) FROM t GROUP BY b",
    "SELECT d, count(*) FROM t GROUP BY d",
    "SELECT k, count(*) * 2 + 1 AS x, coalesce(sum(v), 0) AS y FROM t GROUP BY k",
    "SELECT k, avg(v) FROM t GROUP BY k HAVING avg(v) > 2",
    "SELECT c, count(*) FROM (SELECT k, count(*) AS c FROM t GROUP BY k) x GROUP BY c",
    "SELECT count(*) FROM (SELECT DISTINCT k FROM t) x",
    "SELECT k FROM t GROUP BY k HAVING min(v) = max(v)",
    "SELECT s, count(*) FROM t WHERE s IS NOT NULL GROUP BY s HAVING count(DISTINCT k) > 1",
    "SELECT year(d), month(d), count(*) FROM t GROUP BY year(d), month(d)",
])

SETOPS = _views("o", [
    "SELECT k FROM t UNION ALL SELECT k FROM u",
    "SELECT k FROM t UNION SELECT k FROM u",
    "SELECT k, s FROM t UNION SELECT k, s FROM u",
    "SELECT k FROM t EXCEPT SELECT k FROM u",
    "SELECT k FROM t INTERSECT SELECT k FROM u",
    "SELECT k, s FROM t INTERSECT SELECT k, s FROM u",
    "SELECT s FROM t EXCEPT SELECT s FROM u",
    "SELECT v FROM t UNION ALL SELECT w FROM u UNION ALL SELECT 7",
    "SELECT k FROM t UNION SELECT src FROM e EXCEPT SELECT k FROM u",
    "SELECT id, v FROM t UNION ALL SELECT id, f FROM t",
    "SELECT k, count(*) FROM (SELECT k FROM t UNION ALL SELECT k FROM u) x GROUP BY k",
    "SELECT s FROM t WHERE v > 2 UNION SELECT s FROM t WHERE k = 1",
])

SUBQ = _views("q", [
    "SELECT * FROM t WHERE k IN (SELECT k FROM u)",
    "SELECT * FROM t WHERE k NOT IN (SELECT k FROM u)",
    "SELECT * FROM t WHERE k NOT IN (SELECT k FROM u WHERE k IS NOT NULL)",
    "SELECT * FROM t WHERE k IN (SELECT k FROM u WHERE w > 2)",
    "SELECT * FROM t WHERE EXISTS (SELECT 1 FROM u WHERE u.k = t.k)",
    "SELECT * FROM t WHERE NOT EXISTS (SELECT 1 FROM u WHERE u.k = t.k)",
    "SELECT * FROM t WHERE EXISTS (SELECT 1 FROM u WHERE u.k = t.k AND u.w > 2)",
    "SELECT * FROM t WHERE EXISTS (SELECT 1 FROM u WHERE u.w > 4)",
    "SELECT * FROM t WHERE NOT EXISTS (SELECT 1 FROM u WHERE u.w > 4)",
    "SELECT id, k IN (SELECT k FROM u) AS m FROM t",
    "SELECT id, k NOT IN (SELECT k FROM u) AS m FROM t",
    "SELECT id, EXISTS (SELECT 1 FROM u WHERE u.id = t.id) AS m FROM t",
    "SELECT * FROM t WHERE k IN (SELECT k FROM u) OR v > 3",
    "SELECT * FROM t WHERE NOT (k IN (SELECT k FROM u WHERE w > 1))",
    "SELECT * FROM t WHERE k IN (SELECT k FROM u WHERE u.s = t.s)",
    "SELECT * FROM t WHERE k NOT IN (SELECT k FROM u WHERE u.s = t.s)",
    "SELECT id, (SELECT max(w) FROM u) AS m FROM t",
    "SELECT id, (SELECT count(*) FROM u WHERE u.k = t.k) AS n FROM t",
    "SELECT id, (SELECT sum(w) FROM u WHERE u.k = t.k) AS n FROM t",
    "SELECT id, (SELECT count(*) + 1 FROM u WHERE u.id = t.id) AS n FROM t",
    "SELECT id FROM t WHERE v > (SELECT avg(w) FROM u)",
    "SELECT id FROM t WHERE v = (SELECT max(v) FROM t)",
    "SELECT id FROM t WHERE v >= (SELECT max(w) FROM u WHERE u.k = t.k)",
    "SELECT x.k, x.n FROM (SELECT k, count(*) AS n FROM t GROUP BY k) AS x WHERE x.n > 1",
    "SELECT * FROM (SELECT id, v * 2 AS vv FROM t) s WHERE vv > 4",
    "SELECT a, b FROM (SELECT k, v FROM t) AS x(a, b)",
    "WITH big AS (SELECT * FROM t WHERE v > 2) SELECT k, count(*) FROM big GROUP BY k",
    "WITH a AS (SELECT k FROM t), b AS (SELECT k FROM a WHERE k > 1) SELECT * FROM b",
    "WITH c AS (SELECT k, count(*) AS n FROM t GROUP BY k) SELECT c1.k, c2.n FROM c c1 JOIN c c2 ON c1.k = c2.k",
    "SELECT k, (SELECT count(*) FROM u) AS total FROM t GROUP BY k",
    "SELECT id, (SELECT s FROM u WHERE u.id = t.id) FROM t "
    "WHERE id IN (SELECT id FROM u GROUP BY id HAVING count(*) = 1)",
    "SELECT * FROM t WHERE k IN (SELECT k FROM u UNION SELECT src FROM e)",
    "SELECT * FROM u WHERE NOT EXISTS (SELECT 1 FROM t WHERE t.id = u.id AND t.s = u.s)",
    "SELECT k, count(*) FROM t WHERE k IN (SELECT src FROM e) GROUP BY k",
])

TOPK = _views("k", [
    "SELECT id, v FROM t ORDER BY v DESC, id LIMIT 3",
    "SELECT k, v, s, id, f, b, d FROM t ORDER BY k, v, s, id, f, b, d LIMIT 4",
    "SELECT k, count(*) AS n FROM t GROUP BY k ORDER BY n DESC, k LIMIT 2",
    "SELECT * FROM (SELECT k, v FROM t ORDER BY v, k LIMIT 5) x WHERE k > 1",
    "SELECT s, sum(v) AS total FROM t GROUP BY s ORDER BY total DESC, s LIMIT 1",
    "SELECT DISTINCT k FROM t ORDER BY k LIMIT 3",
    "SELECT k FROM t UNION SELECT k FROM u ORDER BY k DESC LIMIT 2",
    "SELECT src, dst FROM e ORDER BY dst, src LIMIT 1",
])

NESTED = [
    V("CREATE VIEW n0a AS SELECT k, v FROM t WHERE v > 1; CREATE VIEW n0 AS SELECT k, sum(v) FROM n0a GROUP BY k;"),
    V("CREATE VIEW n1a AS SELECT t.id, u.w FROM t JOIN u ON t.id = u.id; "
      "CREATE VIEW n1 AS SELECT id, count(*) FROM n1a GROUP BY id;"),
    V("CREATE VIEW n2a AS SELECT k, count(*) AS c FROM t GROUP BY k; "
      "CREATE VIEW n2 AS SELECT n2a.k, n2a.c, u.w FROM n2a JOIN u ON n2a.k = u.k;"),
    V("CREATE VIEW n3a AS SELECT DISTINCT s FROM t; CREATE VIEW n3b AS SELECT DISTINCT s FROM u; "
      "CREATE VIEW n3 AS SELECT * FROM n3a EXCEPT SELECT * FROM n3b;"),
    V("CREATE MATERIALIZED VIEW n4a AS SELECT k, max(v) AS m FROM t GROUP BY k; "
      "CREATE VIEW n4 AS SELECT t.* FROM t JOIN n4a ON t.k = n4a.k AND t.v = n4a.m;"),
    V("CREATE VIEW n5a AS SELECT src, dst FROM e WHERE src <> dst; "
      "CREATE VIEW n5 AS SELECT a.src, b.dst FROM n5a a JOIN n5a b ON a.dst = b.src;"),
]

RANKED = _views("r", [
    "SELECT id, k, v FROM (SELECT id, k, v, ROW_NUMBER() OVER (PARTITION BY k ORDER BY v DESC, id) AS rn FROM t) "
    "WHERE rn <= 2",
    "SELECT * EXCLUDE (rn) FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY s ORDER BY id, k, v, f, b, d) AS rn "
    "FROM t) WHERE rn = 1",
    "SELECT k, v FROM (SELECT k, v, RANK() OVER (PARTITION BY k ORDER BY v) AS r FROM t) x WHERE r <= 1",
    "SELECT src, dst FROM (SELECT src, dst, ROW_NUMBER() OVER (ORDER BY src DESC, dst DESC) AS n FROM e) WHERE n < 3",
    "SELECT id, w FROM (SELECT id, w, s, ROW_NUMBER() OVER (PARTITION BY id ORDER BY w DESC, s) AS rn FROM u) x "
    "WHERE rn <= 1",
    "SELECT k, n FROM (SELECT k, n, ROW_NUMBER() OVER (ORDER BY n DESC, k) AS p FROM "
    "(SELECT k, count(*) AS n FROM t GROUP BY k) c) WHERE p <= 2",
])

MIN_MS = 60_000


def _tumble(size_ms: int) -> str:
    return f"epoch_ms(CAST(floor(epoch_ms(ts) / {size_ms}) AS BIGINT) * {size_ms})"


WINDOWS = [
    V("CREATE VIEW win0 AS SELECT window_start, window_end, count(*) AS n FROM TABLE(TUMBLE(TABLE ev, "
      "DESCRIPTOR(ts), INTERVAL '1' MINUTE)) GROUP BY window_start, window_end;",
      f"CREATE VIEW win0 AS SELECT {_tumble(MIN_MS)} AS ws, {_tumble(MIN_MS)} + INTERVAL 1 MINUTE, count(*) FROM ev "
      f"WHERE ts IS NOT NULL GROUP BY ALL;"),
    V("CREATE VIEW win1 AS SELECT k, window_start, sum(v) AS total, max(v) FROM TUMBLE(ev, DESCRIPTOR(ts), "
      "INTERVAL '30' SECONDS) GROUP BY k, window_start;",
      f"CREATE VIEW win1 AS SELECT k, {_tumble(30_000)} AS ws, sum(v), max(v) FROM ev WHERE ts IS NOT NULL "
      f"GROUP BY ALL;"),
    V("CREATE VIEW win2 AS SELECT k, v, ts, window_start FROM TABLE(TUMBLE(TABLE ev, DESCRIPTOR(ts), "
      "INTERVAL '2' MINUTES)) w WHERE w.v > 1;",
      f"CREATE VIEW win2 AS SELECT k, v, ts, {_tumble(120_000)} FROM ev WHERE ts IS NOT NULL AND v > 1;"),
    V("CREATE VIEW win3 AS SELECT window_start, count(*) AS n, count(DISTINCT k) FROM TABLE(HOP(TABLE ev, "
      "DESCRIPTOR(ts), INTERVAL '30' SECOND, INTERVAL '1' MINUTE)) GROUP BY window_start;",
      "CREATE VIEW win3 AS SELECT epoch_ms((CAST(floor(epoch_ms(ts) / 30000) AS BIGINT) - i) * 30000) AS ws, "
      "count(*), count(DISTINCT k) FROM ev, range(2) r(i) WHERE ts IS NOT NULL GROUP BY ws;"),
    V("CREATE VIEW win4 AS SELECT window_start, window_end, k, avg(v) FROM TABLE(HOP(TABLE ev, DESCRIPTOR(ts), "
      "INTERVAL '1' MINUTE, INTERVAL '3' MINUTE)) GROUP BY window_start, window_end, k;",
      "CREATE VIEW win4 AS SELECT epoch_ms((CAST(floor(epoch_ms(ts) / 60000) AS BIGINT) - i) * 60000) AS ws, "
      "epoch_ms((CAST(floor(epoch_ms(ts) / 60000) AS BIGINT) - i) * 60000 + 180000), k, avg(v) FROM ev, "
      "range(3) r(i) WHERE ts IS NOT NULL GROUP BY ALL;"),
    V("CREATE VIEW win5 AS SELECT a.window_start, a.k, a.n, b.n FROM (SELECT window_start, k, count(*) AS n FROM "
      "TABLE(TUMBLE(TABLE ev, DESCRIPTOR(ts), INTERVAL '1' MINUTE)) GROUP BY window_start, k) a JOIN "
      "(SELECT window_start, count(*) AS n FROM TABLE(TUMBLE(TABLE ev, DESCRIPTOR(ts), INTERVAL '1' MINUTE)) "
      "GROUP BY window_start) b ON a.window_start = b.window_start;",
      f"CREATE VIEW win5 AS SELECT a.ws, a.k, a.n, b.n FROM (SELECT {_tumble(MIN_MS)} AS ws, k, count(*) AS n FROM ev "
      f"WHERE ts IS NOT NULL GROUP BY ALL) a JOIN (SELECT {_tumble(MIN_MS)} AS ws, count(*) AS n FROM ev WHERE ts IS "
      f"NOT NULL GROUP BY ALL) b ON a.ws = b.ws;"),
    V("CREATE VIEW win6 AS SELECT window_start, k, v FROM (SELECT window_start, k, v, ROW_NUMBER() OVER (PARTITION BY "
      "window_start ORDER BY v DESC, k) AS rn FROM TABLE(TUMBLE(TABLE ev, DESCRIPTOR(ts), INTERVAL '1' MINUTE))) "
      "WHERE rn <= 2;",
      f"CREATE VIEW win6 AS SELECT ws, k, v FROM (SELECT {_tumble(MIN_MS)} AS ws, k, v, ts, ROW_NUMBER() OVER "
      f"(PARTITION BY {_tumble(MIN_MS)} ORDER BY v DESC NULLS LAST, k NULLS LAST, ts) AS rn FROM ev WHERE ts IS "
      f"NOT NULL) WHERE rn <= 2;"),
    V("CREATE VIEW win7 AS SELECT window_start, window_end, count(*) FROM TABLE(TUMBLE(TABLE t, DESCRIPTOR(v), 2)) "
      "GROUP BY window_start, window_end;",
      "CREATE VIEW win7 AS SELECT (v // 2) * 2, (v // 2) * 2 + 2, count(*) FROM t WHERE v IS NOT NULL GROUP BY ALL;"),
]

CLOSURE = "WITH RECURSIVE r(a, b) AS (SELECT src, dst FROM e UNION SELECT r.a, e.dst FROM r JOIN e ON r.b = e.src) "
RECURSIVE = _views("rec", [
    CLOSURE + "SELECT * FROM r",
    CLOSURE + "SELECT b FROM r WHERE a = 0",
    CLOSURE + "SELECT a, count(*) FROM r GROUP BY a",
    CLOSURE + "SELECT a FROM r WHERE a = b",
    "WITH RECURSIVE r(a, b) AS (SELECT src, dst FROM e WHERE src = 1 UNION SELECT r.a, e.dst FROM r, e "
    "WHERE r.b = e.src) SELECT * FROM r",
    "WITH RECURSIVE r(n) AS (SELECT src FROM e WHERE src = 0 UNION SELECT e.dst FROM r JOIN e ON e.src = r.n) "
    "SELECT * FROM r",
    "WITH RECURSIVE u2(a, b) AS (SELECT src, dst FROM e UNION ALL SELECT dst, src FROM e), "
    "r(a, b) AS (SELECT a, b FROM u2 UNION SELECT r.a, u2.b FROM r JOIN u2 ON r.b = u2.a) "
    "SELECT a, min(b) AS comp FROM r GROUP BY a",
    "WITH RECURSIVE r(a, b, n) AS (SELECT src, dst, 1 FROM e UNION ALL SELECT r.a, e.dst, r.n + 1 FROM r JOIN e "
    "ON r.b = e.src WHERE r.n < 3) SELECT * FROM r",
    "WITH RECURSIVE r(a, b) AS (SELECT src, dst FROM e WHERE src < dst UNION ALL SELECT r.a, e.dst FROM r JOIN e "
    "ON r.b = e.src WHERE e.src < e.dst) SELECT a, b, count(*) FROM r GROUP BY a, b",
    "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n WHERE x < 5) SELECT * FROM n",
    "WITH RECURSIVE n(x) AS (SELECT k FROM t WHERE k IS NOT NULL UNION SELECT x - 1 FROM n WHERE x > 0) "
    "SELECT * FROM n",
    "WITH RECURSIVE c(id, k) AS (SELECT id, k FROM t UNION SELECT c.id, t.k FROM c JOIN t ON c.k = t.id) "
    "SELECT * FROM c",
    CLOSURE + "SELECT r.a, r.b, u.w FROM r JOIN u ON r.b = u.id",
    "WITH RECURSIVE r(a, b) AS (SELECT src, dst FROM e UNION SELECT r.a, e.dst FROM r JOIN e ON r.b = e.src), "
    "s(a, b) AS (SELECT b, a FROM r UNION SELECT s.a, r.b FROM s JOIN r ON s.b = r.a) SELECT * FROM s",
    "WITH RECURSIVE r(a, b) AS (SELECT src, dst FROM e WHERE src <> dst UNION SELECT r.a, e.dst FROM r JOIN e "
    "ON r.b = e.src AND e.src <> e.dst) SELECT a, b FROM r EXCEPT SELECT src, dst FROM e",
    "WITH RECURSIVE r(a, b) AS (SELECT src, dst FROM e UNION SELECT e.src, r.b FROM e JOIN r ON e.dst = r.a) "
    "SELECT * FROM r",
    "WITH RECURSIVE r(a, d) AS (SELECT DISTINCT src, 0 FROM e WHERE src IS NOT NULL UNION SELECT e.dst, r.d + 1 "
    "FROM r JOIN e ON r.a = e.src WHERE r.d < 3) SELECT a, min(d) FROM r GROUP BY a",
])

MORE = _views("m", [
    "SELECT * FROM (VALUES (1, 'one'), (2, 'two'), (NULL, 'none')) AS x(n, w)",
    "SELECT t.id, x.w FROM t JOIN (VALUES (1, 'one'), (2, 'two')) AS x(n, w) ON t.k = x.n",
    "SELECT k, sum(v) FILTER (WHERE v > 1) AS s1, count(v) FILTER (WHERE s IS NULL) FROM t GROUP BY k",
    "SELECT count(k), count(*) - count(k) AS nulls FROM t",
    "SELECT k, min(s), max(s) FROM t GROUP BY k HAVING min(s) IS NOT NULL",
    "SELECT avg(f) FROM t WHERE f IS NOT NULL",
    "SELECT k, v FROM t WHERE v IS NOT NULL AND NOT EXISTS (SELECT 1 FROM u WHERE u.k = t.k AND u.w = t.v)",
    "SELECT s, count(*) FROM (SELECT s FROM t UNION ALL SELECT s FROM u) x GROUP BY s",
    "SELECT DISTINCT t.k FROM t JOIN u ON t.k = u.k WHERE t.v > u.w",
    "SELECT k, count(*) FROM t GROUP BY k HAVING k IN (SELECT k FROM u)",
    "SELECT t.k, count(u.id) FROM t LEFT JOIN u ON t.k = u.k GROUP BY t.k",
    "SELECT u.k, sum(t.v) FROM t RIGHT JOIN u ON t.k = u.k GROUP BY u.k",
    "SELECT coalesce(t.k, u.k) AS key, count(*) FROM t FULL JOIN u ON t.k = u.k GROUP BY coalesce(t.k, u.k)",
    "SELECT id, v FROM t WHERE s IN (SELECT s FROM u WHERE u.w > 1) AND k NOT IN (SELECT src FROM e "
    "WHERE src IS NOT NULL)",
    "SELECT id, CASE WHEN k IN (SELECT k FROM u) THEN 'both' ELSE 'only' END AS where_ FROM t",
    "SELECT k FROM t WHERE k IS NOT NULL EXCEPT SELECT k FROM u WHERE k IS NOT NULL",
    "SELECT CAST(d AS TIMESTAMP) AS dt, CAST(d AS VARCHAR) AS ds FROM t",
    "SELECT k, count(*) FROM t WHERE s LIKE 'A%' OR s ILIKE 'a%' GROUP BY k",
    "SELECT f // 2, f % 0.75, -v % 4, k // 2 FROM t",
    "SELECT d, d - INTERVAL 3 DAY AS before, d > DATE '2024-02-15' AS late FROM t",
    "SELECT id FROM t WHERE k IS NOT NULL AND v IS NOT NULL AND greatest(k, v) > 3",
])

CORPUS: list[V] = (PROJECT + FILTER + JOIN + AGG + SETOPS + SUBQ + TOPK + NESTED + RANKED + WINDOWS + RECURSIVE
                   + MORE)
