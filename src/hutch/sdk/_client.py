"""The synchronous shell: sends what :class:`ClientCore` builds, nothing more."""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Generic, TypeVar

import httpx

from hutch.sdk._bodies import (
    BytesDecoder,
    ExecCollector,
    ExecEventDecoder,
    StreamDecoder,
    StreamState,
    UploadData,
    sync_upload_chunks,
)
from hutch.sdk._closing import ClosesOnExit
from hutch.sdk._config import Timeouts, resolve_config
from hutch.sdk._core import Call, ClientCore
from hutch.sdk._errors import ClientClosed
from hutch.sdk._net import Networks
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

__all__ = ["Client", "ResponseStream"]

T = TypeVar("T")


class Client(ClosesOnExit):
    """A blocking connection to one hutch daemon, addressed by sandbox id.

    :class:`hutch.Sandbox` wraps this for one sandbox; use the client directly to share one
    connection pool between many sandboxes. ``transport`` replaces the network (tests pass
    ``httpx.MockTransport``). Close it (or use ``with``) to release connections.
    """

    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float | Timeouts | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.core = ClientCore(resolve_config(base_url=base_url, api_key=api_key, timeouts=timeout))
        self._http = httpx.Client(transport=transport, trust_env=self.core.trust_env)
        #: Private networks: ``client.networks.create(name)``, ``.list()``, ...
        self.networks = Networks(self)

    @property
    def base_url(self) -> str:
        return self.core.base_url

    def close(self) -> None:
        self._http.close()

    # -- I/O primitives -----------------------------------------------------------

    def send(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        """Send; raise the typed hutch error for a failure or a status >= 400."""
        if self._http.is_closed:
            raise ClientClosed(
                "this hutch client is closed (a Sandbox closes its own when its `with` "
                "block ends); reconnect with Sandbox.connect(id)"
            )
        try:
            response = self._http.send(request, stream=stream)
        except httpx.HTTPError as exc:
            raise self.core.transport_error(exc) from exc
        if response.status_code >= 400:
            try:
                response.read()
            except httpx.HTTPError as exc:
                raise self.core.transport_error(exc) from exc
            finally:
                response.close()
            raise self.core.error_from_response(response)
        return response

    def call(self, call: Call[T]) -> T:
        return call.parse(self.send(call.request))

    # -- API ----------------------------------------------------------------------

    def health(self) -> Health:
        return self.call(self.core.health())

    def create_sandbox(
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
        return self.call(
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

    def list_sandboxes(
        self, state: str | None = None, metadata: Mapping[str, str] | None = None
    ) -> list[SandboxInfo]:
        return self.call(self.core.list_sandboxes(state, metadata))

    def get_sandbox(self, sandbox_id: str) -> SandboxInfo:
        return self.call(self.core.get_sandbox(sandbox_id))

    def delete_sandbox(self, sandbox_id: str) -> None:
        self.call(self.core.delete_sandbox(sandbox_id))

    def pause_sandbox(self, sandbox_id: str, mode: PauseModeArg = "memory") -> SandboxInfo:
        return self.call(self.core.pause_sandbox(sandbox_id, mode))

    def resume_sandbox(self, sandbox_id: str) -> SandboxInfo:
        return self.call(self.core.resume_sandbox(sandbox_id))

    def fork_sandbox(self, sandbox_id: str, count: int = 1) -> builtins.list[SandboxInfo]:
        return self.call(self.core.fork_sandbox(sandbox_id, count))

    def create_snapshot(self, sandbox_id: str, name: str) -> SnapshotInfo:
        """Save sandbox ``sandbox_id`` (running or paused; it stays so) as ``name``."""
        return self.call(self.core.create_snapshot(sandbox_id, name))

    def list_snapshots(self) -> builtins.list[SnapshotInfo]:
        return self.call(self.core.list_snapshots())

    def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return self.call(self.core.get_snapshot(snapshot_id))

    def delete_snapshot(self, snapshot_id: str) -> None:
        """Works in any order: what is built on it stays usable."""
        self.call(self.core.delete_snapshot(snapshot_id))

    def exec(
        self,
        sandbox_id: str,
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
        """Run ``cmd`` and wait for it. With a callback, output streams into it as it
        arrives (and is still collected into the result)."""
        if on_stdout is None and on_stderr is None:
            return self.call(
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
        with self.exec_stream(
            sandbox_id, cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s
        ) as events:
            for event in events:
                collector.add(event)
                if isinstance(event, ExecOutput):
                    callback = on_stdout if event.stream == "stdout" else on_stderr
                    if callback is not None:
                        callback(event.data)
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
    ) -> ResponseStream[ExecEvent]:
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
        return ResponseStream(self, request, ExecEventDecoder())

    def write_file(
        self, sandbox_id: str, path: str, data: UploadData, mode: int = 0o644
    ) -> WrittenFile:
        return self.call(self.core.write_file(sandbox_id, path, sync_upload_chunks(data), mode))

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        return b"".join(self.read_file_stream(sandbox_id, path))

    def read_file_stream(self, sandbox_id: str, path: str) -> ResponseStream[bytes]:
        return ResponseStream(self, self.core.read_file_request(sandbox_id, path), BytesDecoder())

    def list_files(self, sandbox_id: str, path: str) -> builtins.list[FileEntry]:
        return self.call(self.core.list_files(sandbox_id, path))

    def stat_file(self, sandbox_id: str, path: str) -> FileEntry:
        return self.call(self.core.stat_file(sandbox_id, path))

    def mkdir(self, sandbox_id: str, path: str) -> FileEntry:
        return self.call(self.core.mkdir(sandbox_id, path))

    def rename(self, sandbox_id: str, source: str, destination: str) -> FileEntry:
        return self.call(self.core.rename(sandbox_id, source, destination))

    def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        self.call(self.core.remove_file(sandbox_id, path, recursive))

    def list_images(self) -> builtins.list[ImageInfo]:
        return self.call(self.core.list_images())


class ResponseStream(ClosesOnExit, Generic[T]):
    """An iterator over a streamed answer: exec events or file chunks.

    The request is sent on the first ``next()`` (errors such as ``NotFound`` surface
    there), and the connection is released as soon as the body is complete. Breaking out
    early? Use ``with`` or call :meth:`close`.
    """

    def __init__(self, client: Client, request: httpx.Request, decoder: StreamDecoder[T]):
        self._client = client
        self._request = request
        self._state = StreamState(decoder)
        self._response: httpx.Response | None = None
        self._chunks: Iterator[bytes] | None = None
        self._closed = False

    def __iter__(self) -> ResponseStream[T]:
        return self

    def __next__(self) -> T:
        try:
            while not self._state.has_item:
                if self._state.finished or self._closed:
                    self.close()
                    raise StopIteration
                chunk = self._read()
                if chunk is None:
                    self._state.eof()
                else:
                    self._state.feed(chunk)
                if self._state.finished:
                    self._release()
            return self._state.next_item()
        except StopIteration:
            raise
        except BaseException:
            self.close()
            raise

    def _read(self) -> bytes | None:
        if self._chunks is None:
            self._response = self._client.send(self._request, stream=True)
            self._chunks = self._response.iter_bytes()
        try:
            return next(self._chunks)
        except StopIteration:
            return None
        except httpx.HTTPError as exc:
            raise self._client.core.transport_error(exc) from exc

    def _release(self) -> None:
        if self._response is not None:
            self._response.close()
            self._response = None

    def close(self) -> None:
        """Stop reading and release the connection. Safe to call twice."""
        self._closed = True
        self._release()
