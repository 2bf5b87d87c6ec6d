"""What a sandbox is billed for in each state, and usage from the recorded intervals.

Pure (no I/O): the state writer (:mod:`hutch.services.state`) asks :func:`held` for the
states before and after a transition and writes the difference (:func:`changes`) as
meter intervals in the same transaction; :func:`usage` adds up the intervals that
overlap a window and prices them. Quantities:

=================  ============================================  ========================
kind               held while                                    quantity
=================  ============================================  ========================
``vcpu``           running, pausing, resuming (a QEMU runs)      vCPUs
``memory``         running, pausing, resuming                    GiB of guest RAM
``memory_paused``  paused in memory mode (its state is on disk)  GiB of guest RAM
``disk``           live (created .. destroyed or failed)         GB of its disk size
``snapshot``       a ready named or fork snapshot, until deleted  GB of its files
``image``          an imported or built image, until removed     GB of its content
=================  ============================================  ========================

Counted kinds (:data:`COUNTED_KINDS`) are amounts, not quantities held over time: a row
``[started_at, ended_at]`` holds ``quantity`` bytes counted in that span (the egress meter,
:mod:`hutch.services.egress_meter`, adds to its latest row for up to
:data:`COUNTED_ROW_S`), and a window gets the whole row when it contains ``started_at``:

=================  =====================================================================
``egress``         bytes a sandbox sent out: forwarded from its tap (nft) or relayed by
                   the egress proxy; priced per GB (``HUTCH_PRICE_EGRESS_GB``)
``egress_denied``  bytes of its packets nft dropped (not priced)
=================  =====================================================================

GB is 10^9 bytes (the storage price counts them so); a disk of ``disk_gib`` GiB is
``disk_gib * 1.073741824`` GB.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from hutch.contract.usage import UsageRow
from hutch.models import PauseMode, SandboxState, Shape
from hutch.store.meter import IntervalRow

__all__ = [
    "COUNTED_KINDS",
    "COUNTED_ROW_S",
    "GROUP_BY",
    "KINDS",
    "Prices",
    "Usage",
    "UsageRow",
    "changes",
    "held",
    "overlap",
    "usage",
]

S = SandboxState
GIB_IN_GB = (1 << 30) / 1e9
#: States in which a sandbox has a QEMU process (billed vCPU and memory).
COMPUTE_STATES = frozenset({S.RUNNING, S.PAUSING, S.RESUMING})
KINDS = ("vcpu", "memory", "memory_paused", "disk", "snapshot", "image")
#: Amounts counted when they happen (bytes), summed rather than multiplied by time.
COUNTED_KINDS = ("egress", "egress_denied")
#: A counted row gathers what is counted for this long (at most), then a new row opens:
#: how far off a window's edge an amount may be attributed.
COUNTED_ROW_S = 60.0
GROUP_BY = ("sandbox", "day", "project")


@dataclass(frozen=True)
class Prices:
    """USD per unit-hour (the issue's defaults; ``HUTCH_PRICE_*`` change them)."""

    vcpu_hour: float = 0.03616363
    gib_hour: float = 0.01159025
    storage_gb_hour: float = 0.0001584
    egress_gb: float = 0.0


def held(state: SandboxState, pause_mode: PauseMode | None, shape: Shape) -> dict[str, float]:
    """The meter kinds a sandbox in ``state`` holds, with their quantities."""
    out: dict[str, float] = {}
    if state.is_live:
        out["disk"] = shape.disk_gib * GIB_IN_GB
    if state in COMPUTE_STATES:
        out["vcpu"] = float(shape.vcpus)
        out["memory"] = shape.memory_mib / 1024
    if state is S.PAUSED and pause_mode is PauseMode.MEMORY:
        out["memory_paused"] = shape.memory_mib / 1024
    return out


def changes(
    before: Mapping[str, float], after: Mapping[str, float]
) -> tuple[list[str], dict[str, float]]:
    """(kinds to close, kinds to open with their quantity) going from ``before`` to
    ``after``; a kind held on both sides with the same quantity continues untouched."""
    close = [k for k in before if after.get(k) != before[k]]
    opened = {k: q for k, q in after.items() if before.get(k) != q}
    return close, opened


def overlap(start: float, end: float, lo: float, hi: float) -> float:
    """Seconds of [start, end) inside [lo, hi)."""
    return max(0.0, min(end, hi) - max(start, lo))


@dataclass
class _Sum:
    """A group's quantities as they add up (``*_seconds`` unit-seconds, ``*_gb_hours``
    GB-hours); :meth:`row` is the contract's row, priced."""

    key: str
    vcpu_seconds: float = 0.0
    memory_gib_seconds: float = 0.0
    paused_memory_gib_seconds: float = 0.0
    disk_gb_hours: float = 0.0
    snapshot_gb_hours: float = 0.0
    image_gb_hours: float = 0.0
    egress_allowed_bytes: int = 0
    egress_denied_bytes: int = 0

    def add(self, kind: str, unit_seconds: float) -> None:
        if kind == "vcpu":
            self.vcpu_seconds += unit_seconds
        elif kind == "memory":
            self.memory_gib_seconds += unit_seconds
        elif kind == "memory_paused":
            self.paused_memory_gib_seconds += unit_seconds
        elif kind == "disk":
            self.disk_gb_hours += unit_seconds / 3600
        elif kind == "snapshot":
            self.snapshot_gb_hours += unit_seconds / 3600
        elif kind == "image":
            self.image_gb_hours += unit_seconds / 3600

    def count(self, kind: str, amount: float) -> None:
        if kind == "egress":
            self.egress_allowed_bytes += round(amount)
        elif kind == "egress_denied":
            self.egress_denied_bytes += round(amount)

    def row(self, prices: Prices) -> UsageRow:
        storage = self.disk_gb_hours + self.snapshot_gb_hours + self.image_gb_hours
        memory = self.memory_gib_seconds + self.paused_memory_gib_seconds
        cost = (
            self.vcpu_seconds / 3600 * prices.vcpu_hour
            + memory / 3600 * prices.gib_hour
            + storage * prices.storage_gb_hour
            + (self.egress_allowed_bytes / 1e9) * prices.egress_gb
        )
        return UsageRow(**{f.name: getattr(self, f.name) for f in fields(self)}, cost_usd=cost)


def _total(rows: Iterable[UsageRow]) -> UsageRow:
    """The sum of ``rows`` (key ``total``), their costs summed as they are."""
    sums: dict[str, Any] = {
        f.name: 0 if f.type == "int" else 0.0 for f in fields(UsageRow) if f.name != "key"
    }
    for row in rows:
        for name in sums:
            sums[name] += getattr(row, name)
    return UsageRow(key="total", **sums)


@dataclass
class Usage:
    start: float
    end: float
    group_by: str
    rows: list[UsageRow] = field(default_factory=list)
    total: UsageRow = field(default_factory=lambda: _total([]))


def _days(start: float, end: float) -> Iterable[tuple[str, float, float]]:
    """(UTC date, day start, day end) of every day [start, end) touches."""
    day = dt.datetime.fromtimestamp(start, dt.UTC).date()
    while True:
        lo = dt.datetime.combine(day, dt.time(), dt.UTC).timestamp()
        if lo >= end:
            return
        yield day.isoformat(), lo, lo + 86400.0
        day += dt.timedelta(days=1)


def _key(iv: IntervalRow, group_by: str) -> str:
    if group_by == "day":
        return dt.datetime.fromtimestamp(iv.started_at, dt.UTC).date().isoformat()
    return iv.subject if group_by == "sandbox" else iv.project


def usage(
    intervals: Iterable[IntervalRow],
    *,
    start: float,
    end: float,
    now: float,
    group_by: str,
    prices: Prices,
) -> Usage:
    """What ``intervals`` add up to inside [start, end); an open interval counts up to
    ``now``. Rows are sorted by key; ``total`` sums them."""
    if group_by not in GROUP_BY:
        raise ValueError(f"group_by {group_by!r}; accepted: {', '.join(GROUP_BY)}")
    rows: dict[str, _Sum] = {}
    hi = min(end, now)
    for iv in intervals:
        if iv.kind in COUNTED_KINDS:
            if start <= iv.started_at < end:  # counted by now: it has a row
                key = _key(iv, group_by)
                rows.setdefault(key, _Sum(key)).count(iv.kind, iv.quantity)
            continue
        stop = iv.ended_at if iv.ended_at is not None else now
        if group_by == "day":
            parts = [
                (key, overlap(iv.started_at, stop, max(lo, start), min(d_hi, hi)))
                for key, lo, d_hi in _days(max(iv.started_at, start), min(stop, hi))
            ]
        else:
            parts = [(_key(iv, group_by), overlap(iv.started_at, stop, start, hi))]
        for key, seconds in parts:
            if seconds > 0 and not math.isclose(seconds, 0.0, abs_tol=1e-9):
                rows.setdefault(key, _Sum(key)).add(iv.kind, seconds * iv.quantity)
    priced = [rows[k].row(prices) for k in sorted(rows)]
    return Usage(start, end, group_by, priced, _total(priced))
