"""Commands and files inside a running sandbox. Each call holds a lease
(:mod:`hutch.services.activity`) for as long as it runs: it counts as activity for
``auto_pause_s``, and a pause, snapshot or fork waits for it. What a call returns that
outlives it (a command's output, a download) holds the lease until its last byte."""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import AsyncIterable, AsyncIterator, Callable
from types import TracebackType

from hutch.guest.client import ExecStream
from hutch.guest.results import ExecExit, ExecOutput, ExecResult, FileEntry
from hutch.models import SandboxRecord, SandboxState
from hutch.runtime.backend import Runtime
from hutch.services.activity import Lease, LeasedBytes, describe_command
from hutch.services.events import COMMAND_CHARS, because, project_of, scrub
from hutch.services.image_defaults import merged
from hutch.services.images import ImageDefaults
from hutch.services.lifecycle import LifecycleService
from hutch.services.registry import SandboxRegistry

__all__ = ["ExecCall", "GuestOps"]


class ExecCall:
    """A started command that holds its lease until its exit is read, it fails, or it
    is closed (:meth:`close`, or leaving ``async with``). Iterate it for output;
    ``wait()`` or ``collect()`` for the end (as :class:`~hutch.guest.client.ExecStream`)."""

    def __init__(
        self,
        stream: ExecStream,
        lease: Lease,
        on_end: Callable[[ExecExit | None], None] | None = None,
    ) -> None:
        """``on_end``: told once how the command ended (None: the caller closed the
        call before reading its exit), for its ``sandbox.exec`` event."""
        self._stream = stream
        self._lease = lease
        self._on_end = on_end

    @property
    def pid(self) -> int:
        return self._stream.pid

    def __aiter__(self) -> AsyncIterator[ExecOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[ExecOutput]:
        try:
            async for item in self._stream:
                yield item
        finally:
            self.close()

    async def wait(self) -> ExecExit:
        try:
            done = await self._stream.wait()
            self._ended(done)
            return done
        finally:
            self.close()

    async def collect(self) -> ExecResult:
        try:
            result = await self._stream.collect()
            self._ended(
                ExecExit(result.exit_code, result.signal, result.timed_out, result.duration_ms)
            )
            return result
        finally:
            self.close()

    def _ended(self, done: ExecExit | None) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end(done)

    def close(self) -> None:
        """The call is over for the caller (idempotent): its lease goes. The command
        itself is not stopped."""
        self._ended(self._stream.exit)
        self._lease.release()

    async def __aenter__(self) -> ExecCall:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class GuestOps:
    """Calls into a running sandbox's guest (resumed first if it auto-resumes). Also
    what the other guest services (processes, interpreter, archives) start from."""

    def __init__(self, core: SandboxRegistry, lifecycle: LifecycleService) -> None:
        self.core = core
        self.lifecycle = lifecycle
        self.activity = core.activity

    def get(self, sandbox_id: str) -> SandboxRecord:
        return self.core.get(sandbox_id)

    def guest_defaults(self, rec: SandboxRecord) -> ImageDefaults:
        return self.core.guest_defaults(rec)

    def secret_env(self, rec: SandboxRecord) -> dict[str, str]:
        return self.core.secret_env(rec)

    def runtime(self, sandbox_id: str) -> Runtime:
        return self.core.running(sandbox_id)

    async def ready(self, sandbox_id: str, lease: Lease | None = None) -> Runtime:
        """The running sandbox's runtime, resuming it first if it is paused with
        ``auto_resume``. While a pause, snapshot or fork holds the sandbox this waits for
        it to finish. ``lease`` is admitted as in flight the moment the runtime is handed
        out (no await in between), so a lifecycle call that starts later waits for it."""
        while True:
            await self.activity.inflight.wait_open(sandbox_id)
            rec = self.get(sandbox_id)
            if rec.state is SandboxState.PAUSED and rec.auto_resume:
                with because("auto_resume"):
                    await self.lifecycle.resume(sandbox_id)
                continue  # a lifecycle call may have taken the sandbox meanwhile
            runtime = self.runtime(sandbox_id)
            if lease is not None:
                lease.admit()
            return runtime

    @contextlib.asynccontextmanager
    async def _call(self, sandbox_id: str, what: str) -> AsyncIterator[Runtime]:
        """A short guest call: in flight (waited for by lifecycle calls), not activity."""
        with self.activity.call(sandbox_id, what) as lease:
            yield await self.ready(sandbox_id, lease)

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
    ) -> ExecCall:
        """Start ``cmd``; the call is in flight (and activity) until its exit is read or
        it is closed."""
        lease = self.activity.work(sandbox_id, describe_command(cmd))
        try:
            rec = self.get(sandbox_id)
            runtime = await self.ready(sandbox_id, lease)
            merged_env, cwd, user = merged(
                self.guest_defaults(rec), rec, env, cwd, user, self.secret_env(rec)
            )
            if isinstance(cmd, str):
                stream = await runtime.agent.exec(
                    shell=cmd, env=merged_env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s
                )
            else:
                stream = await runtime.agent.exec(
                    cmd, env=merged_env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s
                )
        except BaseException:
            lease.release()
            raise
        command = cmd if isinstance(cmd, str) else shlex.join(cmd)
        secrets = list((env or {}).values()) + list(rec.env.values())

        def ended(done: ExecExit | None) -> None:
            self._event(
                rec,
                "sandbox.exec",
                {
                    "command": scrub(command, secrets)[:COMMAND_CHARS],
                    "exit_code": done.exit_code if done else None,
                    "signal": done.signal if done else None,
                    "timed_out": done.timed_out if done else False,
                    "duration_ms": done.duration_ms if done else None,
                },
            )

        return ExecCall(stream, lease, ended)

    def _event(self, rec: SandboxRecord, type: str, data: dict[str, object]) -> None:
        self.core.events.record(type, project=project_of(rec), sandbox_id=rec.id, data=data)

    def _file_event(self, sandbox_id: str, op: str, path: str, size: int | None = None) -> None:
        data: dict[str, object] = {"op": op, "path": path[:COMMAND_CHARS]}
        if size is not None:
            data["bytes"] = size
        self._event(self.get(sandbox_id), "sandbox.file", data)

    async def read_file(self, sandbox_id: str, path: str) -> LeasedBytes:
        """The file's bytes; an error (no such file, a directory) is raised here, before
        the stream is handed out. In flight until its last byte or it is closed."""
        lease = self.activity.work(sandbox_id, f"file download {path}")
        try:
            chunks = (await self.ready(sandbox_id, lease)).agent.read_file(path)
        except BaseException:
            lease.release()
            raise
        opened = await LeasedBytes.open(chunks, lease)
        self._file_event(sandbox_id, "read", path)
        return opened

    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        data: bytes | AsyncIterable[bytes],
        mode: int = 0o644,
    ) -> FileEntry:
        with self.activity.work(sandbox_id, f"file upload {path}") as lease:
            runtime = await self.ready(sandbox_id, lease)
            entry = await runtime.agent.write_file(path, data, mode=mode)
        self._file_event(sandbox_id, "write", path, entry.size)
        return entry

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileEntry]:
        async with self._call(sandbox_id, f"list {path}") as runtime:
            return await runtime.agent.list_dir(path)

    async def stat(self, sandbox_id: str, path: str) -> FileEntry:
        async with self._call(sandbox_id, f"stat {path}") as runtime:
            return await runtime.agent.stat(path)

    async def mkdir(self, sandbox_id: str, path: str) -> FileEntry:
        async with self._call(sandbox_id, f"mkdir {path}") as runtime:
            entry = await runtime.agent.mkdir(path)
        self._file_event(sandbox_id, "mkdir", path)
        return entry

    async def remove(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        async with self._call(sandbox_id, f"remove {path}") as runtime:
            await runtime.agent.remove(path, recursive=recursive)
        self._file_event(sandbox_id, "remove", path)

    async def rename(self, sandbox_id: str, source: str, destination: str) -> FileEntry:
        async with self._call(sandbox_id, f"rename {source}") as runtime:
            entry = await runtime.agent.rename(source, destination)
        self._file_event(sandbox_id, "rename", f"{source} -> {destination}")
        return entry
