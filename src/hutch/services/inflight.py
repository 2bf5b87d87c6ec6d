"""Calls in flight inside each sandbox, so that pause, snapshot and fork never cut them.

A pause, snapshot or fork stops the VM and closes the agent connection, which would end
every call still streaming through it (an exec answering 502 half way, a download cut
short). So those calls are tracked here, and a lifecycle call *quiesces* the sandbox
first (:meth:`InFlight.quiesce`):

1. it closes the sandbox's gate: calls that arrive now wait at it (in
   ``SandboxService.ready``) and go on once the lifecycle call is over, on whatever the
   sandbox then is (running again after a snapshot or fork; paused, which they report
   or auto-resume, after a pause);
2. it waits for the calls already inside to end, up to a bound
   (``Settings.lifecycle_wait_s``); past it the lifecycle call gives up with
   :class:`~hutch.errors.Busy` (409) naming what still runs, and nothing was cut.

A call is *inside* from the moment it got the sandbox's runtime (:meth:`admit`, done by
``ready`` right after the gate check, with no await between) until its answer is
complete (:meth:`end`); one that waits at the gate does not hold up the lifecycle call.

What is tracked: execs (collected or streamed), file downloads and uploads, archive
transfers and code runs, each with a short label for the Busy message. Attached
terminals, followed process output and file watches are not waited for (they are open
ended); they end with an error frame saying why when the sandbox pauses, and what runs
in the guest carries on (a terminal can be reattached after resume).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from hutch.errors import Busy

__all__ = ["InFlight", "Work", "describe_command"]

_LABEL_CHARS = 80


def describe_command(cmd: list[str] | str) -> str:
    """A short label for an exec, for Busy messages (``exec 'sleep 3'``)."""
    text = cmd if isinstance(cmd, str) else " ".join(cmd)
    if len(text) > _LABEL_CHARS:
        text = text[: _LABEL_CHARS - 3] + "..."
    return f"exec {text!r}"


@dataclass(eq=False)
class Work:
    """One call (exec, transfer, run) in a sandbox, from its start to its last byte."""

    sandbox_id: str
    what: str
    started: float
    id: int
    admitted: bool = False
    ended: bool = False


@dataclass
class _Sandbox:
    inside: dict[int, Work] = field(default_factory=dict)
    #: Lifecycle calls holding the gate closed (nested: a fork may pause again inside).
    holders: int = 0
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)


class InFlight:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._ids = itertools.count(1)
        self._sandboxes: dict[str, _Sandbox] = {}

    def _of(self, sandbox_id: str) -> _Sandbox:
        return self._sandboxes.setdefault(sandbox_id, _Sandbox())

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone (destroyed or failed). One record lives per sandbox until
        then, so a call woken at the gate and a lifecycle call closing it again always
        meet on the same record."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is not None and not sb.holders:
            del self._sandboxes[sandbox_id]

    async def _notify(self, sb: _Sandbox) -> None:
        async with sb.changed:
            sb.changed.notify_all()

    def _notify_soon(self, sb: _Sandbox) -> None:
        asyncio.get_running_loop().create_task(self._notify(sb))

    # -- the calls -------------------------------------------------------------------

    def begin(self, sandbox_id: str, what: str) -> Work:
        """A call that is about to need the sandbox; counted once :meth:`admit`-ted."""
        return Work(sandbox_id, what, self._clock(), next(self._ids))

    def admit(self, work: Work) -> None:
        """The call got the sandbox's runtime: lifecycle calls now wait for it. Must be
        called with no await since :meth:`wait_open` returned."""
        if work.ended or work.admitted:
            return
        work.admitted = True
        self._of(work.sandbox_id).inside[work.id] = work

    def end(self, work: Work) -> None:
        """The call's answer is complete (or it failed). Idempotent."""
        if work.ended:
            return
        work.ended = True
        sb = self._sandboxes.get(work.sandbox_id)
        if sb is not None and sb.inside.pop(work.id, None) is not None and sb.holders:
            self._notify_soon(sb)

    def inside(self, sandbox_id: str) -> list[Work]:
        """Calls inside the sandbox now, oldest first."""
        sb = self._sandboxes.get(sandbox_id)
        return sorted(sb.inside.values(), key=lambda w: w.id) if sb else []

    # -- the gate --------------------------------------------------------------------

    def is_open(self, sandbox_id: str) -> bool:
        sb = self._sandboxes.get(sandbox_id)
        return sb is None or sb.holders == 0

    async def wait_open(self, sandbox_id: str) -> None:
        """Return once no lifecycle call holds the sandbox."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is None or sb.holders == 0:
            return
        async with sb.changed:
            await sb.changed.wait_for(lambda: sb.holders == 0)

    @contextlib.asynccontextmanager
    async def quiesce(self, sandbox_id: str, action: str, wait_s: float) -> AsyncIterator[None]:
        """Close the gate, wait up to ``wait_s`` for the calls inside to end, then run the
        block; the gate opens again after it. Raises :class:`Busy` naming the calls
        still inside after ``wait_s`` (nothing was cut; the gate is open again)."""
        sb = self._of(sandbox_id)
        sb.holders += 1
        try:
            if sb.inside:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait_s), sb.changed:
                        await sb.changed.wait_for(lambda: not sb.inside)
            if sb.inside:
                raise Busy(self._busy_message(sandbox_id, action, wait_s))
            yield
        finally:
            sb.holders -= 1
            if sb.holders == 0:
                await self._notify(sb)

    def _busy_message(self, sandbox_id: str, action: str, wait_s: float) -> str:
        now = self._clock()
        calls = ", ".join(
            f"{w.what} (running {now - w.started:.0f} s)" for w in self.inside(sandbox_id)
        )
        return (
            f"sandbox {sandbox_id} still has calls in flight after {action} waited "
            f"{wait_s:g} s for them: {calls}; {action} never cuts them: let them finish "
            f"(or stop them) and retry (the wait is HUTCH_LIFECYCLE_WAIT_S)"
        )
