"""The seam between the store's SQL and the database that runs it (SQLite or PostgreSQL).

The store modules write one SQL text for both databases, with ``?`` placeholders and the
portable forms both accept (``INSERT ... ON CONFLICT (...) DO UPDATE/NOTHING``,
``RETURNING``, ``COALESCE``, ``CASE``). What still differs is asked of the connection's
:class:`Dialect` (``db.dialect.greatest(a, b)``, ``json_text``, the row-lock clauses), and
nothing else in the package knows which database it talks to. A backend
(``sqlite_backend``, ``pg_backend``) owns its connection, turns ``?`` into its own
placeholders, maps its driver's errors to the ones below and rewrites the migrations'
DDL (``Dialect.ddl``).

Transactions: ``Store.transaction()`` yields a :class:`Conn` inside one transaction. On
SQLite that is ``BEGIN IMMEDIATE`` (the one writer lock: every transaction is serial); on
PostgreSQL a ``READ COMMITTED`` transaction, so a read-then-write that must not race
another host takes a row lock on what it decides on (``db.dialect.for_update``) or claims
work with :func:`claim` (``FOR UPDATE SKIP LOCKED``). See ARCHITECTURE.md "State: SQLite or
PostgreSQL".
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "Backend",
    "Conn",
    "ConnectionLost",
    "Cursor",
    "Dialect",
    "IntegrityViolation",
    "claim",
    "to_param",
]


class Cursor(Protocol):
    """What a statement returns: rows as tuples (both drivers' default)."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


@dataclass(frozen=True)
class Dialect:
    """The SQL fragments that differ between the databases."""

    name: str  # "sqlite" | "postgresql"
    #: Appended to a SELECT that decides a write: lock the rows it read until the commit.
    #: Empty on SQLite, where ``BEGIN IMMEDIATE`` already holds the database's write lock.
    for_update: str
    #: Appended to a SELECT that claims work: lock the rows it returns and pass over those
    #: another transaction holds. Empty on SQLite (one writer at a time).
    skip_locked: str

    def greatest(self, a: str, b: str) -> str:
        """The larger of two SQL expressions (SQLite's scalar ``MAX``)."""
        return f"MAX({a}, {b})" if self.name == "sqlite" else f"GREATEST({a}, {b})"

    def json_text(self, column: str) -> str:
        """The text of one top-level key of a JSON object column, the key as one ``?``
        parameter (pass :meth:`json_key`)."""
        if self.name == "sqlite":
            return f"json_extract({column}, ?)"
        return f"(({column})::jsonb ->> ?)"

    def json_key(self, key: str) -> str:
        if self.name == "sqlite":
            # Quoted, so that dots and brackets in user keys are taken literally.
            return '$."' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return key


class Conn(Protocol):
    """A connection inside one transaction (what ``Store.transaction()`` yields)."""

    dialect: Dialect

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor: ...


class IntegrityViolation(Exception):
    """A constraint refused the statement (unique, foreign key, not null): the store
    maps it to ``Conflict``."""


class ConnectionLost(Exception):
    """The connection is gone (server restarted, network): the backend reconnects at the
    next call; the store maps it to ``StoreError``."""


class Backend(Protocol):
    """One database: a connection it reopens after a loss, and its transactions."""

    dialect: Dialect
    #: What to name in errors (the path, or the URL without its password).
    display: str

    def conn(self) -> Conn:
        """The live connection, opened (again) if there is none. Raises
        ``ConnectionLost`` when the database cannot be reached."""
        ...

    def begin(self, conn: Conn) -> None: ...

    def begin_schema(self, conn: Conn) -> None:
        """Open a migration's transaction, holding the schema lock (on SQLite the write
        lock; on PostgreSQL an advisory transaction lock) until it ends."""
        ...

    def commit(self, conn: Conn) -> None: ...

    def rollback(self, conn: Conn) -> None:
        """Undo the open transaction; never raises (a lost connection has none left)."""
        ...

    def translate(self, exc: BaseException) -> BaseException | None:
        """This driver's error as ``IntegrityViolation``/``ConnectionLost``/itself (a
        driver error), or None for an error that is not the driver's."""
        ...

    def legacy_version(self, conn: Conn) -> int:
        """The schema version a database recorded before the ``hutch_schema`` ledger."""
        ...

    def stamp(self, conn: Conn, version: int) -> None:
        """Record ``version`` wherever an older hutch looks for it (besides the ledger)."""
        ...

    def close(self) -> None: ...


def to_param(value: Any) -> Any:
    """A Python value as both databases store it: enums by value, booleans as 0/1 (the
    schema's INTEGER flags; PostgreSQL would refuse a boolean for a BIGINT column)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value


def claim(
    db: Conn,
    select: str,
    params: Sequence[Any] = (),
) -> list[Any]:
    """Rows of ``select`` that this transaction takes for itself until it commits: on
    PostgreSQL ``FOR UPDATE SKIP LOCKED`` (another host's transaction claiming at the same
    time gets other rows, never waits for these); on SQLite the transaction already holds
    the only write lock. ``select`` is one plain SELECT of one table (with its WHERE,
    ORDER BY and LIMIT), written as for any store statement. The caller marks what it took
    (an UPDATE in the same transaction) before the commit releases the locks."""
    return list(db.execute(select + db.dialect.skip_locked, params).fetchall())
