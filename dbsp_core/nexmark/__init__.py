"""Nexmark, the online-auction streaming benchmark: a vectorized event generator (generator.py) and its queries q0-q22 as circuits (queries.py)."""

from dbsp_core.nexmark.generator import AUCTION, BID, PERSON, SCHEMAS, generate, side_input
from dbsp_core.nexmark.queries import NOT_BUILT, NOTES, QUERIES, circuit

__all__ = ["AUCTION", "BID", "PERSON", "SCHEMAS", "generate", "side_input", "NOT_BUILT", "NOTES", "QUERIES",
           "circuit"]
