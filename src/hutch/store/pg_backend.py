"""The PostgreSQL backend (psycopg 3 on Debian's libpq): one connection per Store in
autocommit mode, each transaction an explicit ``BEGIN`` (``READ COMMITTED``) ... ``COMMIT``.

A lost connection (server restarted, network cut, backend terminated) is noticed by the
driver marking it broken: the statement's error becomes ``ConnectionLost``, and the next
call opens a new connection. Nothing is retried inside a transaction: its writes were
rolled back by the server with the connection (or, if the commit itself was cut, may have
committed: the caller's error says so).
"""

from __future__ import annotations

import contextlib
import functools
import re
import weakref
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import psycopg.conninfo

from hutch.errors import StoreError
from hutch.store.backend import ConnectionLost, Cursor, Dialect, IntegrityViolation, to_param

__all__ = ["PostgresBackend", "redact", "to_pyformat"]

DIALECT = Dialect(
    name="postgresql", for_update=" FOR UPDATE", skip_locked=" FOR UPDATE SKIP LOCKED"
)

#: pg_advisory_xact_lock key of the schema migrations (hutchd processes starting at once
#: on one database apply each migration once, in order). "hutch" in ASCII.
SCHEMA_LOCK = 0x6875746368


def redact(url: str) -> str:
    """``url`` without its password (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = (parts.username or "") + ":***"
    return urlunsplit(parts._replace(netloc=f"{user}@{netloc[-1]}"))


@functools.lru_cache(maxsize=1024)
def to_pyformat(sql: str) -> str:
    """``?`` placeholders (outside quoted literals and names) as psycopg's ``%s``, and
    every literal ``%`` doubled (psycopg reads ``%`` anywhere in a query with
    parameters)."""
    out: list[str] = []
    quote: str | None = None
    for ch in sql:
        if ch == "%":
            out.append("%%")
        elif quote is not None:
            out.append(ch)
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
            out.append(ch)
        elif ch == "?":
            out.append("%s")
        else:
            out.append(ch)
    return "".join(out)


class PgCursor:
    """psycopg's cursor, but a statement without rows (INSERT, DELETE) reads as none, as
    sqlite3's does (psycopg raises there)."""

    def __init__(self, cur: psycopg.Cursor[Any]) -> None:
        self._cur = cur

    @property
    def rowcount(self) -> int:
        return self._cur.rowcount

    def fetchone(self) -> Any:
        return None if self._cur.description is None else self._cur.fetchone()

    def fetchall(self) -> list[Any]:
        return [] if self._cur.description is None else self._cur.fetchall()

    def __iter__(self) -> Iterator[Any]:
        return iter(self.fetchall())


class PgConn:
    dialect = DIALECT

    def __init__(self, pg: psycopg.Connection[Any]) -> None:
        self.pg = pg

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor:
        if not params:
            return PgCursor(self.pg.execute(sql.encode()))
        return PgCursor(self.pg.execute(to_pyformat(sql).encode(), [to_param(p) for p in params]))


_SPACE = re.compile(r"\s+")


def _close_quietly(pg: psycopg.Connection[Any]) -> None:
    with contextlib.suppress(psycopg.Error):
        pg.close()


class PostgresBackend:
    dialect = DIALECT

    def __init__(self, url: str, connect_timeout_s: int = 10) -> None:
        self.url = url
        self.display = redact(url)
        try:
            psycopg.conninfo.conninfo_to_dict(url)
        except psycopg.ProgrammingError as exc:
            raise StoreError(f"HUTCH_DATABASE_URL={self.display!r} is not valid: {exc}") from exc
        self._timeout = connect_timeout_s
        self._conn: PgConn | None = None
        self._closer: weakref.finalize[Any, Any] | None = None
        try:
            self.conn()  # a wrong address or database fails the start, not the first call
        except ConnectionLost as exc:
            raise StoreError(str(exc)) from exc

    def conn(self) -> PgConn:
        current = self._conn
        if current is not None and not current.pg.closed and not current.pg.broken:
            return current
        self._drop()
        try:
            pg = psycopg.connect(
                self.url,
                autocommit=True,
                connect_timeout=self._timeout,
                application_name="hutchd",
            )
        except psycopg.Error as exc:
            reason = _SPACE.sub(" ", str(exc)).strip()
            raise ConnectionLost(
                f"cannot connect to the PostgreSQL database {self.display}: {reason}"
            ) from exc
        self._conn = PgConn(pg)
        # A Store dropped without close() (tests, a failed start) closes its connection
        # when it is collected, rather than leaving it to the driver's warning.
        self._closer = weakref.finalize(self, _close_quietly, pg)
        return self._conn

    def _drop(self) -> None:
        if self._closer is not None:
            self._closer()  # closes the connection once
            self._closer = None
        self._conn = None

    def begin(self, conn: Any) -> None:
        conn.execute("BEGIN")

    def begin_schema(self, conn: Any) -> None:
        """A migration's transaction: the schema lock first, so that hutchd processes
        starting together on one database migrate one after the other (DDL is
        transactional in PostgreSQL: a migration commits whole or not at all)."""
        conn.execute("BEGIN")
        conn.execute(f"SELECT pg_advisory_xact_lock({SCHEMA_LOCK})")

    def commit(self, conn: Any) -> None:
        conn.execute("COMMIT")

    def rollback(self, conn: Any) -> None:
        current = self._conn
        if current is None or current.pg.closed or current.pg.broken:
            return  # the server rolled it back with the connection
        try:
            current.pg.execute(b"ROLLBACK")
        except psycopg.Error:
            self._drop()

    def translate(self, exc: BaseException) -> BaseException | None:
        if isinstance(exc, ConnectionLost):
            return exc
        if not isinstance(exc, psycopg.Error):
            return None
        current = self._conn
        if current is not None and (current.pg.closed or current.pg.broken):
            self._drop()
            reason = _SPACE.sub(" ", str(exc)).strip() or type(exc).__name__
            return ConnectionLost(
                f"lost the connection to the PostgreSQL database {self.display}: {reason}"
            )
        if isinstance(exc, psycopg.errors.IntegrityError):
            return IntegrityViolation(_SPACE.sub(" ", str(exc)).strip())
        return exc

    def legacy_version(self, conn: Any) -> int:
        return 0  # PostgreSQL databases have only ever had the ledger

    def stamp(self, conn: Any, version: int) -> None:
        pass

    def close(self) -> None:
        self._drop()
