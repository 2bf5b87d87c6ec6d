"""The per-sandbox egress ring and counters."""

from __future__ import annotations

import pytest

from hutch.contract.views import DenialSpike, EgressEvent, Verdict
from hutch.net.egress_log import EgressLog


def event(sid: str, n: int, verdict: Verdict = "allow") -> EgressEvent:
    return EgressEvent(float(n), sid, f"198.18.0.{n % 250}", 443, "tls", "good.test", verdict,
                       "good.test" if verdict == "allow" else None, "because")  # fmt: skip


def test_ring_keeps_the_newest_last_and_counters_count_everything() -> None:
    log = EgressLog(capacity=3)
    for n in range(5):
        log.record(event("sb-a", n, "allow" if n % 2 == 0 else "deny"))
    assert [e.time for e in log.events("sb-a")] == [2.0, 3.0, 4.0]
    assert [e.time for e in log.events("sb-a", 2)] == [3.0, 4.0]
    assert log.events("sb-a", 0) == []
    assert log.events("sb-a", 100) == log.events("sb-a")
    assert log.counters("sb-a") == (3, 2)


def test_sandboxes_are_separate_and_forget_is_idempotent() -> None:
    log = EgressLog()
    log.record(event("sb-a", 1))
    log.record(event("sb-b", 2, "deny"))
    assert log.counters("sb-a") == (1, 0)
    assert log.counters("sb-b") == (0, 1)
    assert log.events("sb-c") == [] and log.counters("sb-c") == (0, 0)
    log.forget("sb-a")
    log.forget("sb-a")
    assert log.events("sb-a") == [] and log.counters("sb-a") == (0, 0)
    assert len(log.events("sb-b")) == 1


def test_default_capacity_and_bad_arguments() -> None:
    log = EgressLog()
    for n in range(1500):
        log.record(event("sb-a", n))
    assert len(log.events("sb-a")) == 1000
    assert log.counters("sb-a") == (1500, 0)
    with pytest.raises(ValueError):
        EgressLog(capacity=0)
    with pytest.raises(ValueError):
        log.events("sb-a", -1)


def test_rule_counts_by_index_and_reset() -> None:
    log = EgressLog()
    for n, verdict, index in [(1, "allow", 1), (2, "allow", 1), (3, "deny", 0), (4, "deny", None)]:
        e = event("sb-a", n, verdict)  # type: ignore[arg-type]
        log.record(EgressEvent(**{**e.__dict__, "rule_index": index}))
    log.record(EgressEvent(**{**event("sb-a", 5, "deny").__dict__, "rule_index": 0}), count=False)
    assert [(c.index, c.allowed, c.denied) for c in log.rule_counts("sb-a")] == [
        (0, 0, 1),
        (1, 2, 0),
    ]
    assert log.rule_counts("sb-b") == ()
    log.reset_rule_counts("sb-a")
    assert log.rule_counts("sb-a") == ()
    assert log.counters("sb-a") == (2, 2)  # the totals stay


def test_a_denial_spike_fires_once_per_minute_at_the_threshold() -> None:
    now = [600.0]
    spikes: list[DenialSpike] = []
    log = EgressLog(spike_per_min=3, on_spike=spikes.append, clock=lambda: now[0])
    for n in range(2):
        log.record(event("sb-a", n, "deny"))
    log.record(event("sb-a", 9, "allow"))
    log.record(event("sb-a", 3, "deny"), count=False)  # counted elsewhere: not a decision here
    log.record(event("sb-b", 1, "deny"))  # another sandbox: its own minute
    assert spikes == []
    log.record(event("sb-a", 4, "deny"))
    assert [(s.sandbox_id, s.denials, s.threshold) for s in spikes] == [("sb-a", 3, 3)]
    assert spikes[0].last.time == 4.0
    summary = log.events("sb-a")[-1]
    assert summary.protocol == "summary" and "denial spike: 3 denials this minute" in summary.reason
    log.record(event("sb-a", 5, "deny"))
    assert len(spikes) == 1  # once per minute
    now[0] = 660.0  # the next minute counts from zero
    for n in range(3):
        log.record(event("sb-a", 10 + n, "deny"))
    assert len(spikes) == 2
    assert log.counters("sb-a")[1] == 7  # the summary lines are not denials


def test_no_spike_watch_without_a_threshold() -> None:
    log = EgressLog()
    for n in range(500):
        log.record(event("sb-a", n, "deny"))
    assert all(e.protocol != "summary" for e in log.events("sb-a"))
