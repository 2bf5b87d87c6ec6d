"""Background processes and interactive terminals of running sandboxes.

A thin use-case layer over the guest operations: it finds the sandbox's agent
(resuming a paused ``auto_resume`` sandbox first, as exec does), merges the sandbox's
environment, and marks the sandbox busy while a caller is attached (a followed output
stream, an open terminal: the :class:`AttachedPty` holds that lease until it is
detached) so ``auto_pause_s`` does not pause it under the user. A process or terminal
running with nobody attached does not keep the sandbox awake: it survives a memory
pause anyway.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import AsyncIterator
from types import TracebackType

from hutch.errors import Conflict, InvalidArgument
from hutch.guest.processes import GuestProcesses, OutputStream, ProcessInfo
from hutch.guest.pty import GuestPtys, PtyEnd, PtyInfo, PtySession
from hutch.services.activity import Lease, describe_command
from hutch.services.guest_ops import GuestOps
from hutch.services.image_defaults import merged

__all__ = ["AttachedPty", "OutputStream", "ProcessInfo", "ProcessService", "PtyInfo"]


class AttachedPty:
    """A stream attached to a terminal (:class:`~hutch.guest.pty.PtySession`) that keeps
    the sandbox busy until it is detached (:meth:`detach`, or leaving ``async with``):
    the terminal keeps running in the guest either way."""

    def __init__(self, session: PtySession, lease: Lease) -> None:
        self._session = session
        self._lease = lease

    @property
    def pty_id(self) -> str:
        return self._session.pty_id

    @property
    def pid(self) -> int:
        return self._session.pid

    @property
    def end(self) -> PtyEnd | None:
        return self._session.end

    def send(self, data: bytes) -> None:
        self._session.send(data)

    def output(self) -> AsyncIterator[bytes]:
        return self._session.output()

    async def detach(self) -> None:
        """Idempotent."""
        try:
            await self._session.detach()
        finally:
            self._lease.release()

    async def __aenter__(self) -> AttachedPty:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.detach()


class ProcessService:
    def __init__(self, guest: GuestOps) -> None:
        self.guest = guest

    async def _procs(self, sandbox_id: str) -> GuestProcesses:
        return GuestProcesses((await self.guest.ready(sandbox_id)).agent)

    async def _ptys(self, sandbox_id: str) -> GuestPtys:
        return GuestPtys((await self.guest.ready(sandbox_id)).agent)

    def _defaults(
        self, sandbox_id: str, env: dict[str, str] | None, cwd: str | None, user: str | None
    ) -> tuple[dict[str, str], str | None, str | None]:
        """(env, cwd, user): the request's over the sandbox's over its image's."""
        rec = self.guest.get(sandbox_id)
        return merged(
            self.guest.guest_defaults(rec), rec, env, cwd, user, self.guest.secret_env(rec)
        )

    # -- background processes ----------------------------------------------------------

    async def start(
        self,
        sandbox_id: str,
        cmd: list[str] | str,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: bytes | None = None,
        keep_stdin: bool = False,
        timeout_s: float | None = None,
    ) -> ProcessInfo:
        """Start ``cmd`` detached. ``stdin`` is written first; ``keep_stdin`` leaves the
        pipe open for :meth:`write_stdin` (else it is closed after ``stdin``, or the
        process reads /dev/null)."""
        env, cwd, user = self._defaults(sandbox_id, env, cwd, user)
        what = "background " + describe_command(cmd)
        with self.guest.activity.work(sandbox_id, what) as lease:
            procs = GuestProcesses((await self.guest.ready(sandbox_id, lease)).agent)
            pipe = keep_stdin or stdin is not None
            if isinstance(cmd, str):
                info = await procs.start(
                    shell=cmd, env=env, cwd=cwd, user=user, stdin=pipe, timeout_s=timeout_s
                )
            else:
                info = await procs.start(
                    cmd, env=env, cwd=cwd, user=user, stdin=pipe, timeout_s=timeout_s
                )
            if stdin is not None:
                try:
                    info = await procs.write_stdin(info.pid, stdin, eof=not keep_stdin)
                except Conflict:
                    # It exited (or shut its stdin) before reading: it still started.
                    info = await procs.get(info.pid)
            return info

    async def list(self, sandbox_id: str) -> builtins.list[ProcessInfo]:
        return await (await self._procs(sandbox_id)).list()

    async def get(self, sandbox_id: str, pid: int) -> ProcessInfo:
        return await (await self._procs(sandbox_id)).get(pid)

    @contextlib.asynccontextmanager
    async def output(
        self, sandbox_id: str, pid: int, offset: int = 0, *, follow: bool = False
    ) -> AsyncIterator[OutputStream]:
        """The process's output from ``offset``; the sandbox counts as busy meanwhile."""
        with self.guest.activity.busy(sandbox_id):
            stream = await (await self._procs(sandbox_id)).output(pid, offset, follow=follow)
            try:
                yield stream
            finally:
                await stream.aclose()

    async def write_stdin(
        self, sandbox_id: str, pid: int, data: bytes, *, eof: bool = False
    ) -> ProcessInfo:
        with self.guest.activity.work(sandbox_id, f"stdin of process {pid}") as lease:
            procs = GuestProcesses((await self.guest.ready(sandbox_id, lease)).agent)
            return await procs.write_stdin(pid, data, eof=eof)

    async def signal(self, sandbox_id: str, pid: int, signum: int) -> ProcessInfo:
        procs = await self._procs(sandbox_id)
        await procs.signal(pid, _signal_number(signum))
        return await procs.get(pid)

    async def kill(self, sandbox_id: str, pid: int) -> ProcessInfo:
        return await (await self._procs(sandbox_id)).kill(pid)

    async def wait(self, sandbox_id: str, pid: int, timeout_s: float | None = None) -> ProcessInfo:
        with self.guest.activity.busy(sandbox_id):
            return await (await self._procs(sandbox_id)).wait(pid, timeout_s)

    # -- terminals ---------------------------------------------------------------------

    async def open_pty(
        self,
        sandbox_id: str,
        *,
        cmd: builtins.list[str] | str | None = None,
        rows: int = 24,
        cols: int = 80,
        term: str = "xterm-256color",
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        busy: bool = True,
    ) -> AttachedPty:
        """A new terminal running ``cmd`` (default: a login shell), attached: the
        sandbox is busy (not idle for auto_pause_s) until it is detached. ``busy``
        False: a face that keeps one attached stream for several clients (E2B) marks
        the sandbox busy per client itself (:meth:`attached`)."""
        env, cwd, user = self._defaults(sandbox_id, env, cwd, user)
        ptys = await self._ptys(sandbox_id)
        argv = cmd if isinstance(cmd, builtins.list) else None
        shell = cmd if isinstance(cmd, str) else None
        session = await ptys.open(
            argv, shell=shell, rows=rows, cols=cols, term=term, env=env, cwd=cwd, user=user
        )
        return AttachedPty(session, self._attach_lease(sandbox_id, busy))

    async def attach_pty(self, sandbox_id: str, pty_id: str, *, busy: bool = True) -> AttachedPty:
        session = await (await self._ptys(sandbox_id)).attach(pty_id)
        return AttachedPty(session, self._attach_lease(sandbox_id, busy))

    def _attach_lease(self, sandbox_id: str, busy: bool) -> Lease:
        if busy:
            return self.guest.activity.busy(sandbox_id)
        return Lease(self.guest.activity, sandbox_id, None, counts_activity=False)

    def attached(self, sandbox_id: str) -> Lease:
        """The sandbox is busy while one client of a shared terminal stream (see
        ``busy`` of :meth:`open_pty`) watches it: a lease, released on leaving ``with``."""
        return self.guest.activity.busy(sandbox_id)

    async def resize_pty(self, sandbox_id: str, pty_id: str, rows: int, cols: int) -> None:
        await (await self._ptys(sandbox_id)).resize(pty_id, rows, cols)

    async def signal_pty(self, sandbox_id: str, pty_id: str, signum: int) -> None:
        await (await self._ptys(sandbox_id)).signal(pty_id, _signal_number(signum))

    async def close_pty(self, sandbox_id: str, pty_id: str) -> PtyInfo:
        return await (await self._ptys(sandbox_id)).close(pty_id)

    async def list_ptys(self, sandbox_id: str) -> builtins.list[PtyInfo]:
        return await (await self._ptys(sandbox_id)).list()


def _signal_number(signum: int) -> int:
    if isinstance(signum, bool) or not isinstance(signum, int) or not 1 <= signum <= 64:
        raise InvalidArgument(f"signal={signum!r}; give a signal number 1-64 (e.g. 15, 9, 2)")
    return signum
