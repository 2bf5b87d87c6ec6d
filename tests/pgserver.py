"""A real PostgreSQL server of the test suite's own (Debian's ``postgresql`` 15, installed
with apt when missing, like the other test-only services).

``initdb`` into a fresh directory under /tmp, run as the ``postgres`` system user that the
Debian package creates (PostgreSQL refuses to run as root; no user is created here),
listening on a unix socket in that directory and on 127.0.0.1 at a free port, with
``trust`` authentication for local connections only and durability off (``fsync=off``:
a test server's data is thrown away). :meth:`PgServer.close` stops it (immediate mode)
and removes the directory.

One server is shared by the whole session (:func:`shared_server`, stopped by the
``pg_session`` fixture of ``tests/conftest.py``); each user gets its own store
(:meth:`PgServer.database_for`: one per key, e.g. per daemon state directory, created on
first use: a schema in a database the keys share), so tests never see each other's rows.
Tests that stop or restart the server start one of their own (:class:`PgServer` directly).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import psycopg

from tests.leases import free_port

PG_BIN = Path("/usr/lib/postgresql/15/bin")
PACKAGE = "postgresql"
#: The superuser initdb makes (trust on local connections only).
USER = "postgres"


def ensure_postgresql() -> Path:
    """The PostgreSQL 15 binaries, installed with apt first if they are not there."""
    if os.access(PG_BIN / "postgres", os.X_OK):
        return PG_BIN
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    apt = ["apt-get", "install", "-y", "-q", "--no-install-recommends", PACKAGE]
    if subprocess.run(apt, env=env, stdout=subprocess.DEVNULL, check=False).returncode != 0:
        # The package lists may be missing or stale on a fresh machine.
        subprocess.run(["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL, check=True)
        subprocess.run(apt, env=env, stdout=subprocess.DEVNULL, check=True)
    assert os.access(PG_BIN / "postgres", os.X_OK), f"{PACKAGE} installed but no {PG_BIN}"
    return PG_BIN


class PgServer:
    """One PostgreSQL cluster in its own temporary directory (see the module docstring)."""

    def __init__(self) -> None:
        self.bin = ensure_postgresql()
        self.root = Path(tempfile.mkdtemp(prefix="hutch-pg-"))
        self.data = self.root / "data"
        self.socket_dir = self.root  # .s.PGSQL.<port> lives here
        self.log = self.root / "server.log"
        self.port = free_port()
        self._as_postgres = os.geteuid() == 0
        self._databases: dict[str, str] = {}
        self._keyed_database: str | None = None
        self._lock = threading.Lock()
        self._running = False
        if self._as_postgres:
            shutil.chown(self.root, USER, USER)
        try:
            self._run(
                "initdb", "-D", str(self.data), "-U", USER, "--auth=trust", "--no-locale",
                "-E", "UTF8", "--no-sync", "--no-instructions",
            )  # fmt: skip
            self.start()
        except BaseException:
            self.close()
            raise

    def _run(self, tool: str, *args: str) -> None:
        argv = [str(self.bin / tool), *args]
        if self._as_postgres:
            argv = ["runuser", "-u", USER, "--", *argv]
        done = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=self.root)
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""
            raise RuntimeError(
                f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout}{done.stderr}\n{log}"
            )

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.socket_dir} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
            "-c max_connections=400 -c shared_buffers=32MB"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-o", options, "start")
        self._running = True

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: sessions are terminated, as at a server restart)."""
        if self._running:
            self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")
            self._running = False

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop it and remove its directory (safe to call twice)."""
        with contextlib.suppress(Exception):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    # -- addresses and databases --------------------------------------------------------

    def url(self, dbname: str = "postgres") -> str:
        """Over TCP on loopback."""
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{dbname}"

    def socket_url(self, dbname: str = "postgres") -> str:
        """Over the unix socket in the server's directory."""
        return f"postgresql://{USER}@/{dbname}?host={self.socket_dir}&port={self.port}"

    def admin(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(self.socket_url(), autocommit=True)

    def create_database(self, name: str) -> str:
        with self.admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}"'.encode())
        return self.socket_url(name)

    def database_for(self, key: str) -> str:
        """The URL of the store of ``key``: a schema of its own (created empty on first
        use) in one database that every key shares, chosen by the URL's ``search_path``.
        hutch's SQL names no schema, so each key sees only its own tables. A database per
        key cost 0.2 s to create (a copy of the 7.5 MiB template) and the server's
        directory grew by that much: the component tier's ~500 took minutes to make and
        a minute to remove."""
        with self._lock:
            url = self._databases.get(key)
            if url is None:
                if self._keyed_database is None:
                    self._keyed_database = self.create_database("t_keyed")
                schema = "t_" + hashlib.sha256(key.encode()).hexdigest()[:20]
                with psycopg.connect(self._keyed_database, autocommit=True) as conn:
                    conn.execute(f'CREATE SCHEMA "{schema}"'.encode())
                url = self._databases[key] = (
                    f"{self._keyed_database}&options=-csearch_path%3D{schema}"
                )
            return url

    def fresh_database(self) -> str:
        """A new empty database."""
        with self._lock:
            name = f"t_{len(self._databases)}_{os.urandom(4).hex()}"
            url = self._databases[name] = self.create_database(name)
            return url


_shared: PgServer | None = None
_shared_lock = threading.Lock()


def shared_server() -> PgServer:
    """The session's server, started on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = PgServer()
        return _shared


def close_shared_server() -> None:
    global _shared
    with _shared_lock:
        if _shared is not None:
            _shared.close()
            _shared = None


#: ``HUTCH_TEST_DATABASE=postgres``: the daemons and stores of the component and e2e
#: tiers keep their state on the shared server (one database per state directory).
def test_database() -> str:
    value = os.environ.get("HUTCH_TEST_DATABASE", "sqlite").strip().lower() or "sqlite"
    if value not in ("sqlite", "postgres"):
        raise RuntimeError(f"HUTCH_TEST_DATABASE={value!r}; accepted: sqlite, postgres")
    return value


test_database.__test__ = False  # type: ignore[attr-defined]


def database_url_for(state_dir: Path) -> str | None:
    """The ``HUTCH_DATABASE_URL`` a daemon with ``state_dir`` gets in this run (None:
    SQLite, the default)."""
    if test_database() != "postgres":
        return None
    return shared_server().database_for(str(state_dir.resolve()))
