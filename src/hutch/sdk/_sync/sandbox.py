# Generated from src/hutch/sdk/_async/sandbox.py by scripts/unasync.py: do not edit.
"""``Sandbox``: a handle on one sandbox, in the shape E2B users know."""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Unpack

import httpx

from hutch.contract.enums import DEFAULT_PAUSE_MODE
from hutch.contract.limits import DEFAULT_FORK_COUNT, DEFAULT_IMAGE
from hutch.errors import NotFound
from hutch.sdk import _io_sync as _io
from hutch.sdk._config import Timeouts
from hutch.sdk._contexts import Execution, ResultCallback, TextCallback
from hutch.sdk._exec import CommandArgs, ExecEvent, ExecResult
from hutch.sdk._net import EgressInfo
from hutch.sdk._sandboxes import CreateArgs, PauseModeArg, SandboxInfo, SnapshotInfo
from hutch.sdk._sync._closing import ClosesOnExit
from hutch.sdk._sync.client import Client, ResponseStream
from hutch.sdk._sync.contexts import Context, Contexts, run_code
from hutch.sdk._sync.files import Files
from hutch.sdk._sync.net import Egress, Ports, SandboxNetworks
from hutch.sdk._sync.processes import Processes
from hutch.sdk._sync.pty import Pty
from hutch.sdk._usage import Event, EventPage

__all__ = ["Sandbox"]


class _Connection(ClosesOnExit):
    """The client one class-level call uses: the caller's, or one of its own that is
    closed when the call is done."""

    def __init__(
        self,
        client: Client | None,
        api_key: str | None,
        base_url: str | None,
        http_timeout: float | Timeouts | None,
        transport: httpx.BaseTransport | None,
    ) -> None:
        self.owned = client is None
        self.client = client or Client(
            base_url=base_url, api_key=api_key, timeout=http_timeout, transport=transport
        )

    def close(self) -> None:
        if self.owned:
            self.client.close()


class Sandbox:
    """One micro-VM sandbox. Create with :meth:`create`, attach with :meth:`connect`.

    ``with Sandbox.create() as sb:`` kills the sandbox when the block ends. A sandbox
    made by ``create``/``connect`` owns its HTTP connection pool; pass ``client=`` to
    share one client between many sandboxes instead.
    """

    def __init__(self, client: Client, info: SandboxInfo, *, owns_client: bool = False) -> None:
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

    @classmethod
    def create(
        cls,
        image: str = DEFAULT_IMAGE,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        http_timeout: float | Timeouts | None = None,
        transport: httpx.BaseTransport | None = None,
        client: Client | None = None,
        **options: Unpack[CreateArgs],
    ) -> Sandbox:
        """Boot a sandbox and return once its guest answers.

        ``options`` (the create fields, see :class:`hutch.contract.requests.CreateRequest`):
        ``vcpus``, ``memory_mib``, ``disk_gib``; ``env`` and ``metadata``; ``name``;
        ``timeout_s``: the daemon destroys it after that many seconds (None: never).
        ``auto_resume``: commands and file calls to it while it is paused resume it
        first instead of failing with ``StateError``.

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
        networks (ids or names) to join; members reach each other by sandbox name.

        ``env_secrets``: ``{"VAR": "secret name"}`` (see ``client.secrets``): every command
        in the sandbox gets VAR = the secret's current value (the code in the guest sees
        it; no answer of the daemon carries it). Unknown names raise ``InvalidArgument``."""
        conn = _Connection(client, api_key, base_url, http_timeout, transport)
        try:
            info = conn.client.create_sandbox(image, **options)
        except BaseException:
            conn.close()
            raise
        return cls(conn.client, info, owns_client=conn.owned)

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
        conn = _Connection(client, api_key, base_url, http_timeout, transport)
        try:
            info = conn.client.get_sandbox(sandbox_id)
        except BaseException:
            conn.close()
            raise
        return cls(conn.client, info, owns_client=conn.owned)

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
        with _Connection(client, api_key, base_url, http_timeout, transport) as conn:
            return conn.client.list_sandboxes(state, metadata)

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
        with _Connection(client, api_key, base_url, http_timeout, transport) as conn:
            return conn.client.list_snapshots()

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
        with _Connection(client, api_key, base_url, http_timeout, transport) as conn:
            return conn.client.get_snapshot(snapshot_id)

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
        """Delete a snapshot. Any order works: sandboxes and snapshots built on it run
        on and stay usable; its space is freed once nothing is built on it any more.
        ``NotFound`` if there is no such snapshot."""
        with _Connection(client, api_key, base_url, http_timeout, transport) as conn:
            conn.client.delete_snapshot(snapshot_id)

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
        on_stdout: _io.OutputCallback | None = None,
        on_stderr: _io.OutputCallback | None = None,
        **options: Unpack[CommandArgs],
    ) -> ExecResult:
        """Run ``cmd`` (a string runs under ``/bin/sh -c``) and wait for it to end.

        ``options``: ``env``, ``cwd``, ``user``, ``stdin`` and ``timeout_s`` (see
        :class:`hutch.contract.requests.CommandRequest`). A nonzero exit is not an
        error: check ``result.exit_code``. Raises ``Timeout`` when ``timeout_s`` passes.
        With ``on_stdout``/``on_stderr`` the output streams into the callbacks as it
        arrives (on the asyncio sandbox they may be coroutine functions).
        """
        return self._client.exec(self.id, cmd, on_stdout=on_stdout, on_stderr=on_stderr, **options)

    def exec_stream(
        self, cmd: str | Sequence[str], **options: Unpack[CommandArgs]
    ) -> ResponseStream[ExecEvent]:
        """Iterate ``ExecOutput(stream, data)`` events, then one final ``ExecExit``."""
        return self._client.exec_stream(self.id, cmd, **options)

    def run_code(
        self,
        code: str,
        context: str | Context | None = None,
        *,
        timeout_s: float | None = None,
        on_stdout: TextCallback | None = None,
        on_stderr: TextCallback | None = None,
        on_result: ResultCallback | None = None,
    ) -> Execution:
        """Run Python ``code`` in ``context`` (a context or its id; default: one context
        per handle, created on first use, so variables persist between calls)."""
        return run_code(
            self.contexts,
            code,
            context,
            timeout_s=timeout_s,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            on_result=on_result,
        )

    def events(
        self,
        *,
        types: str | Sequence[str] | None = None,
        after: int = 0,
        limit: int = 100,
    ) -> EventPage:
        """This sandbox's trace, a page after ``after`` (``page.next_after`` continues):
        created, started, each exec (command, exit code, duration; never output), file
        operations, pause/resume with their reason, deletion."""
        return self._client.sandbox_events(self.id, types=types, after=after, limit=limit)

    def follow_events(
        self, *, types: str | Sequence[str] | None = None, after: int = 0
    ) -> ResponseStream[Event]:
        """Iterate this sandbox's events as they happen (after ``after``); the stream
        ends once the sandbox has ended."""
        return self._client.follow_events(self.id, types=types, after=after)

    def set_egress(
        self,
        rules: Sequence[str] | None = None,
        *,
        policy: Mapping[str, Any] | str | None = None,
    ) -> EgressInfo:
        """The same as ``sb.egress.set(rules, policy=...)``: a rule list, an ordered
        policy document or the name of a policy in ``client.egress_policies``."""
        return self.egress.set(rules, policy=policy)

    def grow_disk(self, disk_gib: int) -> SandboxInfo:
        """Grow this sandbox's own disk to ``disk_gib`` GiB while it runs (no restart):
        ``df /`` in the guest shows the new size at once. Disks only grow."""
        self._info = self._client.grow_disk(self.id, disk_gib)
        return self._info

    def pause(self, mode: PauseModeArg = DEFAULT_PAUSE_MODE) -> SandboxInfo:
        """Pause the sandbox and update :attr:`info` (state ``paused``).

        ``mode="memory"`` saves CPU, memory and devices: after :meth:`resume` its
        processes carry on where they were. ``mode="disk"`` keeps only the disk: resume
        boots it again. Raises ``StateError`` unless it is running.
        """
        self._info = self._client.pause_sandbox(self.id, mode)
        return self._info

    def resume(self, placement: Mapping[str, Any] | None = None) -> SandboxInfo:
        """Start a paused sandbox again and update :attr:`info` (state ``running``).
        Resuming a running sandbox does nothing. ``placement`` (``{"host": ID}`` or
        ``{"labels": {K: V}}``): where in a cluster; another host than the one it
        paused on fetches its pause from the blob store."""
        self._info = self._client.resume_sandbox(self.id, placement)
        return self._info

    def fork(self, count: int = DEFAULT_FORK_COUNT) -> builtins.list[Sandbox]:
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
        info = self._info
        return f"<{type(self).__name__} {self.id} image={info.image} state={info.state}>"
