"""Pure statistics and formatting helpers. No I/O, no clocks: easy to test."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

__all__ = [
    "Better",
    "Summary",
    "format_quantity",
    "format_ratio",
    "percentile",
    "ratio",
    "summarize",
]

#: Which direction is good for a metric: ``lower`` for times, ``higher`` for rates.
Better = Literal["lower", "higher"]


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks
    (numpy's default, "type 7"). Raises ``ValueError`` on no samples or q out of range."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q={q} is outside 0-100")
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return float(ordered[lo])
    frac = pos - lo
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * frac)


@dataclass(frozen=True)
class Summary:
    """Order statistics of one sample set, in the samples' unit."""

    n: int
    min: float
    p50: float
    p95: float
    max: float
    mean: float
    stdev: float

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def summarize(samples: Sequence[float]) -> Summary:
    """Summary of ``samples``; ``stdev`` is the sample standard deviation (0 for n=1).
    Raises ``ValueError`` on no samples."""
    if not samples:
        raise ValueError("summary of no samples")
    values = [float(s) for s in samples]
    return Summary(
        n=len(values),
        min=min(values),
        p50=percentile(values, 50),
        p95=percentile(values, 95),
        max=max(values),
        mean=statistics.fmean(values),
        stdev=statistics.stdev(values) if len(values) > 1 else 0.0,
    )


def ratio(value: float, baseline: float) -> float | None:
    """``value / baseline``; None when the baseline is zero or either is not finite."""
    if baseline == 0 or not math.isfinite(value) or not math.isfinite(baseline):
        return None
    return value / baseline


def format_ratio(r: float | None) -> str:
    """A ratio as ``12.3x``: three significant digits below 100, whole numbers above,
    ``-`` when there is none."""
    if r is None or not math.isfinite(r):
        return "-"
    if r >= 100:
        return f"{r:,.0f}x"
    if r >= 10:
        return f"{r:.1f}x"
    if r >= 1:
        return f"{r:.2f}x"
    return f"{r:.3g}x"


def format_quantity(value: float, unit: str) -> str:
    """A number with its unit, scaled for reading: seconds become ms or µs when small;
    other units get three significant digits."""
    if not math.isfinite(value):
        return "-"
    if unit == "s":
        magnitude = abs(value)
        if magnitude >= 1 or magnitude == 0:
            return f"{value:.3g} s" if magnitude < 100 else f"{value:.0f} s"
        if magnitude >= 1e-3:
            return f"{value * 1e3:.3g} ms"
        return f"{value * 1e6:.3g} µs"
    if abs(value) >= 1000:
        return f"{value:,.0f} {unit}"
    return f"{value:.3g} {unit}"
