"""Response bodies of usage (``GET /v1/usage``) and the event log (``GET /v1/events``,
``GET /v1/sandboxes/{id}/events``). The web console reads exactly these shapes. A usage
row is the contract's :class:`hutch.contract.usage.UsageRow` itself (one declaration for
the daemon, this schema and the SDK)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from hutch.contract.usage import UsageRow

__all__ = ["Event", "EventList", "Prices", "UsageReport", "UsageRow"]


class Prices(BaseModel):
    """USD per unit (HUTCH_PRICE_*)."""

    vcpu_hour: float
    gib_hour: float = Field(description="Memory while running and memory state held paused.")
    storage_gb_hour: float = Field(description="Sandbox disks, snapshots and images.")
    egress_gb: float


class UsageReport(BaseModel):
    project: str | None = Field(description="The project reported; null: every project.")
    start: float = Field(description="Window start, epoch seconds (inclusive).")
    end: float = Field(description="Window end, epoch seconds (exclusive).")
    group_by: Literal["sandbox", "day", "project"]
    prices: Prices
    rows: list[UsageRow]
    total: UsageRow


class Event(BaseModel):
    seq: int = Field(description="Increasing; page or follow on with after=<seq>.")
    at: float = Field(description="Epoch seconds.")
    project: str
    sandbox_id: str | None
    type: str = Field(description="sandbox.created, sandbox.exec, ... (see README).")
    actor: str | None = Field(description="Key id of the caller; null: the daemon's own work.")
    source: str | None = Field(description="Client address of the caller.")
    data: dict[str, Any]

    @classmethod
    def of(cls, row: Any) -> Event:
        return cls.model_validate(row, from_attributes=True)


class EventList(BaseModel):
    events: list[Event]
    next_after: int = Field(description="Pass as after= for the next page (same if empty).")
