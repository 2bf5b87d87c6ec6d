"""``Sandbox``: a handle on one sandbox, in the shape E2B users know (blocking)."""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import TypeVar

import httpx

from hutch.errors import NotFound
from hutch.sdk._bodies import UploadData
from hutch.sdk._client import Client, ResponseStream
from hutch.sdk._config import Timeouts
from hutch.sdk._files_extra import FilesExtra
from hutch.sdk._interpreter import CodeRunner, Contexts
from hutch.sdk._net import Egress, Ports, SandboxNetworks
from hutch.sdk._net_args import NetworkModeArg
from hutch.sdk._processes import Processes
from hutch.sdk._pty import Pty
from hutch.sdk._types import (
    ExecEvent,
    ExecResult,
    FileEntry,
    PauseModeArg,
    SandboxInfo,
    SnapshotInfo,
    WrittenFile,
)

__all__ = ["Files", "Sandbox"]

T = TypeVar("T")


class Files(FilesExtra):
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


class Sandbox(CodeRunner):
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
        #: Outbound rules, counters and log: ``sb.egress.set(["pypi.org"])``.
        self.egress = Egress(client, info.id)
        #: Inbound: ``sb.ports.expose(8000).url``.
        self.ports = Ports(client, info.id)
        #: Private networks: ``sb.networks.join("net-...")``.
        self.networks = SandboxNetworks(client, info.id)
        #: Background processes: ``sb.processes.start("python3 server.py")``.
        self.processes = Processes(client, info.id)
        #: Interactive terminals: ``sb.pty.open(rows, cols)``, ``sb.pty.attach(pty_id)``.
        self.pty = Pty(client, info.id)
        #: Code interpreter: ``sb.contexts.create().run("x = 1")``; or ``sb.run_code``.
        self.contexts = Contexts(client, info.id)

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
    def _once(
        cls,
        call: Callable[[Client], T],
        client: Client | None,
        api_key: str | None,
        base_url: str | None,
        http_timeout: float | Timeouts | None,
        transport: httpx.BaseTransport | None,
    ) -> T:
        """One call on ``client``, or on a client of its own that is closed afterwards."""
        http, owned = cls._client_for(client, api_key, base_url, http_timeout, transport)
        try:
            return call(http)
        finally:
            if owned:
                http.close()

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
        snapshot: str | None = None,
        auto_pause_s: int | None = None,
        auto_delete_s: int | None = None,
        network: NetworkModeArg = "default",
        egress: Sequence[str] | None = None,
        networks: Sequence[str] | None = None,
        api_key: str | None = None,
        base_url: str | None = None,
        http_timeout: float | Timeouts | None = None,
        transport: httpx.BaseTransport | None = None,
        client: Client | None = None,
    ) -> Sandbox:
        """Boot a sandbox and return once its guest answers. ``timeout_s``: the daemon
        destroys it after that many seconds (None: never). ``auto_resume``: commands and
        file calls to it while it is paused resume it first instead of failing with
        ``StateError``.

        ``snapshot``: a snapshot id (``snap-...``, see :meth:`snapshot`) to start from:
        the new sandbox has the files, memory and processes saved there and the
        snapshot's image and shape (so leave ``image`` and the shape at their defaults,
        else ``InvalidArgument``). ``auto_pause_s`` (60-86400): the daemon pauses it after
        that many idle seconds; ``auto_delete_s`` (60-2592000): it deletes it after that
        many seconds paused. Out-of-range values raise ``InvalidArgument`` unsent.

        ``network``: ``"default"`` (an address and NAT, filtered by ``egress``) or
        ``"none"`` (no network at all). ``egress``: rules such as ``["pypi.org",
        "*.github.com:443", "10.0.0.0/8"]`` (None or []: open; ``["deny-all"]``: nothing
        leaves); change them later with ``sb.egress.set``. ``networks``: private
        networks (ids or names) to join; members reach each other by sandbox name."""
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
                snapshot=snapshot,
                auto_pause_s=auto_pause_s,
                auto_delete_s=auto_delete_s,
                network=network,
                egress=egress,
                networks=networks,
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
        return cls._once(
            lambda http: http.list_sandboxes(state, metadata),
            client,
            api_key,
            base_url,
            http_timeout,
            transport,
        )

    @classmethod
    def list_snapshots(
        cls,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        http_timeout: float | Timeouts | None = None,
        transport: httpx.BaseTransport | None = None,
        client: Client | None = None,
    ) -> builtins.list[SnapshotInfo]:
        """Every named snapshot on the daemon."""
        return cls._once(
            lambda http: http.list_snapshots(), client, api_key, base_url, http_timeout, transport
        )

    @classmethod
    def get_snapshot(
        cls,
        snapshot_id: str,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        http_timeout: float | Timeouts | None = None,
        transport: httpx.BaseTransport | None = None,
        client: Client | None = None,
    ) -> SnapshotInfo:
        """One snapshot; raises ``NotFound`` if there is none."""
        return cls._once(
            lambda http: http.get_snapshot(snapshot_id),
            client,
            api_key,
            base_url,
            http_timeout,
            transport,
        )

    @classmethod
    def delete_snapshot(
        cls,
        snapshot_id: str,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        http_timeout: float | Timeouts | None = None,
        transport: httpx.BaseTransport | None = None,
        client: Client | None = None,
    ) -> None:
        """Delete a snapshot. Raises ``Conflict`` while a live sandbox's disk is built on
        it (kill those first; the message names them): one started from it, forks of
        such a one, and the sandbox it was taken of, which runs on from the snapshot.
        ``NotFound`` if there is no such snapshot."""
        cls._once(
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

    def snapshot(self, name: str) -> SnapshotInfo:
        """Save this sandbox as it is now (memory, processes and disk) under ``name``
        (1-63 lowercase letters, digits and '-'; names need not be unique: the returned
        ``id`` is what :meth:`create` takes as ``snapshot=``).

        The sandbox is held still for the moment of the save and then carries on running,
        or stays paused if it was. From then on its disk is built on the snapshot, so
        :meth:`delete_snapshot` refuses until this sandbox is gone too. Raises
        ``StateError`` unless it is running or paused.
        """
        return self._client.create_snapshot(self.id, name)

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
