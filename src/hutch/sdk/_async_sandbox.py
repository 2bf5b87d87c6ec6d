"""``AsyncSandbox``: :class:`hutch.Sandbox` for asyncio (the same calls, awaited)."""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import TypeVar

import httpx

from hutch.errors import NotFound
from hutch.sdk._async_client import (
    AsyncClient,
    AsyncResponseStream,
    AsyncUploadData,
    OutputCallback,
)
from hutch.sdk._config import Timeouts
from hutch.sdk._files_extra import AsyncFilesExtra
from hutch.sdk._interpreter import AsyncCodeRunner, AsyncContexts
from hutch.sdk._net import AsyncEgress, AsyncPorts, AsyncSandboxNetworks
from hutch.sdk._net_args import NetworkModeArg
from hutch.sdk._processes import AsyncProcesses
from hutch.sdk._pty import AsyncPty
from hutch.sdk._types import (
    ExecEvent,
    ExecResult,
    FileEntry,
    PauseModeArg,
    SandboxInfo,
    SnapshotInfo,
    WrittenFile,
)

__all__ = ["AsyncFiles", "AsyncSandbox"]

T = TypeVar("T")


class AsyncFiles(AsyncFilesExtra):
    """``sb.files`` of an :class:`AsyncSandbox`; see :class:`hutch.sdk.Files`."""

    def __init__(self, client: AsyncClient, sandbox_id: str) -> None:
        self._client = client
        self._id = sandbox_id

    async def write(self, path: str, data: AsyncUploadData, mode: int = 0o644) -> WrittenFile:
        """Like ``Files.write``; also takes async iterables and async file objects."""
        return await self._client.write_file(self._id, path, data, mode)

    async def read(self, path: str) -> bytes:
        return await self._client.read_file(self._id, path)

    def read_stream(self, path: str) -> AsyncResponseStream[bytes]:
        """``async for chunk in sb.files.read_stream(path)``."""
        return self._client.read_file_stream(self._id, path)

    async def list(self, path: str = ".") -> builtins.list[FileEntry]:
        return await self._client.list_files(self._id, path)

    async def stat(self, path: str) -> FileEntry:
        return await self._client.stat_file(self._id, path)

    async def mkdir(self, path: str) -> FileEntry:
        return await self._client.mkdir(self._id, path)

    async def rename(self, source: str, destination: str) -> FileEntry:
        return await self._client.rename(self._id, source, destination)

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._client.remove_file(self._id, path, recursive)


class AsyncSandbox(AsyncCodeRunner):
    """One sandbox, asyncio flavour: ``sb = await AsyncSandbox.create()``,
    ``async with sb: ...`` kills it at the end. See :class:`hutch.Sandbox`."""

    def __init__(
        self, client: AsyncClient, info: SandboxInfo, *, owns_client: bool = False
    ) -> None:
        self._client = client
        self._info = info
        self._owns_client = owns_client
        self._killed = False
        self.files = AsyncFiles(client, info.id)
        self.egress = AsyncEgress(client, info.id)
        self.ports = AsyncPorts(client, info.id)
        self.networks = AsyncSandboxNetworks(client, info.id)
        #: Background processes: ``sb.processes.start("python3 server.py")``.
        self.processes = AsyncProcesses(client, info.id)
        #: Interactive terminals: ``sb.pty.open(rows, cols)``, ``sb.pty.attach(pty_id)``.
        self.pty = AsyncPty(client, info.id)
        #: Code interpreter: ``await (await sb.contexts.create()).run("x = 1")``.
        self.contexts = AsyncContexts(client, info.id)

    @staticmethod
    def _client_for(
        client: AsyncClient | None,
        api_key: str | None,
        base_url: str | None,
        http_timeout: float | Timeouts | None,
        transport: httpx.AsyncBaseTransport | None,
    ) -> tuple[AsyncClient, bool]:
        if client is not None:
            return client, False
        return (
            AsyncClient(
                base_url=base_url, api_key=api_key, timeout=http_timeout, transport=transport
            ),
            True,
        )

    @classmethod
    async def _once(
        cls,
        call: Callable[[AsyncClient], Awaitable[T]],
        client: AsyncClient | None,
        api_key: str | None,
        base_url: str | None,
        http_timeout: float | Timeouts | None,
        transport: httpx.AsyncBaseTransport | None,
    ) -> T:
        """One call on ``client``, or on a client of its own that is closed afterwards."""
        http, owned = cls._client_for(client, api_key, base_url, http_timeout, transport)
        try:
            return await call(http)
        finally:
            if owned:
                await http.aclose()

    @classmethod
    async def create(
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
        snapshot: str | None = None,
        auto_pause_s: int | None = None,
        auto_delete_s: int | None = None,
        network: NetworkModeArg = "default",
        egress: Sequence[str] | None = None,
        networks: Sequence[str] | None = None,
        api_key: str | None = None,
        base_url: str | None = None,
        http_timeout: float | Timeouts | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        client: AsyncClient | None = None,
    ) -> AsyncSandbox:
        """See ``Sandbox.create`` (``snapshot``, ``auto_pause_s``, ``auto_delete_s``,
        ``network``, ``egress``, ``networks`` too)."""
        http, owned = cls._client_for(client, api_key, base_url, http_timeout, transport)
        try:
            info = await http.create_sandbox(
                image,
                vcpus=vcpus,
                memory_mib=memory_mib,
                disk_gib=disk_gib,
                env=env,
                metadata=metadata,
                name=name,
                timeout_s=timeout_s,
                auto_resume=auto_resume,
                snapshot=snapshot,
                auto_pause_s=auto_pause_s,
                auto_delete_s=auto_delete_s,
                network=network,
                egress=egress,
                networks=networks,
            )
        except BaseException:
            if owned:
                await http.aclose()
            raise
        return cls(http, info, owns_client=owned)

    @classmethod
    async def connect(
        cls,
        sandbox_id: str,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        http_timeout: float | Timeouts | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        client: AsyncClient | None = None,
    ) -> AsyncSandbox:
        http, owned = cls._client_for(client, api_key, base_url, http_timeout, transport)
        try:
            info = await http.get_sandbox(sandbox_id)
        except BaseException:
            if owned:
                await http.aclose()
            raise
        return cls(http, info, owns_client=owned)

    @classmethod
    async def list(
        cls,
        state: str | None = None,
        metadata: Mapping[str, str] | None = None,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        http_timeout: float | Timeouts | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        client: AsyncClient | None = None,
    ) -> builtins.list[SandboxInfo]:
        return await cls._once(
            lambda http: http.list_sandboxes(state, metadata),
            client,
            api_key,
            base_url,
            http_timeout,
            transport,
        )

    @classmethod
    async def list_snapshots(
        cls,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        http_timeout: float | Timeouts | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        client: AsyncClient | None = None,
    ) -> builtins.list[SnapshotInfo]:
        """See ``Sandbox.list_snapshots``."""
        return await cls._once(
            lambda http: http.list_snapshots(), client, api_key, base_url, http_timeout, transport
        )

    @classmethod
    async def get_snapshot(
        cls,
        snapshot_id: str,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        http_timeout: float | Timeouts | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        client: AsyncClient | None = None,
    ) -> SnapshotInfo:
        """See ``Sandbox.get_snapshot``."""
        return await cls._once(
            lambda http: http.get_snapshot(snapshot_id),
            client,
            api_key,
            base_url,
            http_timeout,
            transport,
        )

    @classmethod
    async def delete_snapshot(
        cls,
        snapshot_id: str,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        http_timeout: float | Timeouts | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        client: AsyncClient | None = None,
    ) -> None:
        """See ``Sandbox.delete_snapshot``: ``Conflict`` while a live sandbox uses it."""
        await cls._once(
            lambda http: http.delete_snapshot(snapshot_id),
            client,
            api_key,
            base_url,
            http_timeout,
            transport,
        )

    @property
    def id(self) -> str:
        return self._info.id

    @property
    def info(self) -> SandboxInfo:
        return self._info

    async def refresh(self) -> SandboxInfo:
        self._info = await self._client.get_sandbox(self.id)
        return self._info

    async def exec(
        self,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        timeout_s: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult:
        """See ``Sandbox.exec``; callbacks may be coroutine functions."""
        return await self._client.exec(
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
    ) -> AsyncResponseStream[ExecEvent]:
        """``async for event in sb.exec_stream(cmd)``: output events, then ``ExecExit``."""
        return self._client.exec_stream(
            self.id, cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s
        )

    async def pause(self, mode: PauseModeArg = "memory") -> SandboxInfo:
        """See ``Sandbox.pause``: pause and update :attr:`info`."""
        self._info = await self._client.pause_sandbox(self.id, mode)
        return self._info

    async def resume(self) -> SandboxInfo:
        """See ``Sandbox.resume``; a running sandbox is left as it is."""
        self._info = await self._client.resume_sandbox(self.id)
        return self._info

    async def fork(self, count: int = 1) -> builtins.list[AsyncSandbox]:
        """See ``Sandbox.fork``: the children share this handle's client."""
        children = await self._client.fork_sandbox(self.id, count)
        return [AsyncSandbox(self._client, info) for info in children]

    async def snapshot(self, name: str) -> SnapshotInfo:
        """See ``Sandbox.snapshot``: save it as ``name``; it runs on (or stays paused)."""
        return await self._client.create_snapshot(self.id, name)

    async def kill(self) -> None:
        """Destroy the sandbox. Idempotent."""
        if self._killed:
            return
        with contextlib.suppress(NotFound):
            await self._client.delete_sandbox(self.id)
        self._killed = True

    async def close(self) -> None:
        """Release the HTTP connections (the sandbox keeps running)."""
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.kill()
        finally:
            await self.close()

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} image={self._info.image} state={self._info.state}>"
