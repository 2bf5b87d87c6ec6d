"""Result files and the human table."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.model import BenchResult, Metric
from bench.stats import format_quantity, format_ratio

__all__ = ["reading", "render_table", "utc_stamp", "write_results"]


def utc_stamp(moment: datetime | None = None) -> str:
    """``20250131T235959Z``: sortable, safe in file names."""
    return (moment or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")


def _atomic_write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def write_results(results_dir: Path, results: list[BenchResult], stamp: str) -> list[Path]:
    """Write ``<name>-<stamp>.json`` per result and merge the successful ones into
    ``latest.json`` (newest result per benchmark, so a one-benchmark run keeps the
    others' latest numbers). Returns the paths written."""
    results_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for result in results:
        path = results_dir / f"{result.name}-{stamp}.json"
        _atomic_write(path, result.to_dict())
        written.append(path)
    latest_path = results_dir / "latest.json"
    latest: dict[str, Any] = {"schema": 1, "benchmarks": {}}
    if latest_path.is_file():
        try:
            previous = json.loads(latest_path.read_text())
            if isinstance(previous, dict) and isinstance(previous.get("benchmarks"), dict):
                latest = previous
        except json.JSONDecodeError:
            pass  # a damaged latest.json is replaced, the per-run files stay
    for result in results:
        if result.error is None:
            latest["benchmarks"][result.name] = {
                "file": f"{result.name}-{stamp}.json",
                **result.to_dict(),
            }
    latest["updated_at"] = stamp
    _atomic_write(latest_path, latest)
    written.append(latest_path)
    return written


def reading(metric: Metric) -> str:
    """The ratio in words: how many times slower or faster than the baseline."""
    r = metric.ratio
    if r is None or r <= 0:
        return ""
    slower = r if metric.better == "lower" else 1 / r
    if slower >= 1:
        return f"{format_ratio(slower)} slower"
    return f"{format_ratio(1 / slower)} faster"


def render_table(results: list[BenchResult]) -> str:
    """A compact fixed-width table: hutch p50/p95 (or the rate), baseline, ratio."""
    header = ("benchmark", "metric", "hutch", "hutch p95", "baseline", "ratio", "reading")
    rows: list[tuple[str, ...]] = []
    for result in results:
        if result.error is not None:
            rows.append((result.name, "FAILED", result.error.splitlines()[0][:60], "", "", "", ""))
            continue
        for m in result.metrics:
            hutch_p95 = (
                "" if m.hutch.value is not None else format_quantity(m.hutch.summary.p95, m.unit)
            )
            rows.append(
                (
                    result.name,
                    m.name,
                    format_quantity(m.hutch.headline, m.unit),
                    hutch_p95,
                    format_quantity(m.baseline.headline, m.unit) if m.baseline else "",
                    format_ratio(m.ratio) if m.baseline else "",
                    reading(m),
                )
            )
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    lines.append("hutch/baseline = p50 (rates: total count / elapsed); ratio = hutch / baseline")
    return "\n".join(lines)
