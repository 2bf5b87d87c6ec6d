"""``Sandbox``: a handle on one sandbox, in the shape E2B users know (blocking)."""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType

import httpx

from hutch.errors import NotFound
from hutch.sdk._bodies import UploadData
from hutch.sdk._client import Client, ResponseStream
from hutch.sdk._config import Timeouts
from hutch.sdk._types import (
    ExecEvent,
    ExecResult,
    FileEntry,
    PauseModeArg,
    SandboxInfo,
    WrittenFile,
)

__all__ = ["Files", "Sandbox"]


class Files:
    """The filesystem of one sandbox (``sb.files``). Relative paths are resolved by the
    guest agent (from the sandbox user's home directory)."""

    def __init__(self, client: Client, sandbox_id: str) -> None:
        self._client = client
        self._id = sandbox_id

    def write(self, path: str, data: UploadData, mode: int = 0o644) -> WrittenFile:
        """Create or replace ``path`` with ``data`` (bytes, str as UTF-8, a binary file
        object or an iterator of bytes; streamed, never loaded whole)."""
        return self._client.write_file(self._id, path, data, mode)

    def read(self, path: str) -> bytes:
        return self._client.read_file(self._id, path)

    def read_stream(self, path: str) -> ResponseStream[bytes]:
        """Chunks of ``path`` as they arrive; use for big files."""
        return self._client.read_file_stream(self._id, path)

    def list(self, path: str = ".") -> builtins.list[FileEntry]:
        return self._client.list_files(self._id, path)

    def stat(self, path: str) -> FileEntry:
        return self._client.stat_file(self._id, path)

    def mkdir(self, path: str) -> FileEntry:
        """Create ``path`` and missing parents."""
        return self._client.mkdir(self._id, path)

    def rename(self, source: str, destination: str) -> FileEntry:
        return self._client.rename(self._id, source, destination)

    def remove(self, path: str, recursive: bool = False) -> None:
        self._client.remove_file(self._id, path, recursive)


class Sandbox:
    """One micro-VM sandbox. Create with :meth:`create`, attach with :meth:`connect`.

    ``with Sandbox.create() as sb:`` kills the sandbox when the block ends. A sandbox
    made by ``create``/``connect`` owns its HTTP connection pool; pass ``client=`` to
    share one :class:`hutch.sdk.Client` between many sandboxes instead.
    """

    def __init__(self, client: Client, info: SandboxInfo, *, owns_client: bool = False):
        self._client = client
        self._info = info
        self._owns_client = owns_client
        self._killed = False
        self.files = Files(client, info.id)

    @staticmethod
    def _client_for(
        client: Client | None,
        api_key: str | None,
        base_url: str | None,
        http_timeout: float | Timeouts | None,
        transport: httpx.BaseTransport | None,
    ) -> tuple[Client, bool]:
        if client is not None:
            return client, False
        return (
            Client(base_url=base_url, api_key=api_key, timeout=http_timeout, transport=transport),
            True,
        )

    @classmethod
    def create(
        cls,
        image: str = "base",
        *,
        vcpus: int = 1,
        memory_mib: int = 512,
        disk_gib: int = 4,
        env: Mapping[str, str] | None = None,
        metadata: Mapping[str, str] | None = None,
        name: str | None = None,
        timeout_s: int | None = None,
        auto_resume: bool = False,
        api_key: str | None = None,
        base_url: str | None = None,
        http_timeout: float | Timeouts | None = None,
        transport: httpx.BaseTransport | None = None,
        client: Client | None = None,
    ) -> Sandbox:
        """Boot a sandbox and return once its guest answers. ``timeout_s``: the daemon
        destroys it after that many seconds (None: never). ``auto_resume``: commands and
        file calls to it while it is paused resume it first instead of failing with
        ``StateError``."""
        http, owned = cls._client_for(client, api_key, base_url, http_timeout, transport)
        try:
            info = http.create_sandbox(
                image,
                vcpus=vcpus,
                memory_mib=memory_mib,
                disk_gib=disk_gib,
                env=env,
                metadata=metadata,
                name=name,
                timeout_s=timeout_s,
                auto_resume=auto_resume,
            )
        except BaseException:
            if owned:
                http.close()
            raise
        return cls(http, info, owns_client=owned)

    @classmethod
    def connect(
        cls,
        sandbox_id: str,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        http_timeout: float | Timeouts | None = None,
        transport: httpx.BaseTransport | None = None,
        client: Client | None = None,
    ) -> Sandbox:
        """Attach to an existing sandbox; raises ``NotFound`` if there is none."""
        http, owned = cls._client_for(client, api_key, base_url, http_timeout, transport)
        try:
            info = http.get_sandbox(sandbox_id)
        except BaseException:
            if owned:
                http.close()
            raise
        return cls(http, info, owns_client=owned)

    @classmethod
    def list(
        cls,
        state: str | None = None,
        metadata: Mapping[str, str] | None = None,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        http_timeout: float | Timeouts | None = None,
        transport: httpx.BaseTransport | None = None,
        client: Client | None = None,
    ) -> builtins.list[SandboxInfo]:
        """Sandboxes that are not destroyed (or those in ``state``), filtered by
        ``metadata`` (all pairs must match)."""
        http, owned = cls._client_for(client, api_key, base_url, http_timeout, transport)
        try:
            return http.list_sandboxes(state, metadata)
        finally:
            if owned:
                http.close()

    @property
    def id(self) -> str:
        return self._info.id

    @property
    def info(self) -> SandboxInfo:
        """What the daemon said last; :meth:`refresh` asks again."""
        return self._info

    def refresh(self) -> SandboxInfo:
        self._info = self._client.get_sandbox(self.id)
        return self._info

    def exec(
        self,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        timeout_s: float | None = None,
        on_stdout: Callable[[str], object] | None = None,
        on_stderr: Callable[[str], object] | None = None,
    ) -> ExecResult:
        """Run ``cmd`` (a string runs under ``/bin/sh -c``) and wait for it to end.

        A nonzero exit is not an error: check ``result.exit_code``. Raises ``Timeout``
        when ``timeout_s`` passes. With ``on_stdout``/``on_stderr`` the output streams
        into the callbacks as it arrives.
        """
        return self._client.exec(
            self.id,
            cmd,
            env=env,
            cwd=cwd,
            user=user,
            stdin=stdin,
            timeout_s=timeout_s,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
        )

    def exec_stream(
        self,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        timeout_s: float | None = None,
    ) -> ResponseStream[ExecEvent]:
        """Iterate ``ExecOutput(stream, data)`` events, then one final ``ExecExit``."""
        return self._client.exec_stream(
            self.id, cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s
        )

    def pause(self, mode: PauseModeArg = "memory") -> SandboxInfo:
        """Pause the sandbox and update :attr:`info` (state ``paused``).

        ``mode="memory"`` saves CPU, memory and devices: after :meth:`resume` its
        processes carry on where they were. ``mode="disk"`` keeps only the disk: resume
        boots it again. Raises ``StateError`` unless it is running.
        """
        self._info = self._client.pause_sandbox(self.id, mode)
        return self._info

    def resume(self) -> SandboxInfo:
        """Start a paused sandbox again and update :attr:`info` (state ``running``).
        Resuming a running sandbox does nothing."""
        self._info = self._client.resume_sandbox(self.id)
        return self._info

    def fork(self, count: int = 1) -> builtins.list[Sandbox]:
        """``count`` (1-100) new sandboxes, each a copy of this one as it is now (memory,
        processes and disk); this one is left running or paused as it was.

        The children share this handle's HTTP client: they work until it is closed
        (by :meth:`close` or the end of this sandbox's ``with`` block); a ``with`` on a
        child kills that child. Use ``Sandbox.connect(child.id)`` for a handle of its own.
        """
        children = self._client.fork_sandbox(self.id, count)
        return [Sandbox(self._client, info) for info in children]

    def kill(self) -> None:
        """Destroy the sandbox. Idempotent: killing a gone sandbox is not an error."""
        if self._killed:
            return
        with contextlib.suppress(NotFound):
            self._client.delete_sandbox(self.id)
        self._killed = True

    def close(self) -> None:
        """Release the HTTP connections (the sandbox keeps running)."""
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.kill()
        finally:
            self.close()

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} image={self._info.image} state={self._info.state}>"
