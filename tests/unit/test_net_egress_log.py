"""The per-sandbox egress ring and counters."""

from __future__ import annotations

import pytest

from hutch.contract.views import EgressEvent, Verdict
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
