"""SandboxMoves' pause uploads on BackgroundUploads: a resume here stops the upload at
its next part and waits for its thread, a row no longer paused at the same time is not
uploaded (nor retried), a sandbox deleted during a failed attempt has its pause's blobs
removed, and ``wait_uploaded`` keeps its timeout. The core and the store are fakes (the
rows a dict, each ``put`` a loop of parts until released); what a pause's upload sends
and a fetch checks is tests/component/test_blob_dirs_chain.py's, the real thing across
hosts tests/e2e/cluster/test_3_moves.py's."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hutch.errors import BlobError, HutchError
from hutch.models import PauseMode, SandboxRecord, SandboxState, Shape
from hutch.services.moves import SandboxMoves, pause_prefix
from hutch.storage.blobs import BlobInfo

TINY = (0.001, 0.002)
DEADLINE_S = 10.0


class Rows:
    """The sandboxes table, as far as moves reads it."""

    def __init__(self) -> None:
        self.rows: dict[str, SandboxRecord] = {}

    def get_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        return self.rows.get(sandbox_id)


class PartsStore:
    """A blob store whose ``put`` sends parts (asking ``progress`` before each) until
    ``release`` is set, failing the first ``failures`` puts."""

    url = "fake://store"

    def __init__(self, failures: int = 0, on_fail: Callable[[], object] | None = None) -> None:
        self.failures = failures
        self.on_fail = on_fail
        self.puts = 0
        self.in_put = threading.Event()
        self.release = threading.Event()
        self.stopped: list[str] = []
        self.deleted: list[str] = []
        self.keys = {"pauses/sb/1000/disk.qcow2", "pauses/sb/1000/index.json"}

    def put(self, key: str, source: Path, progress: Callable[[int], None]) -> BlobInfo:
        self.puts += 1
        if self.puts <= self.failures:
            if self.on_fail is not None:
                self.on_fail()
            raise BlobError(f"store away (put {self.puts})")
        self.in_put.set()
        while not self.release.wait(0.001):
            try:
                progress(0)
            except HutchError as exc:  # the progress callback's "stop here"
                self.stopped.append(str(exc))
                raise
        return BlobInfo(key, 1, "0" * 64)

    def list_prefix(self, prefix: str) -> list[BlobInfo]:
        return [BlobInfo(k, 1, "0" * 64) for k in sorted(self.keys) if k.startswith(prefix)]

    def delete(self, key: str) -> None:
        self.deleted.append(key)


def paused_row(paused_at: float = 1.0) -> SandboxRecord:
    return SandboxRecord(
        "sb",
        "base",
        SandboxState.PAUSED,
        Shape(),
        0.0,
        pause_mode=PauseMode.DISK,
        paused_at=paused_at,
    )


def moves_of(store: PartsStore, rows: Rows, tmp_path: Path) -> SandboxMoves:
    core: Any = SimpleNamespace(store=rows, settings=SimpleNamespace(state_dir=tmp_path))
    moves = SandboxMoves(core, store, retry_s=TINY)  # type: ignore[arg-type]

    def upload(rec: SandboxRecord) -> int:  # one blob: the pause's disk
        return moves._put(rec, pause_prefix(rec) + "disk.qcow2", tmp_path / "disk").size

    moves._upload = upload  # type: ignore[method-assign]
    return moves


async def test_a_resume_here_stops_the_upload_at_its_next_part_and_waits(
    tmp_path: Path,
) -> None:
    store, rows = PartsStore(), Rows()
    rows.rows["sb"] = rec = paused_row()
    moves = moves_of(store, rows, tmp_path)
    moves.paused(rec)
    moves.paused(rec)  # under way: one upload
    await asyncio.to_thread(store.in_put.wait, DEADLINE_S)
    await moves.stop_upload("sb")
    # Its thread has ended: the resume may change the files from here on.
    assert store.stopped == ["the upload of sandbox sb's pause was stopped"]
    assert not moves.uploads.running("sb") and store.puts == 1  # no retry
    assert store.deleted == []  # still paused (resuming): its blobs stay for now
    # The next pause is a new upload.
    rows.rows["sb"] = again = paused_row(2.0)
    store.release.set()
    moves.paused(again)
    await moves.wait_uploaded("sb")
    assert store.puts == 2 and not moves.uploads.running("sb")
    await moves.close()


async def test_a_row_no_longer_paused_at_that_time_is_not_uploaded(tmp_path: Path) -> None:
    store, rows = PartsStore(), Rows()
    rows.rows["sb"] = paused_row(2.0)  # paused again since
    moves = moves_of(store, rows, tmp_path)
    moves.paused(paused_row(1.0))
    await moves.wait_uploaded("sb")
    assert store.puts == 0
    await moves.close()


async def test_resumed_elsewhere_during_a_failed_attempt_is_not_retried(
    tmp_path: Path,
) -> None:
    rows = Rows()
    rows.rows["sb"] = rec = paused_row()
    running = dataclasses.replace(rec, state=SandboxState.RUNNING, paused_at=None)
    store = PartsStore(failures=1, on_fail=lambda: rows.rows.update(sb=running))
    moves = moves_of(store, rows, tmp_path)
    moves.paused(rec)
    await moves.wait_uploaded("sb")
    assert store.puts == 1 and store.deleted == []  # the resume's to remove, not this
    await moves.close()


async def test_deleted_during_a_failed_attempt_its_pause_blobs_go(tmp_path: Path) -> None:
    rows = Rows()
    rows.rows["sb"] = rec = paused_row()
    store = PartsStore(failures=1, on_fail=lambda: rows.rows.pop("sb"))
    moves = moves_of(store, rows, tmp_path)
    moves.paused(rec)
    await moves.wait_uploaded("sb")
    await asyncio.wait_for(asyncio.gather(*moves._background), DEADLINE_S)
    assert store.puts == 1
    # Every pause of the sandbox, each index first (no longer "complete").
    assert store.deleted == ["pauses/sb/1000/index.json", "pauses/sb/1000/disk.qcow2"]
    await moves.close()


async def test_wait_uploaded_keeps_its_timeout_and_close_cancels(tmp_path: Path) -> None:
    store, rows = PartsStore(), Rows()
    rows.rows["sb"] = rec = paused_row()
    moves = moves_of(store, rows, tmp_path)
    moves.paused(rec)
    await asyncio.to_thread(store.in_put.wait, DEADLINE_S)
    await moves.wait_uploaded("sb", timeout_s=0.01)  # a store that slow: it goes on
    assert moves.uploads.running("sb")
    await moves.close()
    assert not moves.uploads.running("sb")
    await asyncio.to_thread(_until, lambda: bool(store.stopped))  # its thread saw it
    moves.paused(rec)  # closed: nothing new
    assert not moves.uploads.running("sb")


def _until(done: Callable[[], bool]) -> None:
    event = threading.Event()
    while not done() and not event.wait(0.001):
        pass
