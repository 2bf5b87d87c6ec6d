"""The asyncio shell: the same calls as :mod:`hutch.sdk._client`, awaited.

Every request is built and every answer read by the shared :class:`ClientCore`; only
sending and byte-moving differ here.
"""

from __future__ import annotations

import asyncio
import builtins
import inspect
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import httpx

from hutch.sdk._bodies import (
    CHUNK_SIZE,
    BytesDecoder,
    ExecCollector,
    ExecEventDecoder,
    StreamDecoder,
    StreamState,
    UploadData,
    sync_upload_chunks,
)
from hutch.sdk._closing import AsyncClosesOnExit
from hutch.sdk._config import Timeouts, resolve_config
from hutch.sdk._core import Call, ClientCore
from hutch.sdk._errors import ClientClosed
from hutch.sdk._net import AsyncNetworks
from hutch.sdk._net_args import NetworkModeArg
from hutch.sdk._types import (
    ExecEvent,
    ExecOutput,
    ExecResult,
    FileEntry,
    Health,
    ImageInfo,
    PauseModeArg,
    SandboxInfo,
    SnapshotInfo,
    WrittenFile,
)

__all__ = ["AsyncClient", "AsyncResponseStream", "AsyncUploadData", "OutputCallback"]

T = TypeVar("T")

#: ``files.write`` on the async client also takes async iterables and async readers.
AsyncUploadData = UploadData | AsyncIterable[bytes] | Any
#: An output callback may be a plain function or a coroutine function.
OutputCallback = Callable[[str], Awaitable[object] | object]


class AsyncClient(AsyncClosesOnExit):
    """The asyncio twin of :class:`hutch.sdk.Client`; see there."""

    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float | Timeouts | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.core = ClientCore(resolve_config(base_url=base_url, api_key=api_key, timeouts=timeout))
        self._http = httpx.AsyncClient(transport=transport, trust_env=self.core.trust_env)
        #: Private networks: ``await client.networks.create(name)``, ...
        self.networks = AsyncNetworks(self)

    @property
    def base_url(self) -> str:
        return self.core.base_url

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- I/O primitives -----------------------------------------------------------

    async def send(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        """Send; raise the typed hutch error for a failure or a status >= 400."""
        if self._http.is_closed:
            raise ClientClosed(
                "this hutch client is closed (a Sandbox closes its own when its `with` "
                "block ends); reconnect with Sandbox.connect(id)"
            )
        try:
            response = await self._http.send(request, stream=stream)
        except httpx.HTTPError as exc:
            raise self.core.transport_error(exc) from exc
        if response.status_code >= 400:
            try:
                await response.aread()
            except httpx.HTTPError as exc:
                raise self.core.transport_error(exc) from exc
            finally:
                await response.aclose()
            raise self.core.error_from_response(response)
        return response

    async def call(self, call: Call[T]) -> T:
        return call.parse(await self.send(call.request))

    # -- API ----------------------------------------------------------------------

    async def health(self) -> Health:
        return await self.call(self.core.health())

    async def create_sandbox(
        self,
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
    ) -> SandboxInfo:
        return await self.call(
            self.core.create_sandbox(
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
        )

    async def list_sandboxes(
        self, state: str | None = None, metadata: Mapping[str, str] | None = None
    ) -> list[SandboxInfo]:
        return await self.call(self.core.list_sandboxes(state, metadata))

    async def get_sandbox(self, sandbox_id: str) -> SandboxInfo:
        return await self.call(self.core.get_sandbox(sandbox_id))

    async def delete_sandbox(self, sandbox_id: str) -> None:
        await self.call(self.core.delete_sandbox(sandbox_id))

    async def pause_sandbox(self, sandbox_id: str, mode: PauseModeArg = "memory") -> SandboxInfo:
        return await self.call(self.core.pause_sandbox(sandbox_id, mode))

    async def resume_sandbox(self, sandbox_id: str) -> SandboxInfo:
        return await self.call(self.core.resume_sandbox(sandbox_id))

    async def fork_sandbox(self, sandbox_id: str, count: int = 1) -> builtins.list[SandboxInfo]:
        return await self.call(self.core.fork_sandbox(sandbox_id, count))

    async def create_snapshot(self, sandbox_id: str, name: str) -> SnapshotInfo:
        """Save sandbox ``sandbox_id`` (running or paused; it stays so) as ``name``."""
        return await self.call(self.core.create_snapshot(sandbox_id, name))

    async def list_snapshots(self) -> builtins.list[SnapshotInfo]:
        return await self.call(self.core.list_snapshots())

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return await self.call(self.core.get_snapshot(snapshot_id))

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Works in any order: what is built on it stays usable."""
        await self.call(self.core.delete_snapshot(snapshot_id))

    async def exec(
        self,
        sandbox_id: str,
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
        """Run ``cmd`` and wait for it; callbacks (sync or async) get output as it comes."""
        if on_stdout is None and on_stderr is None:
            return await self.call(
                self.core.exec_call(
                    sandbox_id,
                    cmd,
                    env=env,
                    cwd=cwd,
                    user=user,
                    stdin=stdin,
                    timeout_s=timeout_s,
                )
            )
        collector = ExecCollector()
        async with self.exec_stream(
            sandbox_id, cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s
        ) as events:
            async for event in events:
                collector.add(event)
                if isinstance(event, ExecOutput):
                    callback = on_stdout if event.stream == "stdout" else on_stderr
                    if callback is not None:
                        outcome = callback(event.data)
                        if inspect.isawaitable(outcome):
                            await outcome
        return collector.result()

    def exec_stream(
        self,
        sandbox_id: str,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        timeout_s: float | None = None,
    ) -> AsyncResponseStream[ExecEvent]:
        """Events as they happen; ``async for`` over it (the request starts then)."""
        request = self.core.exec_request(
            sandbox_id,
            cmd,
            env=env,
            cwd=cwd,
            user=user,
            stdin=stdin,
            timeout_s=timeout_s,
            stream=True,
        )
        return AsyncResponseStream(self, request, ExecEventDecoder())

    async def write_file(
        self, sandbox_id: str, path: str, data: AsyncUploadData, mode: int = 0o644
    ) -> WrittenFile:
        return await self.call(
            self.core.write_file(sandbox_id, path, _async_upload_chunks(data), mode)
        )

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return b"".join([chunk async for chunk in self.read_file_stream(sandbox_id, path)])

    def read_file_stream(self, sandbox_id: str, path: str) -> AsyncResponseStream[bytes]:
        request = self.core.read_file_request(sandbox_id, path)
        return AsyncResponseStream(self, request, BytesDecoder())

    async def list_files(self, sandbox_id: str, path: str) -> builtins.list[FileEntry]:
        return await self.call(self.core.list_files(sandbox_id, path))

    async def stat_file(self, sandbox_id: str, path: str) -> FileEntry:
        return await self.call(self.core.stat_file(sandbox_id, path))

    async def mkdir(self, sandbox_id: str, path: str) -> FileEntry:
        return await self.call(self.core.mkdir(sandbox_id, path))

    async def rename(self, sandbox_id: str, source: str, destination: str) -> FileEntry:
        return await self.call(self.core.rename(sandbox_id, source, destination))

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        await self.call(self.core.remove_file(sandbox_id, path, recursive))

    async def list_images(self) -> builtins.list[ImageInfo]:
        return await self.call(self.core.list_images())


def _async_upload_chunks(data: AsyncUploadData) -> bytes | AsyncIterator[bytes]:
    """Like :func:`sync_upload_chunks`, plus async sources; blocking file reads run in a
    worker thread so a big upload does not stall the event loop."""
    if isinstance(data, AsyncIterable):
        return _encode_async(data)
    read = getattr(data, "read", None)
    if callable(read):
        return _read_async(read)
    chunks = sync_upload_chunks(data)
    if isinstance(chunks, bytes):
        return chunks
    return _iter_async(chunks)


async def _encode_async(source: AsyncIterable[Any]) -> AsyncIterator[bytes]:
    async for chunk in source:
        yield chunk.encode() if isinstance(chunk, str) else bytes(chunk)


async def _read_async(read: Callable[[int], Any]) -> AsyncIterator[bytes]:
    is_async = inspect.iscoroutinefunction(read)
    while True:
        chunk = await read(CHUNK_SIZE) if is_async else await asyncio.to_thread(read, CHUNK_SIZE)
        if not chunk:
            return
        yield chunk.encode() if isinstance(chunk, str) else bytes(chunk)


async def _iter_async(chunks: Any) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


class AsyncResponseStream(AsyncClosesOnExit, Generic[T]):
    """``async for`` over a streamed answer; see :class:`hutch.sdk.ResponseStream`."""

    def __init__(
        self, client: AsyncClient, request: httpx.Request, decoder: StreamDecoder[T]
    ) -> None:
        self._client = client
        self._request = request
        self._state = StreamState(decoder)
        self._response: httpx.Response | None = None
        self._chunks: AsyncIterator[bytes] | None = None
        self._closed = False

    def __aiter__(self) -> AsyncResponseStream[T]:
        return self

    async def __anext__(self) -> T:
        try:
            while not self._state.has_item:
                if self._state.finished or self._closed:
                    await self.aclose()
                    raise StopAsyncIteration
                chunk = await self._read()
                if chunk is None:
                    self._state.eof()
                else:
                    self._state.feed(chunk)
                if self._state.finished:
                    await self._release()
            return self._state.next_item()
        except StopAsyncIteration:
            raise
        except BaseException:
            await self.aclose()
            raise

    async def _read(self) -> bytes | None:
        if self._response is None:
            self._response = await self._client.send(self._request, stream=True)
            self._chunks = self._response.aiter_bytes()
        assert self._chunks is not None
        try:
            return await anext(self._chunks)
        except StopAsyncIteration:
            return None
        except httpx.HTTPError as exc:
            raise self._client.core.transport_error(exc) from exc

    async def _release(self) -> None:
        chunks, self._chunks = self._chunks, None
        # Finalize httpx's byte generator here rather than leaving it to the event loop's
        # async-generator hooks, which may run after the loop is gone.
        close_chunks = getattr(chunks, "aclose", None)
        if close_chunks is not None:
            await close_chunks()
        if self._response is not None:
            response, self._response = self._response, None
            await response.aclose()

    async def aclose(self) -> None:
        """Stop reading and release the connection. Safe to call twice."""
        self._closed = True
        await self._release()
