"""Prometheus metrics of one daemon (``GET /metrics``, text format 0.0.4).

Counters and histograms live in memory (they restart at zero with the daemon, as
Prometheus expects of a counter); gauges are read when scraped: sandboxes by state from
the store, host capacity, egress decisions from the network layer. Creates, execs and
their origins are counted from the event log (:meth:`Metrics.on_event`), so every path
that records an event is counted once, by the same code.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

from hutch.models import SandboxState

__all__ = ["LATENCY_BUCKETS_S", "Histogram", "Metrics"]

#: Upper bounds (seconds) of the latency histograms: micro-VM creates take 0.1-30 s here.
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: +Inf only
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        out, running = [], 0
        sep = "," if labels else ""
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            running += n
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {running}')
        suffix = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{suffix} {self.sum:.6f}")
        out.append(f"{name}_count{suffix} {self.count}")
        return out


class Metrics:
    OPERATIONS = ("create", "pause", "resume", "fork", "snapshot")

    def __init__(self) -> None:
        self.latency = {op: Histogram() for op in self.OPERATIONS}
        self.creates: Counter[str] = Counter()  # by origin: cold, template, pool, ...
        self.execs: Counter[str] = Counter()  # ok, nonzero, signal, timeout, detached
        self.events: Counter[str] = Counter()

    @contextlib.contextmanager
    def timed(self, operation: str) -> Iterator[None]:
        """Observe the block's duration if it succeeds (a refused call is not a latency)."""
        start = time.monotonic()
        yield
        self.latency[operation].observe(time.monotonic() - start)

    def on_event(self, type: str, data: Mapping[str, Any]) -> None:
        self.events[type] += 1
        if type == "sandbox.created":
            self.creates[str(data.get("from", "cold"))] += 1
        elif type == "sandbox.exec":
            if data.get("timed_out"):
                outcome = "timeout"
            elif data.get("signal") is not None:
                outcome = "signal"
            elif data.get("exit_code") is None:
                outcome = "detached"
            else:
                outcome = "ok" if data.get("exit_code") == 0 else "nonzero"
            self.execs[outcome] += 1

    def render(
        self,
        *,
        states: Mapping[str, int],
        capacity: Mapping[str, float],
        egress: tuple[int, int],
    ) -> str:
        """The text exposition: ``states`` sandboxes by state, ``capacity`` (sandboxes,
        max_sandboxes, memory_mib, memory_budget_mib), ``egress`` (allowed, denied)."""
        out: list[str] = []

        def family(name: str, kind: str, help_: str) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")

        family("hutch_sandboxes", "gauge", "Sandboxes by state (ended ones excluded).")
        for state in SandboxState:
            if state.is_live:
                out.append(f'hutch_sandboxes{{state="{state}"}} {states.get(str(state), 0)}')
        for op in self.OPERATIONS:
            name = f"hutch_{op}_duration_seconds"
            family(name, "histogram", f"Seconds a successful {op} took.")
            out.extend(self.latency[op].lines(name))
        family("hutch_creates_total", "counter", "Sandboxes created, by what they came from.")
        for origin in ("cold", "template", "pool", "snapshot", "fork"):
            out.append(f'hutch_creates_total{{from="{origin}"}} {self.creates[origin]}')
        booted = sum(self.creates[o] for o in ("cold", "template", "pool"))
        family("hutch_template_hit_ratio", "gauge", "Of creates from an image, from a template.")
        out.append(f"hutch_template_hit_ratio {_ratio(self.creates['template'], booted)}")
        family("hutch_pool_hit_ratio", "gauge", "Of creates from an image, from the warm pool.")
        out.append(f"hutch_pool_hit_ratio {_ratio(self.creates['pool'], booted)}")
        family("hutch_execs_total", "counter", "Commands run (exec), by how they ended.")
        for outcome in ("ok", "nonzero", "signal", "timeout", "detached"):
            out.append(f'hutch_execs_total{{outcome="{outcome}"}} {self.execs[outcome]}')
        family(
            "hutch_egress_decisions_total",
            "counter",
            "Egress connections and packets of running sandboxes allowed and denied "
            "(since the daemon started).",
        )
        out.append(f'hutch_egress_decisions_total{{decision="allowed"}} {egress[0]}')
        out.append(f'hutch_egress_decisions_total{{decision="denied"}} {egress[1]}')
        for key, help_ in (
            ("sandboxes", "Live sandboxes on this host."),
            ("max_sandboxes", "Live sandboxes this host admits (HUTCH_MAX_SANDBOXES)."),
            ("memory_mib", "MiB of memory reserved by sandboxes with a VM."),
            ("memory_budget_mib", "MiB of memory sandboxes may reserve (HUTCH_MAX_MEMORY_MIB)."),
        ):
            family(f"hutch_capacity_{key}", "gauge", help_)
            out.append(f"hutch_capacity_{key} {capacity.get(key, 0):g}")
        family("hutch_events_total", "counter", "Events recorded, by type.")
        for type_, n in sorted(self.events.items()):
            out.append(f'hutch_events_total{{type="{type_}"}} {n}')
        return "\n".join(out) + "\n"


def _ratio(part: int, whole: int) -> str:
    return f"{part / whole:.6f}" if whole else "0"
