"""Usage and cost (:class:`UsageService`): the meter's intervals over a window, grouped
and priced (:mod:`hutch.services.metering`), and the event log's pages for a caller."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator, Iterable

from hutch.contract.auth import Permission, Principal
from hutch.errors import Forbidden, HutchError, InvalidArgument, NotFound
from hutch.models import SandboxRecord
from hutch.services.events import EVENT_TYPES, project_of
from hutch.services.metering import GROUP_BY, Prices, Usage, usage
from hutch.services.registry import SandboxRegistry
from hutch.store.meter import EventRow

__all__ = ["EVENTS_PAGE_MAX", "UsageService", "parse_time"]

#: Events one page holds at most.
EVENTS_PAGE_MAX = 1000


def parse_time(value: str, name: str) -> float:
    """Epoch seconds, or an ISO 8601 date or time (UTC unless it names a zone)."""
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise InvalidArgument(
            f"{name}={value!r} is not a time; accepted: epoch seconds or ISO 8601 "
            "(2026-01-31, 2026-01-31T12:00:00Z)"
        ) from exc
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def _types(types: Iterable[str]) -> list[str]:
    wanted = [t.strip() for t in types if t.strip()]
    families = {t.split(".")[0] + ".*" for t in EVENT_TYPES}
    for t in wanted:
        if t not in EVENT_TYPES and t not in families:
            raise InvalidArgument(
                f"unknown event type {t!r}; accepted: {', '.join(EVENT_TYPES)} "
                f"or a family ({', '.join(sorted(families))})"
            )
    return wanted


class UsageService:
    def __init__(self, core: SandboxRegistry) -> None:
        self.core = core

    @property
    def prices(self) -> Prices:
        m = self.core.settings.meter
        return Prices(
            m.price_vcpu_hour, m.price_gib_hour, m.price_storage_gb_hour, m.price_egress_gb
        )

    def usage(
        self,
        principal: Principal,
        *,
        project: str | None = None,
        start: float | None = None,
        end: float | None = None,
        group_by: str = "sandbox",
    ) -> tuple[str | None, Usage]:
        """(the project reported, or None for all, and its usage) in [start, end).

        Defaults: ``end`` now, ``start`` the beginning of ``end``'s UTC month. A key sees
        its own project; the admin any (``project``), and all with ``group_by=project``.
        """
        if group_by not in GROUP_BY:
            raise InvalidArgument(f"group_by={group_by!r}; accepted: {', '.join(GROUP_BY)}")
        admin = principal.may(Permission.PROJECT_MANAGE)
        if group_by == "project" and not admin:
            raise Forbidden(
                f"role {principal.role} may not group usage by project (the admin key "
                "may); use group_by=sandbox or day"
            )
        now = self.core.clock()
        end = now if end is None else end
        if start is None:
            first = dt.datetime.fromtimestamp(end, dt.UTC).replace(
                day=1, hour=0, minute=0, second=0, microsecond=0
            )
            start = first.timestamp()
        if start >= end:
            raise InvalidArgument(f"from ({start:.3f}) must be before to ({end:.3f})")
        if admin:
            scope = project if project else (None if group_by == "project" else principal.project)
        elif project and project != principal.project:
            raise NotFound(f"no project {project!r}")  # another project's: as if none
        else:
            scope = principal.project
        rows = self.core.meter.intervals(project=scope, start=start, end=end)
        return scope, usage(
            rows, start=start, end=end, now=now, group_by=group_by, prices=self.prices
        )

    def metrics_text(self) -> str:
        """``GET /metrics``'s body."""
        core = self.core
        states = core.store.count_by_state()
        count, memory = core.store.live_usage()
        limits = core.settings.limits
        allowed = denied = 0
        if core.net is not None:
            for sandbox_id in list(core.runtimes):
                try:
                    view = core.net.egress_view(sandbox_id)
                except HutchError:
                    continue  # detached meanwhile
                allowed += view.allowed
                denied += view.denied
        return core.metrics.render(
            states=states,
            capacity={
                "sandboxes": count,
                "max_sandboxes": limits.max_sandboxes,
                "memory_mib": memory,
                "memory_budget_mib": limits.memory_budget_mib,
            },
            egress=(allowed, denied),
        )

    # -- events ------------------------------------------------------------------------

    def _sandbox(self, principal: Principal, sandbox_id: str) -> SandboxRecord:
        """The sandbox, ended ones included; another project's is not found."""
        admin = principal.may(Permission.PROJECT_MANAGE)
        return self.core.states.get(sandbox_id, None if admin else principal.project)

    def events(
        self,
        principal: Principal,
        *,
        sandbox_id: str | None = None,
        types: Iterable[str] = (),
        after: int = 0,
        limit: int = 100,
    ) -> list[EventRow]:
        """The caller's project's events (one sandbox's with ``sandbox_id``: NotFound if
        it is not the caller's), oldest first after ``after``."""
        if not 1 <= limit <= EVENTS_PAGE_MAX:
            raise InvalidArgument(f"limit={limit}; accepted: 1-{EVENTS_PAGE_MAX}")
        if after < 0:
            raise InvalidArgument(f"after={after}; accepted: 0 or an event's seq")
        wanted = _types(types)
        project = principal.project
        if sandbox_id is not None:
            project = project_of(self._sandbox(principal, sandbox_id))
        return self.core.events.page(
            project=project, sandbox_id=sandbox_id, types=wanted, after=after, limit=limit
        )

    def follow(
        self, principal: Principal, sandbox_id: str, *, types: Iterable[str] = (), after: int = 0
    ) -> AsyncIterator[EventRow]:
        """The sandbox's events after ``after``, then each as it is appended, until the
        sandbox has ended and its last event was sent."""
        wanted = _types(types)
        rec = self._sandbox(principal, sandbox_id)

        def ended() -> bool:
            current = self.core.states.current(sandbox_id)
            return current is None or not current.state.is_live

        return self.core.events.follow(
            project=project_of(rec), sandbox_id=sandbox_id, types=wanted, after=after, ended=ended
        )
