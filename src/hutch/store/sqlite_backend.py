"""The SQLite backend (WAL): one connection in autocommit mode, transactions opened with
``BEGIN IMMEDIATE`` so that a transaction that reads and then writes holds the write lock
from its first statement (no upgrade deadlock, no lost update between two writers)."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hutch.errors import StoreError
from hutch.store.backend import Cursor, Dialect, IntegrityViolation, to_param

__all__ = ["SqliteBackend"]

DIALECT = Dialect(name="sqlite", for_update="", skip_locked="")


class SqliteConn:
    dialect = DIALECT

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor:
        return self._db.execute(sql, [to_param(p) for p in params])


class SqliteBackend:
    dialect = DIALECT

    def __init__(self, path: Path) -> None:
        self.path = path
        self.display = str(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(
                str(path), isolation_level=None, check_same_thread=False, timeout=30.0
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the database {path}: {exc}") from exc
        self._conn = SqliteConn(self._db)

    def conn(self) -> SqliteConn:
        return self._conn

    def begin(self, conn: Any) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def begin_schema(self, conn: Any) -> None:
        self.begin(conn)

    def commit(self, conn: Any) -> None:
        self._db.execute("COMMIT")

    def rollback(self, conn: Any) -> None:
        # An unusable connection says so at its next statement.
        if self._db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")

    def translate(self, exc: BaseException) -> BaseException | None:
        if isinstance(exc, sqlite3.IntegrityError):
            return IntegrityViolation(str(exc))
        if isinstance(exc, sqlite3.Error):
            return exc
        return None

    def legacy_version(self, conn: Any) -> int:
        """``PRAGMA user_version``: the schema version before the ``hutch_schema`` ledger
        (kept in step with it, so an older hutch still refuses a newer database)."""
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def stamp(self, conn: Any, version: int) -> None:
        self._db.execute(f"PRAGMA user_version = {int(version)}")

    def close(self) -> None:
        self._db.close()
