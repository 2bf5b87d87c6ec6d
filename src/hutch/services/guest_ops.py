"""Commands and files inside a running sandbox, the activity they count for
``auto_pause_s``, and the calls in flight a pause, snapshot or fork waits for
(:mod:`hutch.services.inflight`); mixed into :class:`hutch.services.sandboxes.SandboxService`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING

from hutch.errors import StateError
from hutch.guest.client import ExecStream
from hutch.guest.results import FileEntry
from hutch.models import SandboxRecord, SandboxState
from hutch.services.backend import Runtime
from hutch.services.image_defaults import merged
from hutch.services.images import ImageDefaults
from hutch.services.inflight import InFlight, Work

__all__ = ["GuestOpsMixin"]


class GuestOpsMixin:
    _runtimes: dict[str, Runtime]
    clock: Callable[[], float]
    _last_active: dict[str, float]
    _busy: dict[str, int]
    inflight: InFlight

    if TYPE_CHECKING:

        def get(self, sandbox_id: str) -> SandboxRecord: ...

        def guest_defaults(self, rec: SandboxRecord) -> ImageDefaults: ...

        async def resume(self, sandbox_id: str) -> SandboxRecord: ...

    # -- guest operations --------------------------------------------------------------

    def runtime(self, sandbox_id: str) -> Runtime:
        rec = self.get(sandbox_id)
        runtime = self._runtimes.get(sandbox_id)
        if rec.state is not SandboxState.RUNNING or runtime is None:
            hint = ""
            if rec.state is SandboxState.PAUSED:
                hint = "resume it, or create sandboxes with auto_resume=true"
            raise StateError(f"sandbox {sandbox_id}", str(rec.state), ["running"], hint)
        return runtime

    async def ready(self, sandbox_id: str, work: Work | None = None) -> Runtime:
        """The running sandbox's runtime, resuming it first if it is paused with
        ``auto_resume``. While a pause, snapshot or fork holds the sandbox this waits for
        it to finish. ``work`` is admitted as in flight the moment the runtime is handed
        out (no await in between), so a lifecycle call that starts later waits for it."""
        while True:
            await self.inflight.wait_open(sandbox_id)
            rec = self.get(sandbox_id)
            if rec.state is SandboxState.PAUSED and rec.auto_resume:
                await self.resume(sandbox_id)
                continue  # a lifecycle call may have taken the sandbox meanwhile
            runtime = self.runtime(sandbox_id)
            if work is not None:
                self.inflight.admit(work)
            return runtime

    @contextlib.asynccontextmanager
    async def _call(self, sandbox_id: str, what: str) -> AsyncIterator[Runtime]:
        """A short guest call: in flight (waited for by lifecycle calls), not activity."""
        work = self.inflight.begin(sandbox_id, what)
        try:
            yield await self.ready(sandbox_id, work)
        finally:
            self.inflight.end(work)

    async def exec(
        self,
        sandbox_id: str,
        cmd: list[str] | str,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: bytes | AsyncIterable[bytes] | None = None,
        timeout_s: float | None = None,
        work: Work | None = None,
    ) -> ExecStream:
        """Start ``cmd``. ``work`` (from :meth:`begin_work`) covers it until the caller
        ends it, once the output is read to the end."""
        rec = self.get(sandbox_id)
        runtime = await self.ready(sandbox_id, work)
        merged_env, cwd, user = merged(self.guest_defaults(rec), rec, env, cwd, user)
        if isinstance(cmd, str):
            return await runtime.agent.exec(
                shell=cmd, env=merged_env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s
            )
        return await runtime.agent.exec(
            cmd, env=merged_env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s
        )

    async def read_file(
        self, sandbox_id: str, path: str, work: Work | None = None
    ) -> AsyncIterator[bytes]:
        return (await self.ready(sandbox_id, work)).agent.read_file(path)

    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        data: bytes | AsyncIterable[bytes],
        mode: int = 0o644,
        work: Work | None = None,
    ) -> FileEntry:
        return await (await self.ready(sandbox_id, work)).agent.write_file(path, data, mode=mode)

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileEntry]:
        async with self._call(sandbox_id, f"list {path}") as runtime:
            return await runtime.agent.list_dir(path)

    async def stat(self, sandbox_id: str, path: str) -> FileEntry:
        async with self._call(sandbox_id, f"stat {path}") as runtime:
            return await runtime.agent.stat(path)

    async def mkdir(self, sandbox_id: str, path: str) -> FileEntry:
        async with self._call(sandbox_id, f"mkdir {path}") as runtime:
            return await runtime.agent.mkdir(path)

    async def remove(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        async with self._call(sandbox_id, f"remove {path}") as runtime:
            await runtime.agent.remove(path, recursive=recursive)

    async def rename(self, sandbox_id: str, source: str, destination: str) -> FileEntry:
        async with self._call(sandbox_id, f"rename {source}") as runtime:
            return await runtime.agent.rename(source, destination)

    # -- activity (for auto_pause_s) and work in flight ----------------------------------

    def begin_activity(self, sandbox_id: str) -> None:
        """The sandbox is busy (an exec, a file transfer, an attached terminal) until
        ``end_activity``: it is not idle for ``auto_pause_s``."""
        self._busy[sandbox_id] = self._busy.get(sandbox_id, 0) + 1
        self._last_active[sandbox_id] = self.clock()

    def end_activity(self, sandbox_id: str) -> None:
        self._busy[sandbox_id] = max(0, self._busy.get(sandbox_id, 0) - 1)
        self._last_active[sandbox_id] = self.clock()

    @contextlib.contextmanager
    def activity(self, sandbox_id: str) -> Iterator[None]:
        self.begin_activity(sandbox_id)
        try:
            yield
        finally:
            self.end_activity(sandbox_id)

    def begin_work(self, sandbox_id: str, what: str) -> Work:
        """A call with a result (exec, transfer, code run; ``what`` names it for a Busy
        message): activity from now, in flight once :meth:`ready` admits it, until
        :meth:`end_work`. Pass it to the call (``work=``)."""
        self.begin_activity(sandbox_id)
        return self.inflight.begin(sandbox_id, what)

    def end_work(self, work: Work) -> None:
        """Idempotent: safe from both a stream's end and an error path."""
        if work.ended:
            return
        self.inflight.end(work)
        self.end_activity(work.sandbox_id)

    @contextlib.contextmanager
    def work(self, sandbox_id: str, what: str) -> Iterator[Work]:
        work = self.begin_work(sandbox_id, what)
        try:
            yield work
        finally:
            self.end_work(work)
