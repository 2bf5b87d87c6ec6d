"""The per-sandbox token buckets of the data path (hutch.net.ratelimit), on a fake clock."""

from __future__ import annotations

import pytest

from hutch.errors import InvalidArgument
from hutch.net import ratelimit
from hutch.net.ratelimit import KeyedLimiter, Rate
from tests.unit.fake_clock import Clock


def test_burst_then_rate_then_refused_and_counted() -> None:
    clock = Clock()
    limiter = KeyedLimiter(Rate(10, 5), clock)
    assert [limiter.allow("10.0.0.2") for _ in range(7)] == [True] * 5 + [False] * 2
    clock.now += 0.25  # 2.5 tokens flow in
    assert [limiter.allow("10.0.0.2") for _ in range(3)] == [True, True, False]
    clock.now += 60  # a long quiet spell refills only up to the burst
    assert sum(limiter.allow("10.0.0.2") for _ in range(20)) == 5
    assert limiter.take_refused() == {"10.0.0.2": 2 + 1 + 15}
    assert limiter.take_refused() == {}, "counts are handed over once"


def test_one_senders_flood_leaves_anothers_bucket_alone() -> None:
    clock = Clock()
    limiter = KeyedLimiter(Rate(100, 200), clock)
    flood = sum(limiter.allow("10.0.0.2") for _ in range(100_000))
    assert flood == 200
    assert all(limiter.allow("10.0.0.6") for _ in range(200))
    assert limiter.take_refused() == {"10.0.0.2": 100_000 - 200}


def test_refuse_counts_without_taking_a_token() -> None:
    limiter = KeyedLimiter(Rate(1, 1), Clock())
    limiter.refuse("a")
    assert limiter.allow("a") is True
    assert limiter.take_refused() == {"a": 1}


def test_bucket_count_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ratelimit, "MAX_KEYS", 8)
    clock = Clock()
    limiter = KeyedLimiter(Rate(1, 2), clock)
    for i in range(8):
        limiter.allow(f"k{i}")
    clock.now += 10  # all idle and full again: forgotten when a new sender comes
    limiter.allow("new")
    assert len(limiter._buckets) == 1
    for i in range(20):  # busy senders: the table starts over instead of growing
        limiter.allow(f"b{i}")
    assert len(limiter._buckets) <= 8


@pytest.mark.parametrize(("rate", "burst"), [(0, 1), (-1, 5), (1, 0)])
def test_bad_rates_are_refused(rate: float, burst: int) -> None:
    with pytest.raises(InvalidArgument):
        Rate(rate, burst)
    assert str(Rate(200, 400)) == "200/s, burst 400"
