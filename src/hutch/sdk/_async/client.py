"""The client shell: sends what the sans-IO core builds, nothing more."""

from __future__ import annotations

import builtins
import os
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar, Unpack

import httpx

from hutch.contract.enums import DEFAULT_PAUSE_MODE
from hutch.contract.limits import DEFAULT_FILE_MODE, DEFAULT_FORK_COUNT, DEFAULT_IMAGE
from hutch.sdk import _io_async as _io
from hutch.sdk._async._closing import AsyncClosesOnExit
from hutch.sdk._async.hosts import AsyncHosts
from hutch.sdk._async.net import AsyncEgressPolicies, AsyncNetworks
from hutch.sdk._async.projects import AsyncKeys, AsyncProjects
from hutch.sdk._async.secrets import AsyncSecrets
from hutch.sdk._async.volumes import AsyncVolumes
from hutch.sdk._config import Timeouts, resolve_config
from hutch.sdk._core import Call, ClientCore
from hutch.sdk._errors import ClientClosed, ProtocolError
from hutch.sdk._exec import (
    CommandArgs,
    ExecCalls,
    ExecCollector,
    ExecEvent,
    ExecEventDecoder,
    ExecOutput,
    ExecResult,
)
from hutch.sdk._files import FileCalls, FileEntry, WrittenFile
from hutch.sdk._images import (
    BuildProgressCallback,
    ImageCalls,
    ImageProgressDecoder,
    ProgressCallback,
    archive_chunks,
    context_chunks,
    context_dockerfile,
    filename_of,
)
from hutch.sdk._sandboxes import (
    CreateArgs,
    Health,
    ImageInfo,
    PauseModeArg,
    SandboxCalls,
    SandboxInfo,
    SnapshotInfo,
)
from hutch.sdk._streams import BytesDecoder, StreamDecoder, StreamState
from hutch.sdk._usage import Event, EventDecoder, EventPage, TimeArg, Usage, UsageCalls

__all__ = ["AsyncClient", "AsyncResponseStream"]

T = TypeVar("T")


class AsyncClient(AsyncClosesOnExit):
    """A connection to one hutch daemon, addressed by sandbox id.

    :class:`hutch.AsyncSandbox` wraps this for one sandbox; use the client directly to
    share one connection pool between many sandboxes. ``transport`` replaces the network
    (tests pass ``httpx.MockTransport``). Close it (or use ``with``) to release
    connections.
    """

    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float | Timeouts | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        project: str | None = None,
    ) -> None:
        self.core = ClientCore(
            resolve_config(base_url=base_url, api_key=api_key, timeouts=timeout, project=project)
        )
        self._http = httpx.AsyncClient(transport=transport, trust_env=self.core.trust_env)
        self._sandboxes = SandboxCalls(self.core)
        self._exec = ExecCalls(self.core)
        self._files = FileCalls(self.core)
        self._images = ImageCalls(self.core)
        self._usage = UsageCalls(self.core)
        #: Private networks: ``client.networks.create(name)``, ``.list()``, ...
        self.networks = AsyncNetworks(self)
        #: Named egress policies: ``client.egress_policies.put(name, policy)``, ...
        self.egress_policies = AsyncEgressPolicies(self)
        #: Projects and quotas: ``client.projects.create(name, quotas)``, ``.list()``, ...
        self.projects = AsyncProjects(self)
        #: A project's API keys: ``client.keys.create(name, role)``, ``.list()``, ...
        self.keys = AsyncKeys(self)
        #: Volumes: ``client.volumes.create(name, size)``, ``.list()``, ``.grow()``, ...
        self.volumes = AsyncVolumes(self)
        #: Write-only secrets: ``client.secrets.set(name, value)``, ``.list()``, ...
        self.secrets = AsyncSecrets(self)
        #: The hosts of a cluster (admin): ``client.hosts.list()``, ``.drain(id)``
        self.hosts = AsyncHosts(self)

    @property
    def base_url(self) -> str:
        return self.core.base_url

    @property
    def project(self) -> str | None:
        """The project requests name (``Hutch-Project``), None when none is named."""
        return self.core.config.project

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
        return await self.call(self._sandboxes.health())

    async def create_sandbox(
        self, image: str = DEFAULT_IMAGE, **options: Unpack[CreateArgs]
    ) -> SandboxInfo:
        """Create a sandbox; ``options`` are the create fields (see ``Sandbox.create``)."""
        return await self.call(self._sandboxes.create(image, options))

    async def list_sandboxes(
        self, state: str | None = None, metadata: Mapping[str, str] | None = None
    ) -> builtins.list[SandboxInfo]:
        return await self.call(self._sandboxes.list(state, metadata))

    async def get_sandbox(self, sandbox_id: str) -> SandboxInfo:
        return await self.call(self._sandboxes.get(sandbox_id))

    async def delete_sandbox(self, sandbox_id: str) -> None:
        await self.call(self._sandboxes.delete(sandbox_id))

    async def pause_sandbox(
        self, sandbox_id: str, mode: PauseModeArg = DEFAULT_PAUSE_MODE
    ) -> SandboxInfo:
        return await self.call(self._sandboxes.pause(sandbox_id, mode))

    async def grow_disk(self, sandbox_id: str, disk_gib: int) -> SandboxInfo:
        return await self.call(self._sandboxes.grow_disk(sandbox_id, disk_gib))

    async def resume_sandbox(
        self, sandbox_id: str, placement: Mapping[str, Any] | None = None
    ) -> SandboxInfo:
        return await self.call(self._sandboxes.resume(sandbox_id, placement))

    async def fork_sandbox(
        self, sandbox_id: str, count: int = DEFAULT_FORK_COUNT
    ) -> builtins.list[SandboxInfo]:
        return await self.call(self._sandboxes.fork(sandbox_id, count))

    async def create_snapshot(self, sandbox_id: str, name: str) -> SnapshotInfo:
        """Save sandbox ``sandbox_id`` (running or paused; it stays so) as ``name``."""
        return await self.call(self._sandboxes.create_snapshot(sandbox_id, name))

    async def list_snapshots(self) -> builtins.list[SnapshotInfo]:
        return await self.call(self._sandboxes.list_snapshots())

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return await self.call(self._sandboxes.get_snapshot(snapshot_id))

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Works in any order: what is built on it stays usable."""
        await self.call(self._sandboxes.delete_snapshot(snapshot_id))

    async def exec(
        self,
        sandbox_id: str,
        cmd: str | Sequence[str],
        *,
        on_stdout: _io.OutputCallback | None = None,
        on_stderr: _io.OutputCallback | None = None,
        **options: Unpack[CommandArgs],
    ) -> ExecResult:
        """Run ``cmd`` and wait for it. With a callback, output streams into it as it
        arrives (and is still collected into the result); the asyncio client takes
        coroutine functions too."""
        if on_stdout is None and on_stderr is None:
            return await self.call(self._exec.collected(sandbox_id, cmd, options))
        collector = ExecCollector()
        async with self.exec_stream(sandbox_id, cmd, **options) as events:
            async for event in events:
                collector.add(event)
                if isinstance(event, ExecOutput):
                    callback = on_stdout if event.stream == "stdout" else on_stderr
                    if callback is not None:
                        await _io.call_back(callback, event.data)
        return collector.result()

    def exec_stream(
        self, sandbox_id: str, cmd: str | Sequence[str], **options: Unpack[CommandArgs]
    ) -> AsyncResponseStream[ExecEvent]:
        """Events as they happen: iterate it (the request starts then)."""
        request = self._exec.request(sandbox_id, cmd, options, stream=True)
        return AsyncResponseStream(self, request, ExecEventDecoder())

    async def write_file(
        self, sandbox_id: str, path: str, data: _io.AsyncUploadData, mode: int = DEFAULT_FILE_MODE
    ) -> WrittenFile:
        body = _io.upload_body(data)
        return await self.call(self._files.write(sandbox_id, path, body, mode))

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return b"".join([chunk async for chunk in self.read_file_stream(sandbox_id, path)])

    def read_file_stream(self, sandbox_id: str, path: str) -> AsyncResponseStream[bytes]:
        request = self._files.read_request(sandbox_id, path)
        return AsyncResponseStream(self, request, BytesDecoder())

    async def list_files(self, sandbox_id: str, path: str) -> builtins.list[FileEntry]:
        return await self.call(self._files.list(sandbox_id, path))

    async def stat_file(self, sandbox_id: str, path: str) -> FileEntry:
        return await self.call(self._files.stat(sandbox_id, path))

    async def mkdir(self, sandbox_id: str, path: str) -> FileEntry:
        return await self.call(self._files.mkdir(sandbox_id, path))

    async def rename(self, sandbox_id: str, source: str, destination: str) -> FileEntry:
        return await self.call(self._files.rename(sandbox_id, source, destination))

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        await self.call(self._files.remove(sandbox_id, path, recursive))

    async def usage(
        self,
        start: TimeArg | None = None,
        end: TimeArg | None = None,
        *,
        group_by: str = "sandbox",
        project: str | None = None,
    ) -> Usage:
        """Metered usage and cost over [start, end) (default: this UTC month so far),
        by ``sandbox``, ``day`` or ``project`` (admin); times are epoch seconds,
        datetimes (naive = UTC) or ISO 8601 text."""
        return await self.call(
            self._usage.usage(start=start, end=end, group_by=group_by, project=project)
        )

    async def events(
        self,
        *,
        sandbox_id: str | None = None,
        types: str | Sequence[str] | None = None,
        after: int = 0,
        limit: int = 100,
    ) -> EventPage:
        """The project's audit trail, oldest first: a page of events after ``after``
        (``page.next_after`` continues); ``types`` like ``sandbox.exec`` or ``sandbox.*``."""
        return await self.call(
            self._usage.events(sandbox_id=sandbox_id, types=types, after=after, limit=limit)
        )

    async def sandbox_events(
        self,
        sandbox_id: str,
        *,
        types: str | Sequence[str] | None = None,
        after: int = 0,
        limit: int = 100,
    ) -> EventPage:
        return await self.call(
            self._usage.sandbox_events(sandbox_id, types=types, after=after, limit=limit)
        )

    def follow_events(
        self, sandbox_id: str, *, types: str | Sequence[str] | None = None, after: int = 0
    ) -> AsyncResponseStream[Event]:
        """The sandbox's events after ``after``, then each as it happens; the stream
        ends when the sandbox has ended (iterate it; close it to stop early)."""
        request = self._usage.follow_request(sandbox_id, types=types, after=after)
        return AsyncResponseStream(self, request, EventDecoder())

    async def list_images(self) -> builtins.list[ImageInfo]:
        return await self.call(self._sandboxes.list_images())

    async def import_image(
        self,
        name: str,
        source: str | os.PathLike[str] | bytes | Iterable[bytes],
        *,
        start: bool = False,
        filename: str | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> ImageInfo:
        """Import an OCI image as ``name`` from ``source``: an oci-archive or
        docker-archive file (gzip is fine), an OCI layout directory, or bytes.
        ``start``: run the image's Entrypoint + Cmd when a sandbox of it boots."""
        body = _io.tar_pieces(iter(archive_chunks(source)))
        request = self._images.import_request(
            name, body, start=start, filename=filename or filename_of(source)
        )
        return await self._image_call(request, on_progress)

    async def pull_image(
        self,
        name: str,
        ref: str,
        *,
        username: str | None = None,
        password: str | None = None,
        token: str | None = None,
        start: bool = False,
        on_progress: ProgressCallback | None = None,
    ) -> ImageInfo:
        """Pull ``ref`` (``[registry/]repo[:tag][@digest]``) from a registry as ``name``."""
        request = self._images.pull_request(
            name, ref, username=username, password=password, token=token, start=start
        )
        return await self._image_call(request, on_progress)

    async def build_image(
        self,
        name: str,
        context: str | os.PathLike[str] = ".",
        *,
        dockerfile: str | os.PathLike[str] | None = None,
        build_args: Mapping[str, str] | None = None,
        egress: Sequence[str] | None = None,
        network: str | None = None,
        vcpus: int | None = None,
        memory_mib: int | None = None,
        disk_gib: int | None = None,
        timeout_s: int | None = None,
        no_cache: bool = False,
        start: bool = False,
        on_progress: BuildProgressCallback | None = None,
    ) -> ImageInfo:
        """Build image ``name`` from a Dockerfile, ``docker build`` style: ``context`` is
        a directory (what its ``.dockerignore`` names is not sent), ``dockerfile`` the
        Dockerfile's path (default ``context/Dockerfile``; it may be outside the
        context). RUN steps run in a build sandbox (a VM) of this shape, with these
        ``egress`` rules (none: open) and ``network``; every step is cached by its
        inputs (``no_cache``: run them all again). ``on_progress`` gets each
        :class:`BuildEvent` (steps, RUN output). A failing RUN raises ``BuildFailed``
        with its exit code and the end of its output; nothing is built then."""
        root = os.fspath(context)
        in_tar = context_dockerfile(Path(root), dockerfile)
        body = _io.tar_pieces(context_chunks(root, in_tar))
        request = self._images.build_request(
            name,
            body,
            dockerfile=in_tar[0],
            build_args=dict(build_args or {}),
            egress=egress,
            network=network,
            vcpus=vcpus,
            memory_mib=memory_mib,
            disk_gib=disk_gib,
            timeout_s=timeout_s,
            no_cache=no_cache,
            start=start,
        )
        return await self._image_call(request, on_progress)

    async def delete_image(self, name: str) -> None:
        """Delete an imported image (refused while a sandbox or snapshot uses it)."""
        await self.call(self._images.delete(name))

    async def _image_call(
        self,
        request: httpx.Request,
        on_progress: Callable[[Any], None] | None,
    ) -> ImageInfo:
        decoder = ImageProgressDecoder()
        async with AsyncResponseStream(self, request, decoder) as stream:
            async for item in stream:
                if isinstance(item, ImageInfo):
                    return item
                if on_progress is not None:
                    on_progress(item)
        if decoder.error is not None:
            raise decoder.error
        raise ProtocolError("the image stream ended without its result")


class AsyncResponseStream(AsyncClosesOnExit, Generic[T]):
    """An iterator over a streamed answer: exec events, file chunks, process output.

    The request is sent on the first ``next()`` (errors such as ``NotFound`` surface
    there), and the connection is released as soon as the body is complete. Breaking out
    early? Use ``with`` or call :meth:`aclose`.
    """

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
            raise self._client.core.body_error(exc) from exc

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
