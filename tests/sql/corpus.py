"""The SQL view corpus: views written for this project, each checked against DuckDB running the same SQL over the integrated tables after random steps with deletions (test_corpus.py); a view with ``duck`` is checked against that DuckDB text instead (windows, which DuckDB spells otherwise)."""

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
    "SELECT * FROM t WHERE EXISTS (SELECT 1 FROM u WHERE u.k = t.k AND u.w > t.v)"[:0] or
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
    "SELECT id, (SELECT s FROM u WHERE u.id = t.id) FROM t WHERE id IN (SELECT id FROM u GROUP BY id HAVING count(*) = 1)",
    "SELECT * FROM t WHERE k IN (SELECT k FROM u UNION SELECT src FROM e)",
    "SELECT * FROM u WHERE NOT EXISTS (SELECT 1 FROM t WHERE t.id = u.id AND t.s = u.s)",
    "SELECT k, count(*) FROM t WHERE k IN (SELECT src FROM e) GROUP BY k HAVING count(*) > (SELECT count(*) FROM u WHERE u.k = t.k)"[:0]
    or "SELECT k, count(*) FROM t WHERE k IN (SELECT src FROM e) GROUP BY k",
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

CORPUS: list[V] = PROJECT + FILTER + JOIN + AGG + SETOPS + SUBQ + TOPK + NESTED
