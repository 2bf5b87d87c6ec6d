"""Commands and files inside a running sandbox, and the activity they count for
``auto_pause_s``; mixed into :class:`hutch.services.sandboxes.SandboxService`."""

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

__all__ = ["GuestOpsMixin"]


class GuestOpsMixin:
    _runtimes: dict[str, Runtime]
    clock: Callable[[], float]
    _last_active: dict[str, float]
    _busy: dict[str, int]

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

    async def ready(self, sandbox_id: str) -> Runtime:
        """The running sandbox's runtime, resuming it first if it is paused with
        ``auto_resume``."""
        rec = self.get(sandbox_id)
        if rec.state is SandboxState.PAUSED and rec.auto_resume:
            await self.resume(sandbox_id)
        return self.runtime(sandbox_id)

    async def exec(
        self,
        sandbox_id: str,
        cmd: list[str] | str,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: bytes | None = None,
        timeout_s: float | None = None,
    ) -> ExecStream:
        rec = self.get(sandbox_id)
        runtime = await self.ready(sandbox_id)
        merged_env, cwd, user = merged(self.guest_defaults(rec), rec, env, cwd, user)
        if isinstance(cmd, str):
            return await runtime.agent.exec(
                shell=cmd, env=merged_env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s
            )
        return await runtime.agent.exec(
            cmd, env=merged_env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s
        )

    async def read_file(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        return (await self.ready(sandbox_id)).agent.read_file(path)

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes | AsyncIterable[bytes], mode: int = 0o644
    ) -> FileEntry:
        return await (await self.ready(sandbox_id)).agent.write_file(path, data, mode=mode)

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileEntry]:
        return await (await self.ready(sandbox_id)).agent.list_dir(path)

    async def stat(self, sandbox_id: str, path: str) -> FileEntry:
        return await (await self.ready(sandbox_id)).agent.stat(path)

    async def mkdir(self, sandbox_id: str, path: str) -> FileEntry:
        return await (await self.ready(sandbox_id)).agent.mkdir(path)

    async def remove(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        await (await self.ready(sandbox_id)).agent.remove(path, recursive=recursive)

    async def rename(self, sandbox_id: str, source: str, destination: str) -> FileEntry:
        return await (await self.ready(sandbox_id)).agent.rename(source, destination)

    # -- activity (for auto_pause_s) --------------------------------------------------

    def begin_activity(self, sandbox_id: str) -> None:
        """The sandbox is busy (an exec, a file transfer) until ``end_activity``: it is
        not idle for ``auto_pause_s``."""
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
