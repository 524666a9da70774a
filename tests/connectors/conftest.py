"""Fixtures of the connector tests: one real PostgreSQL server per session (tests/connectors/pg_server.py), and a
fresh database on it per test; a missing server skips those tests, or fails the run under
``DBSP_REQUIRE_POSTGRES=1`` (CI)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pg_server import PostgresServer, find_bindir  # noqa: E402


def _missing() -> str | None:
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install 'dbsp-core[postgres]')"
    if find_bindir() is None:
        return "no PostgreSQL server binaries (initdb) on PATH or under /usr/lib/postgresql/*/bin"
    return None


@pytest.fixture(scope="session")
def pg_server():
    why = _missing()
    if why:
        if os.environ.get("DBSP_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"DBSP_REQUIRE_POSTGRES=1 but the Postgres tests cannot run: {why}")
        pytest.skip(why)
    server = PostgresServer(find_bindir())
    yield server
    server.stop()


@pytest.fixture
def pg_dsn(pg_server, request) -> str:
    """The DSN of a new, empty database on the session's server."""
    name = "t_" + "".join(ch if ch.isalnum() else "_" for ch in request.node.name)[:50].lower()
    return pg_server.database(name)
