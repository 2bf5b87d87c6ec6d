"""Egress into the meter and the event log: the egress log's tallies, the counted meter
kinds and :class:`hutch.services.egress_meter.EgressMeter` on a real SQLite store with an
injected clock (the real-VM proof is tests/vm/test_egress_meter.py)."""

from __future__ import annotations

from pathlib import Path

from hutch.contract.views import EgressEvent
from hutch.net.egress_log import DenialTally, EgressLog
from hutch.services.egress_meter import EgressMeter
from hutch.services.events import EventLog
from hutch.services.metering import COUNTED_ROW_S, Prices, usage
from hutch.services.state import SandboxStates
from hutch.store import Store
from hutch.store.meter import MeterStore
from tests.unit.fake_clock import Clock
from tests.unit.test_metering import START, record

SID = "sb-000000000001"


def _denial(sid: str, dest: str, reason: str = "policy", port: int = 7) -> EgressEvent:
    return EgressEvent(0.0, sid, dest, port, "udp", None, "deny", None, reason)


def test_a_flood_of_denials_is_one_tally_per_sandbox() -> None:
    log = EgressLog(spike_per_min=100)
    for i in range(10_000):
        log.record(_denial(SID, f"198.18.0.{i % 200}"))  # counted (resolver/proxy)
    log.add_bytes(SID, sent=1000, denied=5000, denials=40)  # nft's growth since the last read
    taken = log.take_denials()
    assert list(taken) == [SID]
    tally = taken[SID]
    assert tally.denials == 10_040 and tally.bytes == 5000 and tally.spike
    assert len(tally.top) == 5  # a bounded sample, whatever the flood
    assert sum(n for *_, n in tally.top) + tally.other == 10_000
    assert log.take_denials() == {}  # zeroed
    assert log.take_bytes() == {SID: (1000, 5000)}
    assert log.take_bytes() == {}


def test_a_forgotten_sandbox_keeps_its_tally_until_taken() -> None:
    log = EgressLog()
    log.record(_denial(SID, "198.18.0.9"), count=False)  # an NFLOG line: nft counts it
    log.add_bytes(SID, sent=10, denials=1)
    log.forget(SID)
    assert log.take_bytes() == {SID: (10, 0)}
    denials = log.take_denials()
    assert denials[SID] == DenialTally(1, 0, (("198.18.0.9", 7, "policy", 1),), 0, False)
    assert log._tallies == {}  # nothing left to take: dropped


class _Source:
    def __init__(self) -> None:
        self.log = EgressLog()

    def take_bytes(self) -> dict[str, tuple[int, int]]:
        return self.log.take_bytes()

    def take_denials(self) -> dict[str, DenialTally]:
        return self.log.take_denials()

    def add_back(self, sandbox_id: str, sent: int, denied: int) -> None:
        self.log.add_bytes(sandbox_id, sent=sent, denied=denied)


def _meter(tmp_path: Path, clock: Clock) -> tuple[EgressMeter, _Source, MeterStore, EventLog]:
    store = Store(tmp_path / "hutch.db")
    meter = MeterStore(store)
    events = EventLog(meter, retention_s=86400, max_events=1000, clock=clock)
    SandboxStates(store, events, clock=clock).insert(record(clock, SID))
    source = _Source()
    return EgressMeter(store, events, lambda: source, clock), source, meter, events


def test_bytes_are_written_once_in_a_row_a_minute_and_priced(tmp_path: Path) -> None:
    clock = Clock(START)
    t0 = clock.now
    em, source, meter, _ = _meter(tmp_path, clock)
    for step in range(10):  # ten heartbeats in one row
        clock.now = t0 + step
        source.log.add_bytes(SID, sent=1_000_000, denied=100)
        em.flush_bytes()
    em.flush_bytes()  # nothing new: nothing written
    clock.now = t0 + COUNTED_ROW_S + 5  # a new row after a minute
    source.log.add_bytes(SID, sent=500)
    em.flush_bytes()
    rows = [
        r for r in meter.intervals(project=None, start=t0 - 1, end=t0 + 999) if "egress" in r.kind
    ]
    assert sorted((r.kind, r.quantity) for r in rows) == [
        ("egress", 500.0),
        ("egress", 10_000_000.0),
        ("egress_denied", 1000.0),
    ]
    prices = Prices(egress_gb=2.0)
    got = usage(
        meter.intervals(project=None, start=t0, end=t0 + 999),
        start=t0, end=t0 + 999, now=clock(), group_by="sandbox", prices=prices,
    )  # fmt: skip
    (row,) = got.rows
    assert row.egress_allowed_bytes == 10_000_500 and row.egress_denied_bytes == 1000
    storage = row.disk_gb_hours * prices.storage_gb_hour
    assert abs(row.cost_usd - storage - 10_000_500 / 1e9 * 2.0) < 1e-12
    # A window that starts after the first row gets only the second.
    late = usage(
        meter.intervals(project=None, start=t0 + 30, end=t0 + 999),
        start=t0 + 30, end=t0 + 999, now=clock(), group_by="day", prices=prices,
    )  # fmt: skip
    assert late.total.egress_allowed_bytes == 500


def test_denials_are_one_event_per_sandbox_per_interval(tmp_path: Path) -> None:
    clock = Clock(START)
    em, source, _, events = _meter(tmp_path, clock)
    em.flush_denials(60)  # starts the interval
    for _ in range(5000):
        source.log.record(_denial(SID, "198.18.0.20"))
    source.log.add_bytes(SID, denied=2640, denials=5)
    clock.now += 30
    em.flush_denials(60)  # not yet
    assert events.page(project=None, types=["egress.denied"]) == []
    clock.now += 31
    em.flush_denials(60)
    (event,) = events.page(project=None, types=["egress.denied"])
    assert event.sandbox_id == SID and event.project == "default"
    assert event.data["denials"] == 5005 and event.data["bytes"] == 2640
    assert event.data["top"] == [
        {"destination": "198.18.0.20", "port": 7, "reason": "policy", "count": 5000}
    ]
    assert event.data["window_s"] == 61.0
    clock.now += 61
    em.flush_denials(60)  # nothing denied since: no event
    assert len(events.page(project=None, types=["egress.denied"])) == 1
