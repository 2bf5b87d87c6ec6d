"""Usage, cost and the event log: the sans-IO requests and their answers, shared by both
shells (``client.usage(...)``, ``client.events(...)``, ``sandbox.events(...)``)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hutch.contract.usage import UsageRow
from hutch.sdk._core import Call, ClientCore, json_of, one
from hutch.sdk._errors import ProtocolError
from hutch.sdk._streams import LineDecoder

__all__ = ["Event", "EventDecoder", "EventPage", "TimeArg", "Usage", "UsageCalls", "UsageRow"]

#: A time for ``start``/``end``: epoch seconds, a datetime (naive = UTC) or ISO 8601 text.
TimeArg = float | int | str | dt.datetime


@dataclass(frozen=True)
class Usage:
    project: str | None
    start: float
    end: float
    group_by: str
    prices: dict[str, float]
    rows: list[UsageRow]
    total: UsageRow

    @classmethod
    def from_dict(cls, d: Any) -> Usage:
        try:
            return cls(
                project=d["project"],
                start=float(d["start"]),
                end=float(d["end"]),
                group_by=str(d["group_by"]),
                prices={str(k): float(v) for k, v in d["prices"].items()},
                rows=[UsageRow.from_dict(r) for r in d["rows"]],
                total=UsageRow.from_dict(d["total"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(f"malformed usage answer: {d!r}") from exc


@dataclass(frozen=True)
class Event:
    """One entry of the event log: ``type`` (sandbox.created, sandbox.exec, ...),
    ``actor`` (key id; None: the daemon's own work), ``source`` (client address)."""

    seq: int
    at: float
    project: str
    sandbox_id: str | None
    type: str
    actor: str | None
    source: str | None
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Any) -> Event:
        try:
            return cls(
                seq=int(d["seq"]),
                at=float(d["at"]),
                project=str(d["project"]),
                sandbox_id=d["sandbox_id"],
                type=str(d["type"]),
                actor=d["actor"],
                source=d["source"],
                data=dict(d["data"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed event: {d!r}") from exc


@dataclass(frozen=True)
class EventPage:
    events: list[Event]
    #: Pass as ``after`` for the next page.
    next_after: int

    @classmethod
    def from_dict(cls, d: Any) -> EventPage:
        if not isinstance(d, dict) or not isinstance(d.get("events"), list):
            raise ProtocolError(f"malformed event page: {d!r}")
        return cls([Event.from_dict(e) for e in d["events"]], int(d.get("next_after", 0)))


class EventDecoder(LineDecoder[Event]):
    """A followed sandbox's NDJSON events; the body ends when the sandbox has."""

    what = "event stream"

    def item(self, obj: Any) -> Event:
        return Event.from_dict(obj)


def _time(value: TimeArg) -> str:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return repr(value.timestamp())
    if isinstance(value, bool):
        raise TypeError(f"a time is epoch seconds, a datetime or ISO 8601 text, not {value!r}")
    return str(value)


def _types(types: str | Sequence[str] | None) -> list[tuple[str, str]]:
    if types is None:
        return []
    items = [types] if isinstance(types, str) else list(types)
    return [("type", t) for t in items]


class UsageCalls:
    def __init__(self, core: ClientCore) -> None:
        self.core = core

    def usage(
        self,
        *,
        start: TimeArg | None,
        end: TimeArg | None,
        group_by: str,
        project: str | None,
    ) -> Call[Usage]:
        params = [("group_by", group_by)]
        if start is not None:
            params.append(("from", _time(start)))
        if end is not None:
            params.append(("to", _time(end)))
        if project is not None:
            params.append(("project", project))
        return Call(self.core.request("GET", "/v1/usage", params=params), one(Usage.from_dict))

    def events(
        self,
        *,
        sandbox_id: str | None,
        types: str | Sequence[str] | None,
        after: int,
        limit: int,
    ) -> Call[EventPage]:
        params = [*_types(types), ("after", str(after)), ("limit", str(limit))]
        if sandbox_id is not None:
            params.append(("sandbox", sandbox_id))
        req = self.core.request("GET", "/v1/events", params=params)
        return Call(req, lambda r: EventPage.from_dict(json_of(r)))

    def sandbox_events(
        self, sandbox_id: str, *, types: str | Sequence[str] | None, after: int, limit: int
    ) -> Call[EventPage]:
        params = [*_types(types), ("after", str(after)), ("limit", str(limit))]
        req = self.core.request("GET", self.core.sandbox_path(sandbox_id, "/events"), params=params)
        return Call(req, lambda r: EventPage.from_dict(json_of(r)))

    def follow_request(
        self, sandbox_id: str, *, types: str | Sequence[str] | None, after: int
    ) -> Any:
        """The followed stream's request: no read timeout (events come when they come)."""
        params = [*_types(types), ("after", str(after)), ("follow", "true")]
        return self.core.request(
            "GET",
            self.core.sandbox_path(sandbox_id, "/events"),
            params=params,
            read_timeout=None,
        )
