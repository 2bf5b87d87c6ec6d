"""The store on both backends (SQLite, PostgreSQL: the ``db_target`` fixture): migrations,
round trips, filters, name uniqueness, durability. Tests of SQLite files made by older
versions stay on SQLite."""

from __future__ import annotations

import sqlite3
import time
from dataclasses import replace
from pathlib import Path

import pytest

from hutch.errors import Conflict, StoreError
from hutch.models import SandboxRecord, SandboxState, Shape, SnapshotRecord
from hutch.store import Store
from hutch.store.images import ImageStore
from hutch.store.migrations import MIGRATIONS
from hutch.store.net import NetStore, NetworkRow


def record(sid: str = "sb-000000000001", **kw: object) -> SandboxRecord:
    base: dict[str, object] = dict(
        id=sid,
        image="base",
        state=SandboxState.RUNNING,
        shape=Shape(2, 1024, 8),
        created_at=time.time(),
    )
    base.update(kw)
    return SandboxRecord(**base)  # type: ignore[arg-type]


def test_round_trip_keeps_every_field(db_target: Path | str) -> None:
    store = Store(db_target)
    rec = record(
        name="web",
        env={"A": "1"},
        metadata={"team": "x"},
        timeout_s=60,
        image_digest="abc",
        started_at=1.5,
        expires_at=61.5,
        error=None,
        placement_labels={"zone": "b"},
    )
    store.insert_sandbox(rec)
    assert store.get_sandbox(rec.id) == rec


def test_schema_is_migrated_once_and_reopens(db_target: Path | str) -> None:
    Store(db_target).close()
    store = Store(db_target)
    assert store.schema_version() == len(MIGRATIONS)
    with store.transaction() as db:
        ledger = db.execute("SELECT version FROM hutch_schema ORDER BY version").fetchall()
    assert [v for (v,) in ledger] == list(range(1, len(MIGRATIONS) + 1))


def test_sqlite_is_wal_and_keeps_user_version_in_step(tmp_path: Path) -> None:
    Store(tmp_path / "h.db").close()
    raw = sqlite3.connect(tmp_path / "h.db")
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    # hutch before the ledger reads user_version: it must still refuse a newer database
    assert raw.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    raw.close()


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    Store(tmp_path / "h.db").close()
    db = sqlite3.connect(tmp_path / "h.db")
    db.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 5}")
    db.close()
    with pytest.raises(StoreError, match="newer than this hutch"):
        Store(tmp_path / "h.db")


def test_filters_by_state_and_metadata(db_target: Path | str) -> None:
    store = Store(db_target)
    store.insert_sandbox(record("sb-000000000001", metadata={"team": "a", "x.y": "1"}))
    store.insert_sandbox(record("sb-000000000002", metadata={"team": "b"}))
    store.insert_sandbox(
        record("sb-000000000003", state=SandboxState.DESTROYED, metadata={"team": "a"})
    )

    def ids(records: list[SandboxRecord]) -> list[str]:
        return [r.id for r in records]

    assert ids(store.list_sandboxes(metadata={"team": "a"})) == [
        "sb-000000000001",
        "sb-000000000003",
    ]
    assert ids(store.list_sandboxes([SandboxState.RUNNING], {"team": "a"})) == ["sb-000000000001"]
    assert ids(store.list_sandboxes(metadata={"x.y": "1"})) == ["sb-000000000001"]
    assert ids(store.list_sandboxes(metadata={"team": "a' OR 1=1 --"})) == []


def test_live_names_are_unique_but_reusable_after_destroy(db_target: Path | str) -> None:
    store = Store(db_target)
    store.insert_sandbox(record("sb-000000000001", name="web"))
    with pytest.raises(Conflict, match="already exists"):
        store.insert_sandbox(record("sb-000000000002", name="web"))
    store.update_sandbox("sb-000000000001", state=SandboxState.DESTROYED)
    store.insert_sandbox(record("sb-000000000002", name="web"))


def test_live_usage_counts_only_live(db_target: Path | str) -> None:
    store = Store(db_target)
    store.insert_sandbox(record("sb-000000000001"))
    store.insert_sandbox(record("sb-000000000002", state=SandboxState.CREATING))
    store.insert_sandbox(record("sb-000000000003", state=SandboxState.FAILED))
    assert store.live_usage() == (2, 2048)


def test_failed_write_changes_nothing(db_target: Path | str) -> None:
    store = Store(db_target)
    rec = record()
    store.insert_sandbox(rec)
    with pytest.raises(Conflict):
        store.insert_sandbox(rec)  # same primary key
    assert store.list_sandboxes() == [rec]


def test_a_snapshot_being_saved_is_unlisted_until_finished(
    tmp_path: Path, db_target: Path | str
) -> None:
    store = Store(db_target)
    snap = SnapshotRecord(
        id="snap-000000000001",
        name="n",
        sandbox_id="sb-000000000001",
        image="base",
        shape=Shape(1, 256, 4),
        path=str(tmp_path / "snap-000000000001"),
        size_bytes=0,
        created_at=time.time(),
    )
    store.insert_snapshot(snap, ready=False)
    assert store.list_snapshots() == [] and store.get_snapshot(snap.id) is None
    assert store.list_snapshots(ready=False) == [snap] == store.list_snapshots(ready=None)
    store.finish_snapshot(snap.id, 4096)
    done = replace(snap, size_bytes=4096)
    assert store.list_snapshots() == [done] and store.get_snapshot(snap.id) == done
    assert store.list_snapshots(ready=False) == []


def test_snapshots_from_before_migration_5_are_ready(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "h.db")
    for version, script in enumerate(MIGRATIONS[:4], start=1):
        db.executescript(script)
        db.execute(f"PRAGMA user_version = {version}")
    db.execute(
        "INSERT INTO snapshots (id, name, sandbox_id, image, vcpus, memory_mib, disk_gib, "
        "path, size_bytes, created_at) VALUES ('snap-000000000002', 'old', 'sb-000000000001', "
        "'base', 1, 256, 4, '/x', 1, 1.0)"
    )
    db.commit()
    db.close()
    store = Store(tmp_path / "h.db")
    assert [s.id for s in store.list_snapshots()] == ["snap-000000000002"]


def test_migration_7_moves_every_existing_row_into_default_with_no_loss(tmp_path: Path) -> None:
    """A database made by the migrations before projects, with a row in every table,
    opens with every row kept and in project ``default``; names become unique per
    project (a second project may reuse a live sandbox name and a network name)."""
    db = sqlite3.connect(tmp_path / "h.db")
    for version, script in enumerate(MIGRATIONS[:6], start=1):
        db.executescript(script)
        db.execute(f"PRAGMA user_version = {version}")
    db.executescript(
        """
        INSERT INTO sandboxes (id, name, image, state, vcpus, memory_mib, disk_gib,
            created_at, network) VALUES
            ('sb-000000000001', 'web', 'base', 'running', 2, 512, 4, 1.0, 'default'),
            ('sb-000000000002', NULL, 'base', 'destroyed', 1, 256, 4, 2.0, 'none');
        INSERT INTO snapshots (id, name, sandbox_id, image, vcpus, memory_mib, disk_gib,
            path, size_bytes, created_at) VALUES
            ('snap-000000000001', 's', 'sb-000000000001', 'base', 2, 512, 4, '/s', 7, 3.0);
        INSERT INTO networks (id, name, created_at) VALUES ('net-000000000001', 'team', 4.0);
        INSERT INTO network_members (network_id, sandbox_id)
            VALUES ('net-000000000001', 'sb-000000000001');
        INSERT INTO net_leases (sandbox_id, block, tap) VALUES ('sb-000000000001', 3, 'hx3');
        INSERT INTO egress_rules (sandbox_id, rules_json, updated_at)
            VALUES ('sb-000000000001', '["example.com"]', 5.0);
        INSERT INTO exposed_ports (sandbox_id, guest_port, host_port)
            VALUES ('sb-000000000001', 80, 40080);
        INSERT INTO images (project, name, digest, source_json, config_json, size_bytes,
            created_at) VALUES ('', 'py', 'sha256:ab', '{}', '{}', 9, 6.0);
        """
    )
    db.commit()
    db.close()

    store = Store(tmp_path / "h.db")
    assert store.schema_version() == len(MIGRATIONS)
    sandboxes = store.list_sandboxes()
    assert [(r.id, r.name, r.project) for r in sandboxes] == [
        ("sb-000000000001", "web", "default"),
        ("sb-000000000002", None, "default"),
    ]
    assert sandboxes[0].shape == Shape(2, 512, 4) and sandboxes[0].created_at == 1.0
    assert [(s.id, s.size_bytes, s.project) for s in store.list_snapshots()] == [
        ("snap-000000000001", 7, "default")
    ]
    net = NetStore(store)
    team = net.network("team", "default")
    assert team is not None and (team.id, team.created_at) == ("net-000000000001", 4.0)
    assert net.network("team", "other") is None
    assert net.members("net-000000000001") == ["sb-000000000001"]
    assert net.leases()["sb-000000000001"].tap == "hx3"
    assert net.rules("sb-000000000001") == ["example.com"]
    assert net.ports("sb-000000000001") == [("sb-000000000001", 80, 40080)]
    image = ImageStore(store).get("py", "default")
    assert image is not None and image.size_bytes == 9
    raw = sqlite3.connect(tmp_path / "h.db")
    assert raw.execute("SELECT name FROM projects").fetchall() == [("default",)]
    # The foreign key followed the rebuilt table: a member of no network is refused.
    raw.execute("PRAGMA foreign_keys=ON")
    with pytest.raises(sqlite3.IntegrityError):
        raw.execute("INSERT INTO network_members VALUES ('net-nope', 'sb-000000000001')")
    raw.close()

    # Names are unique per project now.
    store.insert_sandbox(record("sb-000000000003", name="web", project="other"))
    with pytest.raises(Conflict, match="already exists"):
        store.insert_sandbox(record("sb-000000000004", name="web"))
    net.insert_network(NetworkRow("net-000000000002", "team", 7.0, "other"))
    with pytest.raises(Conflict, match="already exists"):
        net.insert_network(NetworkRow("net-000000000003", "team", 8.0, "default"))
    assert [r.id for r in store.list_sandboxes(project="other")] == ["sb-000000000003"]
    assert [n.id for n in net.networks("other")] == ["net-000000000002"]


def test_sandboxes_from_before_the_secrets_migration_have_no_env_secrets(tmp_path: Path) -> None:
    secrets_migration = next(i for i, m in enumerate(MIGRATIONS) if "CREATE TABLE secrets" in m)
    db = sqlite3.connect(tmp_path / "h.db")
    for version, script in enumerate(MIGRATIONS[:secrets_migration], start=1):
        db.executescript(script)
        db.execute(f"PRAGMA user_version = {version}")
    db.execute(
        "INSERT INTO sandboxes (id, image, state, vcpus, memory_mib, disk_gib, created_at, "
        "env_json) VALUES ('sb-000000000001', 'base', 'paused', 1, 256, 4, 1.0, '{\"A\": \"1\"}')"
    )
    db.commit()
    db.close()
    store = Store(tmp_path / "h.db")
    rec = store.get_sandbox("sb-000000000001")
    assert rec is not None and (rec.env, rec.env_secrets) == ({"A": "1"}, {})
    store.insert_sandbox(record("sb-000000000002", env_secrets={"TOKEN": "openai"}))
    again = store.get_sandbox("sb-000000000002")
    assert again is not None and again.env_secrets == {"TOKEN": "openai"}
