"""A throwaway PostgreSQL server for the tests: ``initdb`` in a temporary directory (``wal_level=logical``, a few
replication slots), listening on 127.0.0.1 at a free port with its unix socket in that directory, stopped and
removed afterwards.

The binaries are found on PATH, else under ``/usr/lib/postgresql/<version>/bin`` (Debian's ``postgresql``
package), the newest version first. PostgreSQL refuses to run as root: under root the server runs as the
``postgres`` user (created by the package) through ``runuser``; the data directory is made theirs.
:func:`find_bindir` returns None when there is no ``initdb``: the fixture then skips, or fails under
``DBSP_REQUIRE_POSTGRES=1`` (what ``.ci/run`` sets).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile

SERVER_USER = "postgres"  # the OS user that runs the server when the tests run as root


def find_bindir() -> str | None:
    """The directory holding ``initdb`` and ``pg_ctl``, or None."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return os.path.dirname(os.path.realpath(found))
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(d.split("/")[-2].split(".")[0]),
                  reverse=True)
    for d in dirs:
        if os.path.exists(os.path.join(d, "initdb")) and os.path.exists(os.path.join(d, "pg_ctl")):
            return d
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """One running server; :attr:`dsn` connects as superuser ``postgres`` to database ``postgres`` (trust auth,
    on 127.0.0.1 only)."""

    def __init__(self, bindir: str) -> None:
        self.bindir = bindir
        self.root = tempfile.mkdtemp(prefix="dbsp-pg-")
        self.data = os.path.join(self.root, "data")
        self.port = _free_port()
        self._as: list[str] = []
        if os.geteuid() == 0:
            try:
                pw = pwd.getpwnam(SERVER_USER)
            except KeyError:
                raise RuntimeError(f"the tests run as root and PostgreSQL refuses root: create the OS user "
                                   f"{SERVER_USER!r} (Debian's postgresql package does) or run them as another user"
                                   ) from None
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
            self._as = ["runuser", "-u", SERVER_USER, "--"]
        self._run("initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
        with open(os.path.join(self.data, "postgresql.conf"), "a") as f:
            f.write(f"\nlisten_addresses = '127.0.0.1'\nport = {self.port}\nunix_socket_directories = '{self.root}'\n"
                    "wal_level = logical\nmax_replication_slots = 20\nmax_wal_senders = 20\nfsync = on\n"
                    "max_connections = 60\nshared_buffers = 16MB\n")
        self._run("pg_ctl", "-D", self.data, "-l", os.path.join(self.root, "log"), "-w", "-t", "60", "start")
        self.dsn = f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def _run(self, tool: str, *args: str) -> None:
        cmd = self._as + [os.path.join(self.bindir, tool), *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=self.root)  # theirs, as root too
        if r.returncode:
            log = os.path.join(self.root, "log")
            more = open(log).read()[-2000:] if os.path.exists(log) else ""
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stdout}{r.stderr}{more}")

    def database(self, name: str) -> str:
        """A new empty database ``name``; returns its DSN."""
        import psycopg

        with psycopg.connect(self.dsn, autocommit=True) as c:
            c.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = %s",
                      (name,))  # a database with a logical slot cannot be dropped
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            c.execute(f'CREATE DATABASE "{name}"')
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={name}"

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
