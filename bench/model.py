"""What a benchmark produces: metrics, each with a same-run baseline. Pure data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bench.stats import Better, Summary, ratio, summarize

__all__ = ["MAX_STORED_SAMPLES", "BenchResult", "Metric", "SampleSet"]

#: Results are committed; a metric keeps at most this many raw samples (the summary
#: always covers all of them).
MAX_STORED_SAMPLES = 500


@dataclass
class SampleSet:
    """Samples of one quantity. ``value`` overrides the headline (p50) when the number
    that matters is not a per-sample statistic, e.g. total requests / elapsed seconds."""

    label: str
    samples: list[float]
    value: float | None = None

    @property
    def summary(self) -> Summary:
        return summarize(self.samples)

    @property
    def headline(self) -> float:
        return self.value if self.value is not None else self.summary.p50

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"label": self.label}
        if self.value is not None:
            out["value"] = self.value
        out["summary"] = self.summary.to_dict()
        out["samples"] = [round(s, 9) for s in self.samples[:MAX_STORED_SAMPLES]]
        if len(self.samples) > MAX_STORED_SAMPLES:
            out["samples_truncated"] = True
        return out


@dataclass
class Metric:
    """One measured quantity of hutch and the host baseline it is compared with.

    ``ratio`` is hutch ÷ baseline of the headline numbers (p50 unless a ``value`` is
    set): with ``better="lower"`` (times) 10 means ten times slower than the baseline;
    with ``better="higher"`` (rates) 0.1 means a tenth of the baseline's rate.
    """

    name: str
    unit: str
    better: Better
    description: str
    hutch: SampleSet
    baseline: SampleSet | None = None

    @property
    def ratio(self) -> float | None:
        if self.baseline is None:
            return None
        return ratio(self.hutch.headline, self.baseline.headline)

    @property
    def ratio_p95(self) -> float | None:
        if self.baseline is None or self.hutch.value is not None:
            return None
        return ratio(self.hutch.summary.p95, self.baseline.summary.p95)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "unit": self.unit,
            "better": self.better,
            "description": self.description,
            "hutch": self.hutch.to_dict(),
            "baseline": self.baseline.to_dict() if self.baseline else None,
            "ratio": self.ratio,
            "ratio_p95": self.ratio_p95,
        }


@dataclass
class BenchResult:
    """Everything one benchmark found in one run."""

    name: str
    title: str
    quick: bool
    params: dict[str, Any]
    started_at: str = ""
    finished_at: str = ""
    host: dict[str, Any] = field(default_factory=dict)
    metrics: list[Metric] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": 1,
            "benchmark": self.name,
            "title": self.title,
            "quick": self.quick,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "params": self.params,
            "host": self.host,
            "metrics": [m.to_dict() for m in self.metrics],
            "notes": self.notes,
            "error": self.error,
        }
