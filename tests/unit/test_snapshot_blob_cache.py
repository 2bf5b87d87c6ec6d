"""The local snapshot cache's eviction order (SnapshotBlobs.evict): least recently used
first, only snapshots whose upload completed, never one collection says is still
reached; over a real LocalBlobStore and real directories (the references are a stand-in
for SandboxRegistry.collect_snapshots, whose own rule the VM test exercises)."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from hutch.models import Shape, SnapshotRecord
from hutch.services.registry import SandboxRegistry
from hutch.services.snapshot_blobs import INDEX, SnapshotBlobs
from hutch.storage.blobs import LocalBlobStore


class _Core:
    """What SnapshotBlobs.evict asks of the registry, backend and store."""

    def __init__(self, root: Path, snaps: list[SnapshotRecord], in_use: set[str]) -> None:
        self.in_use = in_use
        self.evicted: list[str] = []
        self.settings = SimpleNamespace(state_dir=root)
        self.store = SimpleNamespace(list_snapshots=lambda: snaps)
        self.backend = SimpleNamespace(
            fork_dir=lambda sid: root / "snapshots" / sid,
            snapshots=SimpleNamespace(
                complete=lambda d: (d / "manifest.json").is_file(),
                size=lambda d: sum(f.stat().st_size for f in d.iterdir()),
            ),
        )

    def collect_snapshots(self, evict: str | None = None) -> bool:
        assert evict is not None
        if Path(evict).name in self.in_use:
            return False
        shutil.rmtree(evict)
        self.evicted.append(Path(evict).name)
        return True


def _setup(tmp_path: Path, uploaded: set[str]) -> tuple[list[SnapshotRecord], LocalBlobStore]:
    store = LocalBlobStore(tmp_path / "blobs")
    snaps = []
    for age, sid in enumerate(["snap-00000000000a", "snap-00000000000b", "snap-00000000000c"]):
        d = tmp_path / "snapshots" / sid
        d.mkdir(parents=True)
        (d / "manifest.json").write_text("{}")
        (d / "state.mig").write_bytes(b"x" * 98)
        (d / "frozen").write_text("")
        os.utime(d / "frozen", (1000 + age, 1000 + age))  # a: least recently used
        if sid in uploaded:
            index = tmp_path / "index.json"
            index.write_text("{}")
            store.put(f"snapshots/{sid}/{INDEX}", index)
        shape = Shape(memory_mib=256)
        snaps.append(SnapshotRecord(sid, "n", "sb-1", "base", shape, str(d), 100, 0.0))
    return snaps, store


def _blobs(core: _Core, store: LocalBlobStore, limit: int) -> SnapshotBlobs:
    return SnapshotBlobs(cast(SandboxRegistry, cast(Any, core)), store, limit)


def test_least_recently_used_goes_first_until_under_the_limit(tmp_path: Path) -> None:
    snaps, store = _setup(
        tmp_path, {s for s in ("snap-00000000000a", "snap-00000000000b", "snap-00000000000c")}
    )
    core = _Core(tmp_path, snaps, in_use=set())
    assert asyncio.run(_blobs(core, store, 150).evict()) == [
        "snap-00000000000a",
        "snap-00000000000b",
    ]
    assert (tmp_path / "snapshots" / "snap-00000000000c").is_dir()


def test_in_use_and_not_uploaded_copies_stay(tmp_path: Path) -> None:
    snaps, store = _setup(tmp_path, {"snap-00000000000a", "snap-00000000000c"})
    core = _Core(tmp_path, snaps, in_use={"snap-00000000000a"})
    # a: a sandbox uses it; b: its upload has not completed (the only copy); c goes.
    assert asyncio.run(_blobs(core, store, 150).evict()) == ["snap-00000000000c"]
    assert (tmp_path / "snapshots" / "snap-00000000000a").is_dir()
    assert (tmp_path / "snapshots" / "snap-00000000000b").is_dir()


def test_no_limit_or_no_store_evicts_nothing(tmp_path: Path) -> None:
    snaps, store = _setup(tmp_path, {"snap-00000000000a"})
    core = _Core(tmp_path, snaps, in_use=set())
    assert asyncio.run(_blobs(core, store, 0).evict()) == []
    none = SnapshotBlobs(cast(SandboxRegistry, cast(Any, core)), None, 1)
    assert asyncio.run(none.evict()) == []
    assert core.evicted == []
