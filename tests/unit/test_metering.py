"""The meter's interval arithmetic and the event log, on a real SQLite store with an
injected clock (the real-daemon proof is tests/e2e/test_metering.py)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from hutch.config import load_settings
from hutch.contract.auth import Principal
from hutch.errors import InvalidArgument, StateError, StoreError
from hutch.models import PauseMode, SandboxRecord, SandboxState, Shape, SnapshotRecord
from hutch.services.events import EventLog, act_as, because, internal, lifecycle_event, scrub
from hutch.services.metering import Prices, Usage, changes, held, usage
from hutch.services.metrics import Metrics
from hutch.services.state import SandboxStates
from hutch.store import Store
from hutch.store.images import ImageRow, ImageStore
from hutch.store.meter import IntervalRow, MeterStore
from hutch.store.migrations import MIGRATIONS
from tests.unit.fake_clock import Clock

S = SandboxState
SHAPE = Shape(vcpus=2, memory_mib=1024, disk_gib=4)
PRICES = Prices()
#: Where every test's clock starts.
START = 1_000_000.0


def states(target: Path | str, clock: Clock) -> tuple[SandboxStates, MeterStore, Store]:
    store = Store(target)
    meter = MeterStore(store)
    log = EventLog(meter, retention_s=86400, max_events=1000, clock=clock)
    return SandboxStates(store, log, clock=clock), meter, store


def record(clock: Clock, sid: str = "sb-000000000001") -> SandboxRecord:
    return SandboxRecord(id=sid, image="base", state=S.CREATING, shape=SHAPE, created_at=clock())


def total(
    meter: MeterStore, clock: Clock, start: float, end: float, group_by: str = "sandbox"
) -> Usage:
    rows = meter.intervals(project=None, start=start, end=end)
    return usage(rows, start=start, end=end, now=clock(), group_by=group_by, prices=PRICES)


def test_each_phase_is_billed_to_the_second(db_target: Path | str) -> None:
    clock = Clock(START)
    t0 = clock.now
    st, meter, _ = states(db_target, clock)
    st.insert(record(clock))
    clock.now = t0 + 10
    st.running(st.get("sb-000000000001"))
    clock.now = t0 + 40
    st.move("sb-000000000001", S.PAUSING, pause_mode=PauseMode.MEMORY)
    clock.now = t0 + 42
    st.move("sb-000000000001", S.PAUSED, pause_mode=PauseMode.MEMORY, paused_at=clock.now)
    clock.now = t0 + 100
    st.move("sb-000000000001", S.RESUMING)
    clock.now = t0 + 103
    st.running_again("sb-000000000001")
    clock.now = t0 + 150
    st.move("sb-000000000001", S.STOPPING)
    clock.now = t0 + 151
    st.ended("sb-000000000001", S.DESTROYED)
    clock.now = t0 + 500  # long after: nothing more is billed
    u = total(meter, clock, t0 - 1000, t0 + 1000)
    (row,) = u.rows
    # Running, pausing and resuming hold the VM: 10..42 and 100..150.
    assert row.vcpu_seconds == pytest.approx(2 * (32 + 50))
    assert row.memory_gib_seconds == pytest.approx(1 * (32 + 50))
    assert row.paused_memory_gib_seconds == pytest.approx(58)
    assert row.disk_gb_hours == pytest.approx(4 * 1.073741824 * 151 / 3600)
    expected = (
        164 / 3600 * PRICES.vcpu_hour
        + (82 + 58) / 3600 * PRICES.gib_hour
        + row.disk_gb_hours * PRICES.storage_gb_hour
    )
    assert row.cost_usd == pytest.approx(expected)
    assert u.total.cost_usd == pytest.approx(expected)
    # A window cuts intervals at its edges.
    part = total(meter, clock, t0 + 20, t0 + 30).rows[0]
    assert part.vcpu_seconds == pytest.approx(20)
    assert part.paused_memory_gib_seconds == 0


def test_disk_mode_pause_holds_no_memory(db_target: Path | str) -> None:
    clock = Clock(START)
    st, meter, _ = states(db_target, clock)
    st.insert(record(clock))
    st.running(st.get("sb-000000000001"))
    clock.now += 5
    st.move("sb-000000000001", S.PAUSING, pause_mode=PauseMode.DISK)
    st.move("sb-000000000001", S.PAUSED, pause_mode=PauseMode.DISK)
    clock.now += 100
    (row,) = total(meter, clock, 0, clock.now + 1).rows
    assert row.vcpu_seconds == pytest.approx(10)
    assert row.paused_memory_gib_seconds == 0


def test_an_open_interval_counts_up_to_now_and_none_is_opened_twice(db_target: Path | str) -> None:
    clock = Clock(START)
    t0 = clock.now
    st, meter, store = states(db_target, clock)
    st.insert(record(clock))
    st.running(st.get("sb-000000000001"))
    # A pause that failed (pausing -> running): the VM ran on, one interval throughout.
    clock.now = t0 + 5
    st.move("sb-000000000001", S.PAUSING, pause_mode=PauseMode.MEMORY)
    clock.now = t0 + 6
    st.move("sb-000000000001", S.RUNNING, pause_mode=None, resume_from=None)
    meter.open_interval("default", "sb-000000000001", "vcpu", 2.0, t0 + 7)  # ignored
    clock.now = t0 + 30
    (row,) = total(meter, clock, t0, t0 + 3600).rows
    assert row.vcpu_seconds == pytest.approx(60)
    with store.transaction() as db:
        n = db.execute("SELECT COUNT(*) FROM meter WHERE kind = 'vcpu'").fetchone()[0]
    assert n == 1


def test_a_vm_lost_across_a_restart_is_billed_to_its_last_heartbeat(db_target: Path | str) -> None:
    clock = Clock(START)
    t0 = clock.now
    st, meter, _ = states(db_target, clock)
    st.insert(record(clock))
    st.running(st.get("sb-000000000001"))
    clock.now = t0 + 20
    meter.heartbeat(["sb-000000000001"], clock.now)
    meter.heartbeat(["sb-000000000001"], t0 + 15)  # a late beat never goes back
    clock.now = t0 + 50  # the restarted daemon finds the VM gone
    st.ended("sb-000000000001", S.FAILED, "the VM was gone", lost=True)
    (row,) = total(meter, clock, t0, t0 + 3600).rows
    assert row.vcpu_seconds == pytest.approx(40)
    assert row.disk_gb_hours == pytest.approx(4 * 1.073741824 * 20 / 3600)
    failed = st.events.page(project="default", types=["sandbox.failed"]) if st.events else []
    assert failed[0].data["billed_until"] == pytest.approx(t0 + 20)


def test_a_grown_disk_is_billed_at_its_new_size_from_the_grow(db_target: Path | str) -> None:
    clock = Clock(START)
    t0 = clock.now
    st, meter, _ = states(db_target, clock)
    st.insert(record(clock))
    st.running(st.get("sb-000000000001"))
    clock.now = t0 + 3600
    st.disk_grown("sb-000000000001", 8)
    clock.now = t0 + 7200
    assert st.get("sb-000000000001").shape.disk_gib == 8
    (row,) = total(meter, clock, t0, t0 + 7200).rows
    assert row.disk_gb_hours == pytest.approx((4 + 8) * 1.073741824)
    assert row.vcpu_seconds == pytest.approx(2 * 7200)  # the VM's interval runs on


def test_a_refused_transition_writes_nothing(db_target: Path | str) -> None:
    clock = Clock(START)
    st, meter, _ = states(db_target, clock)
    st.insert(record(clock))
    with pytest.raises(StateError):
        st.move("sb-000000000001", S.PAUSED)
    assert st.get("sb-000000000001").state is S.CREATING
    assert [e.type for e in meter.events(project=None)] == ["sandbox.created"]


def test_state_meter_and_event_commit_together(db_target: Path | str) -> None:
    """If the event cannot be written, the state change is not written either."""
    clock = Clock(START)
    st, meter, store = states(db_target, clock)
    st.insert(record(clock))
    with store.transaction() as db:
        db.execute("DROP TABLE events")
    with pytest.raises(StoreError):
        st.running(st.get("sb-000000000001"))
    assert st.get("sb-000000000001").state is S.CREATING
    assert all(r.kind == "disk" for r in meter.intervals(project=None, start=0, end=1e12))


def test_usage_by_day_splits_at_utc_midnight(db_target: Path | str) -> None:
    midnight = 1_767_225_600.0  # 2026-01-01T00:00:00Z
    clock = Clock(midnight - 600)
    st, meter, _ = states(db_target, clock)
    st.insert(record(clock))
    st.running(st.get("sb-000000000001"))
    clock.now = midnight + 900
    u = total(meter, clock, midnight - 86400, midnight + 86400, group_by="day")
    assert [r.key for r in u.rows] == ["2025-12-31", "2026-01-01"]
    assert [r.vcpu_seconds for r in u.rows] == pytest.approx([1200, 1800])
    by_project = total(meter, clock, 0, midnight + 86400, group_by="project")
    assert [r.key for r in by_project.rows] == ["default"]
    with pytest.raises(ValueError, match="group_by"):
        usage([], start=0, end=1, now=1, group_by="week", prices=PRICES)


def test_changes_keeps_what_both_states_hold() -> None:
    running = held(S.RUNNING, None, SHAPE)
    assert running == {"disk": pytest.approx(4.294967296), "vcpu": 2.0, "memory": 1.0}
    assert changes(running, held(S.PAUSING, PauseMode.MEMORY, SHAPE)) == ([], {})
    close, opened = changes(running, held(S.PAUSED, PauseMode.MEMORY, SHAPE))
    assert sorted(close) == ["memory", "vcpu"] and opened == {"memory_paused": 1.0}
    assert held(S.DESTROYED, None, SHAPE) == {}


def test_lifecycle_events_name_their_reason() -> None:
    rec = SandboxRecord(id="sb-000000000001", image="b", state=S.PAUSED, shape=SHAPE,
                        created_at=0, pause_mode=PauseMode.MEMORY)  # fmt: skip
    assert lifecycle_event(S.PAUSING, rec, "idle") == (
        "sandbox.paused",
        {"reason": "idle", "mode": "memory"},
    )
    running = SandboxRecord(id=rec.id, image="b", state=S.RUNNING, shape=SHAPE, created_at=0)
    assert lifecycle_event(S.RESUMING, running, None) == ("sandbox.resumed", {"reason": "api"})
    assert lifecycle_event(S.CREATING, running, None) == ("sandbox.started", {})
    assert lifecycle_event(S.PAUSING, running, None) is None  # a failed pause: no event


def test_events_record_the_actor_and_reason(db_target: Path | str) -> None:
    clock = Clock(START)
    st, meter, _ = states(db_target, clock)
    act_as(Principal.admin(source="10.0.0.9"))
    try:
        st.insert(record(clock))
        st.running(st.get("sb-000000000001"))
        with because("timeout"):
            st.move("sb-000000000001", S.STOPPING)
            st.ended("sb-000000000001", S.DESTROYED)
    finally:
        internal()
    events = meter.events(project="default", sandbox_id="sb-000000000001")
    assert [e.type for e in events] == ["sandbox.created", "sandbox.started", "sandbox.deleted"]
    assert {(e.actor, e.source) for e in events} == {("admin", "10.0.0.9")}
    assert events[0].data == {
        "image": "base",
        "shape": {"vcpus": 2, "memory_mib": 1024, "disk_gib": 4},
        "from": "cold",
    }
    assert events[-1].data == {"reason": "timeout"}
    # Pages, type filters (exact and a family).
    assert [e.type for e in meter.events(project=None, after=events[0].seq)] == [
        "sandbox.started",
        "sandbox.deleted",
    ]
    assert len(meter.events(project=None, types=["sandbox.*"])) == 3
    assert meter.events(project=None, types=["snapshot.*"]) == []
    assert meter.events(project="other") == []


def test_retention_drops_old_events_and_keeps_at_most_the_newest(db_target: Path | str) -> None:
    clock = Clock(START)
    store = Store(db_target)
    meter = MeterStore(store)
    log = EventLog(meter, retention_s=100, max_events=5, clock=clock)
    for i in range(3):
        log.record("sandbox.exec", project="default", sandbox_id=None, data={"i": i})
    clock.now += 200
    for i in range(8):
        log.record("sandbox.exec", project="default", sandbox_id=None, data={"i": 10 + i})
    assert log.prune() == 3 + 3
    kept = meter.events(project=None, limit=100)
    assert [e.data["i"] for e in kept] == [13, 14, 15, 16, 17]
    # Numbers are never handed out again: a follower's after= stays valid.
    log.record("sandbox.exec", project="default", sandbox_id=None, data={})
    assert meter.events(project=None, after=kept[-1].seq)[0].seq == kept[-1].seq + 1


def test_scrub_removes_keys_and_env_values() -> None:
    text = "curl -H 'Authorization: Bearer hk_abcdefgh12345678' -d s3cr3tvalue x"
    # Values shorter than 3 characters are left (they would blank out ordinary words).
    out = scrub(text, ["s3cr3tvalue", "-d"])
    assert out == "curl -H 'Authorization: Bearer [redacted]' -d [redacted] x"


def test_snapshots_and_images_hold_storage_until_deleted(db_target: Path | str) -> None:
    store = Store(db_target)
    meter = MeterStore(store)
    snap = SnapshotRecord(id="snap-000000000001", name="s", sandbox_id="sb-000000000001",
                          image="base", shape=SHAPE, path="/x", size_bytes=0,
                          created_at=100.0)  # fmt: skip
    store.insert_snapshot(snap, ready=False)
    assert meter.intervals(project=None, start=0, end=1e12) == []  # not ready: not billed
    store.finish_snapshot(snap.id, 2_000_000_000)
    store.delete_snapshot(snap.id)
    (iv,) = meter.intervals(project=None, start=0, end=1e12)
    assert iv.kind == "snapshot" and iv.quantity == 2.0 and iv.ended_at is not None
    images = ImageStore(store)
    images.insert(ImageRow("img", "sha256:x", {}, {}, False, 500_000_000, 50.0))
    images.delete("img")
    kinds = {(iv.kind, iv.subject) for iv in meter.intervals(project=None, start=0, end=1e12)}
    assert ("image", "image:default/img") in kinds


def test_usage_survives_a_restart_and_a_schema_migration(tmp_path: Path) -> None:
    """A database made by the migrations before the meter's, with live rows: after the
    upgrade they are billed from then on, and what is billed survives reopening."""
    path = tmp_path / "hutch.db"
    db = sqlite3.connect(path)
    # Every migration before the meter's (the projects migration of issue 10 included).
    meter = next(i for i, m in enumerate(MIGRATIONS) if "CREATE TABLE meter" in m)
    for version, script in enumerate(MIGRATIONS[:meter], start=1):
        db.executescript(script)
        db.execute(f"PRAGMA user_version = {version}")
    db.execute(
        "INSERT INTO sandboxes (id, image, state, vcpus, memory_mib, disk_gib, created_at, "
        "started_at, pause_mode) VALUES ('sb-00000000000a', 'base', 'running', 2, 2048, 4, 1, 1, "
        "NULL), ('sb-00000000000b', 'base', 'paused', 1, 1024, 4, 1, 1, 'memory'), "
        "('sb-00000000000c', 'base', 'destroyed', 1, 1024, 4, 1, 1, NULL)"
    )
    db.execute("UPDATE sandboxes SET project = 'other' WHERE id = 'sb-00000000000b'")
    db.execute(
        "INSERT INTO snapshots (id, name, sandbox_id, image, vcpus, memory_mib, disk_gib, "
        "path, size_bytes, created_at) VALUES ('snap-00000000000a', 's', 'sb-00000000000a', "
        "'base', 2, 2048, 4, '/x', 1000000000, 1)"
    )
    db.commit()
    db.close()
    import time

    before = time.time()
    store = Store(path)
    after = time.time()
    assert store.schema_version() == len(MIGRATIONS)
    rows = MeterStore(store).intervals(project=None, start=0, end=1e12)
    got = {(r.subject, r.kind) for r in rows}
    assert got == {
        ("sb-00000000000a", "vcpu"),
        ("sb-00000000000a", "memory"),
        ("sb-00000000000a", "disk"),
        ("sb-00000000000b", "memory_paused"),
        ("sb-00000000000b", "disk"),
        ("snap-00000000000a", "snapshot"),
    }
    assert all(before - 1 <= r.started_at <= after + 1 and r.ended_at is None for r in rows)
    assert {r.project for r in rows if r.subject == "sb-00000000000b"} == {"other"}
    # The old rows stay readable, and the meter moves on from them.
    clock = Clock(after + 60)
    st = SandboxStates(store, clock=clock)
    st.move("sb-00000000000a", S.STOPPING)
    st.ended("sb-00000000000a", S.DESTROYED)
    first = total(MeterStore(store), clock, 0, 1e12)
    store.close()
    reopened = Store(path)
    again = total(MeterStore(reopened), clock, 0, 1e12)
    assert [(r.key, r.vcpu_seconds) for r in again.rows] == [
        (r.key, r.vcpu_seconds) for r in first.rows
    ]
    (a,) = [r for r in again.rows if r.key == "sb-00000000000a"]
    assert a.vcpu_seconds == pytest.approx(2 * (after + 60 - a_start(rows)), abs=2.5)


def a_start(rows: list[IntervalRow]) -> float:
    return next(r.started_at for r in rows if r.subject == "sb-00000000000a")


def test_metrics_render_the_text_format() -> None:
    m = Metrics()
    m.on_event("sandbox.created", {"from": "template"})
    m.on_event("sandbox.created", {"from": "cold"})
    m.on_event("sandbox.exec", {"exit_code": 0, "signal": None, "timed_out": False})
    m.on_event("sandbox.exec", {"exit_code": 3, "signal": None, "timed_out": False})
    with m.timed("create"):
        pass
    text = m.render(
        states={"running": 2, "paused": 1, "destroyed": 9},
        capacity={"sandboxes": 3, "max_sandboxes": 64, "memory_mib": 2048,
                  "memory_budget_mib": 8192},
        egress=(5, 7),
    )  # fmt: skip
    lines = text.splitlines()
    assert 'hutch_sandboxes{state="running"} 2' in lines
    assert not any("destroyed" in line for line in lines)
    assert 'hutch_create_duration_seconds_bucket{le="+Inf"} 1' in lines
    assert "hutch_create_duration_seconds_count 1" in lines
    assert "hutch_template_hit_ratio 0.500000" in lines
    assert 'hutch_execs_total{outcome="nonzero"} 1' in lines
    assert 'hutch_egress_decisions_total{decision="denied"} 7' in lines
    assert "hutch_capacity_memory_mib 2048" in lines
    for line in lines:  # every sample line: name{labels} value
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            float(value)
            assert name.replace("_", "a").replace("{", "a")[0].isalpha()


def test_meter_settings_and_prices_are_configurable() -> None:
    s = load_settings({"HUTCH_PRICE_VCPU_HOUR": "1.5", "HUTCH_EVENTS_RETENTION_DAYS": "7"})
    assert s.meter.price_vcpu_hour == 1.5 and s.meter.events_retention_days == 7
    assert s.meter.price_gib_hour == 0.01159025 and s.meter.price_storage_gb_hour == 0.0001584
    with pytest.raises(InvalidArgument, match=r"HUTCH_EVENTS_MAX='10'.*1000"):
        load_settings({"HUTCH_EVENTS_MAX": "10"})
    with pytest.raises(InvalidArgument, match="HUTCH_PRICE_EGRESS_GB='free'"):
        load_settings({"HUTCH_PRICE_EGRESS_GB": "free"})
