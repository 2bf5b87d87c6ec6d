"""The benchmark harness's pure helpers: percentiles, summaries, ratios, formatting, and
the bookkeeping of the create_paths / pause_resume / fork cases (no daemon, no VM)."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import pytest
from bench.cases.coldboot import reference_or_measured
from bench.cases.common import BenchContext
from bench.cases.create_paths import PoolGauge
from bench.cases.pause_resume import HOLDER, holder_command
from bench.daemon import PrivateDaemon
from bench.model import BenchResult, Metric, SampleSet
from bench.report import reading, render_table
from bench.stats import format_quantity, format_ratio, percentile, ratio, summarize

from hutch.sdk import Client


def test_percentile_interpolates_like_numpy_default() -> None:
    samples = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(samples, 0) == 1.0
    assert percentile(samples, 100) == 4.0
    assert percentile(samples, 50) == pytest.approx(2.5)
    assert percentile(samples, 95) == pytest.approx(3.85)
    assert percentile([7.0], 95) == 7.0


@pytest.mark.parametrize("q", [-1.0, 100.5])
def test_percentile_rejects_q_out_of_range(q: float) -> None:
    with pytest.raises(ValueError, match="outside 0-100"):
        percentile([1.0], q)


def test_percentile_and_summary_reject_no_samples() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        summarize([])


def test_summarize() -> None:
    s = summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert (s.n, s.min, s.max, s.p50) == (5, 1.0, 100.0, 3.0)
    assert s.mean == pytest.approx(22.0)
    assert s.p95 == pytest.approx(80.8)
    assert summarize([5.0]).stdev == 0.0


def test_ratio_guards_zero_and_non_finite() -> None:
    assert ratio(10.0, 2.0) == 5.0
    assert ratio(1.0, 0.0) is None
    assert ratio(math.inf, 1.0) is None


@pytest.mark.parametrize(
    ("value", "text"),
    [(None, "-"), (1234.4, "1,234x"), (39.27, "39.3x"), (1.234, "1.23x"), (0.002149, "0.00215x")],
)
def test_format_ratio(value: float | None, text: str) -> None:
    assert format_ratio(value) == text


@pytest.mark.parametrize(
    ("value", "unit", "text"),
    [
        (13.3, "s", "13.3 s"),
        (0.1336, "s", "134 ms"),
        (0.0000421, "s", "42.1 µs"),
        (1254.2, "MB/s", "1,254 MB/s"),
        (6.25, "req/s", "6.25 req/s"),
    ],
)
def test_format_quantity(value: float, unit: str, text: str) -> None:
    assert format_quantity(value, unit) == text


def test_metric_ratio_and_reading_follow_direction() -> None:
    slow = Metric("t", "s", "lower", "", SampleSet("h", [2.0, 4.0]), SampleSet("b", [1.0]))
    assert slow.ratio == 3.0
    assert reading(slow) == "3.00x slower"
    rate = Metric(
        "r", "req/s", "higher", "", SampleSet("h", [1.0], value=5.0), SampleSet("b", [100.0])
    )
    assert rate.ratio == pytest.approx(0.05)
    assert rate.ratio_p95 is None  # a rate's headline is not a per-sample statistic
    assert reading(rate) == "20.0x slower"
    fast = Metric("f", "s", "lower", "", SampleSet("h", [1.0]), SampleSet("b", [4.0]))
    assert reading(fast) == "4.00x faster"
    alone = Metric("a", "s", "lower", "", SampleSet("h", [1.0]))
    assert alone.ratio is None and reading(alone) == ""


def test_sample_set_json_is_capped_but_summary_covers_all() -> None:
    big = SampleSet("h", [float(i) for i in range(1000)])
    doc = big.to_dict()
    assert len(doc["samples"]) == 500 and doc["samples_truncated"] is True
    assert doc["summary"]["n"] == 1000 and doc["summary"]["max"] == 999.0


def test_render_table_lists_every_metric() -> None:
    ok = BenchResult("exec", "t", False, {})
    ok.metrics = [
        Metric("exec_round_trip", "s", "lower", "", SampleSet("h", [0.1]), SampleSet("b", [0.001]))
    ]
    bad = BenchResult("files", "t", False, {}, error="RuntimeError: boom")
    table = render_table([ok, bad])
    assert "exec_round_trip" in table and "100x" in table and "100 ms" in table
    assert "FAILED" in table and "boom" in table


# -- helpers of create_paths / pause_resume / fork ------------------------------------


def _ctx(tmp_path: Path) -> BenchContext:
    daemon = PrivateDaemon(tmp_path, tmp_path / "work", tmp_path / "images", None)
    client = Client(base_url="http://127.0.0.1:9", api_key="k")
    return BenchContext(daemon, client, "base", True, tmp_path, lambda _: None)


def test_pool_gauge_counts_fills_against_takes(tmp_path: Path) -> None:
    log = tmp_path / "hutchd.log"
    gauge = PoolGauge(log, "base")
    assert gauge.filled() == 0  # no log yet
    log.write_text(
        "x INFO hutch.services.pool: warm pool for base: 1 ready\n"
        "x INFO hutch.services.pool: warm pool for other: 1 ready\n"
        "x WARNING hutch.services.pool: warm pool for base: boom\n"
    )
    assert gauge.filled() == 1
    assert gauge.wait_ready(timeout_s=0.5) < 0.5
    gauge.taken = 1
    with pytest.raises(RuntimeError, match="did not refill"):
        gauge.wait_ready(timeout_s=0.2)


def test_cold_reference_is_measured_once_then_shared(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    try:
        notes: list[str] = []
        with pytest.raises(RuntimeError, match="no cold boots"):
            reference_or_measured(ctx, 512, [], notes)
        first = reference_or_measured(ctx, 512, [3.0, 5.0], notes)
        assert first.summary.p50 == 4.0 and "measured in this benchmark" in notes[-1]
        again = reference_or_measured(ctx, 512, [99.0], notes)
        assert again is first and "earlier benchmark" in notes[-1]
    finally:
        ctx.client.close()


def test_holder_script_compiles_and_survives_shell_quoting() -> None:
    compile(HOLDER, "<holder>", "exec")
    argv = shlex.split(holder_command())
    assert argv[:3] == ["setsid", "-f", "python3"] and argv[4] == HOLDER
