"""The imported-images table. Same database and transactions as ``hutch.store.db``.

A row names an image (``project``, ``name``) and the content it boots (``digest``, the
manifest digest: the content directory under the images dir). Rows made before projects
existed were moved into ``default`` (migration 7).
"""

from __future__ import annotations

import builtins
import json
import time
from dataclasses import dataclass
from typing import Any

from hutch.contract.auth import DEFAULT_PROJECT
from hutch.errors import Conflict
from hutch.store.db import Store
from hutch.store.meter_sql import close_intervals_in, open_interval_in

__all__ = ["GLOBAL", "ImageRow", "ImageStore"]

#: The project an image row is in when none is named.
GLOBAL = DEFAULT_PROJECT
_COLUMNS = "project, name, digest, source_json, config_json, start, size_bytes, created_at"


@dataclass(frozen=True)
class ImageRow:
    name: str
    digest: str
    source: dict[str, Any]
    config: dict[str, Any]
    start: bool
    size_bytes: int
    created_at: float
    project: str = GLOBAL


def _row(r: tuple[Any, ...]) -> ImageRow:
    project, name, digest, source, config, start, size, created = r
    return ImageRow(
        name=name,
        digest=digest,
        source=json.loads(source),
        config=json.loads(config),
        start=bool(start),
        size_bytes=int(size),
        created_at=float(created),
        project=project,
    )


def _subject(project: str, name: str) -> str:
    """The meter's name for an image (as migration 7 names the images it found)."""
    return f"image:{project}/{name}"


class ImageStore:
    def __init__(self, store: Store) -> None:
        self._store = store

    def insert(self, row: ImageRow) -> None:
        """``Conflict`` if the name is taken."""
        try:
            with self._store.transaction() as db:
                db.execute(
                    f"INSERT INTO images ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (row.project, row.name, row.digest, json.dumps(row.source),
                     json.dumps(row.config), int(row.start), row.size_bytes, row.created_at),
                )  # fmt: skip
                # Storage from its import to its removal, in the same transaction.
                open_interval_in(
                    db, row.project or DEFAULT_PROJECT, _subject(row.project, row.name), "image",
                    row.size_bytes / 1e9, row.created_at,
                )  # fmt: skip
        except Conflict:
            raise Conflict(
                f"an image named {row.name!r} already exists; delete it first or pick another name"
            ) from None

    def get(self, name: str, project: str = GLOBAL) -> ImageRow | None:
        with self._store.transaction() as db:
            r = db.execute(
                f"SELECT {_COLUMNS} FROM images WHERE project = ? AND name = ?", (project, name)
            ).fetchone()
        return _row(r) if r else None

    def list(self, project: str = GLOBAL) -> list[ImageRow]:
        with self._store.transaction() as db:
            rows = db.execute(
                f"SELECT {_COLUMNS} FROM images WHERE project = ? ORDER BY name", (project,)
            ).fetchall()
        return [_row(r) for r in rows]

    def list_all(self) -> builtins.list[ImageRow]:
        """Every project's images (the admin's view), by project and name."""
        with self._store.transaction() as db:
            rows = db.execute(f"SELECT {_COLUMNS} FROM images ORDER BY project, name").fetchall()
        return [_row(r) for r in rows]

    def uses(self, digest: str) -> int:
        """How many image rows (of every project) name the content ``digest``."""
        with self._store.transaction() as db:
            r = db.execute("SELECT COUNT(*) FROM images WHERE digest = ?", (digest,)).fetchone()
        return int(r[0])

    def delete(self, name: str, project: str = GLOBAL) -> bool:
        with self._store.transaction() as db:
            cur = db.execute("DELETE FROM images WHERE project = ? AND name = ?", (project, name))
            close_intervals_in(db, _subject(project, name), ["image"], time.time())
            return cur.rowcount > 0
