"""Activity and calls in flight in each sandbox, held as leases by what the services
return, so that no caller (the REST routes included) keeps books.

**Activity** is what ``auto_pause_s`` counts: a sandbox is idle once nothing has held
a lease on it for that long. **Calls in flight** are what a pause, snapshot or fork
waits for, so that none of them is cut: a pause stops the VM and closes the agent
connection, which would end every call still streaming through it (an exec answering
502 half way, a download cut short). So those calls are tracked here, and a lifecycle
call *quiesces* the sandbox first (:meth:`InFlight.quiesce`):

1. it closes the sandbox's gate: calls that arrive now wait at it (in
   ``GuestOps.ready``) and go on once the lifecycle call is over, on whatever the
   sandbox then is (running again after a snapshot or fork; paused, which they report
   or auto-resume, after a pause);
2. it waits for the calls already inside to end, up to a bound
   (``Settings.lifecycle_wait_s``); past it the lifecycle call gives up with
   :class:`~hutch.errors.Busy` (409) naming what still runs, and nothing was cut.

A call is *inside* from the moment it got the sandbox's runtime (:meth:`Lease.admit`,
done by ``ready`` right after the gate check, with no await between) until its answer is
complete (:meth:`Lease.release`); one that waits at the gate does not hold up the
lifecycle call.

The leases (:class:`Lease`): ``Activity.work`` (activity + in flight) for execs
(collected or streamed), file downloads and uploads, archive transfers, code runs and
background-process starts and stdin, each with a short label for the Busy message;
``Activity.busy`` (activity only) for what is open ended: a followed process output, an
attached terminal, an open inbound connection. Those are not waited for (they would
hold a pause off forever); they end with an error frame saying why when the sandbox
pauses, and what runs in the guest carries on (a terminal can be reattached after
resume). A lease is released once, however its call ends; the streams the services
return (:class:`LeasedBytes`, ``guest_ops.ExecCall``, ...) release theirs with their
last byte or when closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from types import TracebackType

from hutch.errors import Busy
from hutch.models import SandboxRecord

__all__ = ["Activity", "InFlight", "Lease", "LeasedBytes", "Work", "describe_command"]

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


class Lease:
    """Activity on one sandbox from its start until :meth:`release` (idempotent), and,
    for a call with a result (``work``), in flight once :meth:`admit`-ted. A context
    manager: leaving the block releases it."""

    def __init__(
        self,
        activity: Activity,
        sandbox_id: str,
        work: Work | None,
        *,
        counts_activity: bool = True,
    ) -> None:
        self._activity = activity
        self.sandbox_id = sandbox_id
        self.work = work
        self._counts = counts_activity
        self.released = False

    def admit(self) -> None:
        """The call got the sandbox's runtime (no await since the gate was checked)."""
        if self.work is not None and not self.released:
            self._activity.inflight.admit(self.work)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if self.work is not None:
            self._activity.inflight.end(self.work)
        if self._counts:
            self._activity._end(self.sandbox_id)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class Activity:
    """Activity per sandbox (for ``auto_pause_s``: in memory, so after a restart every
    sandbox counts as freshly active, never paused early) and the calls in flight."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        #: Wall clock of activity, pauses and the reaper (tests move it).
        self.clock = clock
        self.inflight = InFlight()
        self._last_active: dict[str, float] = {}
        self._busy: dict[str, int] = {}

    @contextlib.contextmanager
    def in_use(self, sandbox_id: str) -> Iterator[None]:
        """:meth:`busy` as a plain context manager (an open inbound connection)."""
        with self.busy(sandbox_id):
            yield

    def busy(self, sandbox_id: str) -> Lease:
        """The sandbox is in use (not idle for ``auto_pause_s``) until the lease is
        released: a followed output, an attached terminal, an inbound connection."""
        self._begin(sandbox_id)
        return Lease(self, sandbox_id, None)

    def call(self, sandbox_id: str, what: str) -> Lease:
        """A short call (list, stat, mkdir, ...): in flight once admitted, so lifecycle
        calls wait for it, but no activity (it does not keep a sandbox awake)."""
        return Lease(self, sandbox_id, self.inflight.begin(sandbox_id, what), counts_activity=False)

    def work(self, sandbox_id: str, what: str) -> Lease:
        """A call with a result (exec, transfer, code run; ``what`` names it for a Busy
        message): activity from now, in flight once admitted, until released."""
        self._begin(sandbox_id)
        return Lease(self, sandbox_id, self.inflight.begin(sandbox_id, what))

    def _begin(self, sandbox_id: str) -> None:
        self._busy[sandbox_id] = self._busy.get(sandbox_id, 0) + 1
        self._last_active[sandbox_id] = self.clock()

    def _end(self, sandbox_id: str) -> None:
        self._busy[sandbox_id] = max(0, self._busy.get(sandbox_id, 0) - 1)
        self._last_active[sandbox_id] = self.clock()

    def idle_for(self, rec: SandboxRecord, now: float) -> float:
        """Seconds ``rec`` has been idle at ``now`` (0 while a lease is held)."""
        if self._busy.get(rec.id, 0) > 0:
            return 0.0
        since = self._last_active.get(rec.id) or rec.started_at or rec.created_at
        return now - since

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone (destroyed or failed)."""
        self.inflight.forget(sandbox_id)


class LeasedBytes:
    """A byte stream (a download, a tar archive) that holds its lease until it ends,
    fails or is closed. Its first chunk was read already, so that an error (no such
    file) came before the stream was handed out."""

    def __init__(self, first: bytes, rest: AsyncIterator[bytes], lease: Lease) -> None:
        self._first: bytes | None = first or None
        self._rest = rest
        self._lease = lease

    @classmethod
    async def open(cls, chunks: AsyncIterator[bytes], lease: Lease) -> LeasedBytes:
        """Read the first chunk of ``chunks``; on an error the lease goes and it raises."""
        try:
            try:
                first = await anext(chunks)
            except StopAsyncIteration:
                first = b""
        except BaseException:
            lease.release()
            raise
        return cls(first, chunks, lease)

    def __aiter__(self) -> LeasedBytes:
        return self

    async def __anext__(self) -> bytes:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        try:
            return await anext(self._rest)
        except BaseException:
            self._lease.release()  # the end, or a failure: either way it is over
            raise

    async def aclose(self) -> None:
        self._lease.release()
        aclose = getattr(self._rest, "aclose", None)
        if aclose is not None:
            await aclose()
