"""Nexmark, the online-auction streaming benchmark: a vectorized event generator (generator.py) and its queries q0-q22 as circuits (queries.py) and as SQL views (queries.sql, sql_queries.py)."""

from dbsp_core.nexmark.generator import AUCTION, BID, PERSON, SCHEMAS, generate, side_input
from dbsp_core.nexmark.queries import NOTES, QUERIES, circuit
from dbsp_core.nexmark.sql_queries import sql_circuit, sql_queries

__all__ = ["AUCTION", "BID", "PERSON", "SCHEMAS", "generate", "side_input", "NOTES", "QUERIES",
           "circuit", "sql_circuit", "sql_queries"]
