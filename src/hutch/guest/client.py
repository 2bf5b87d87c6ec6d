"""asyncio client for the guest agent (protocol v1, see :mod:`hutch.guest.protocol`).

One :class:`AgentClient` owns one connection to one agent: the unix socket QEMU serves
for the VM's virtio-serial port. Any number of calls may run at once; each is its own
stream. If the connection drops, every pending and later call raises ``GuestError``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import secrets
import signal as _signal
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hutch.errors import AgentVersionMismatch, GuestError, InvalidArgument, Timeout
from hutch.guest._stream import CLOSED_MESSAGE, StreamState
from hutch.guest.paths import normalize_guest_path
from hutch.guest.protocol import (
    CHANNEL_DATA,
    CHANNEL_STDERR,
    MAX_STREAM_ID,
    PROTOCOL_VERSION,
    Decoder,
    Frame,
    FrameType,
    encode_frame,
)
from hutch.guest.results import (
    AgentInfo,
    ExecExit,
    ExecOutput,
    ExecResult,
    FileEntry,
)

__all__ = ["AgentClient", "ExecStream"]

log = logging.getLogger(__name__)

_READ_SIZE = 256 * 1024
#: While the guest boots, its agent may not see the first hello; resend this often (s).
_HELLO_RESEND_S = 1.0
_HELLO_FIRST_RESEND_S = 0.1


@dataclass(frozen=True)
class GuestIdentity:
    """Who the guest is. Sent on every connect so that clones restored from one snapshot
    each take their own name and machine-id before user code runs again."""

    hostname: str
    machine_id: str  # 32 lowercase hex digits, as in /etc/machine-id
    #: {"address": "a.b.c.d/30", "gateway": ip, "dns": ip}, or None: no network.
    net: dict[str, str] | None = None


class _HandshakeLost(Exception):
    """The socket closed during the handshake; QEMU may be restarting. Retry."""


def command_header(
    op: str,
    argv: list[str] | None,
    shell: str | None,
    env: dict[str, str] | None,
    cwd: str | None,
    user: str | int | None,
    timeout_s: float | None,
    *,
    stdin: bool,
) -> dict[str, Any]:
    """The request header of a command (``exec``, ``proc_start``): exactly one of ``argv``
    (run directly) or ``shell`` (``/bin/sh -c``). Raises InvalidArgument naming what is
    wrong."""
    if (argv is None) == (shell is None):
        raise InvalidArgument("give exactly one of argv (a list) or shell (a string)")
    header: dict[str, Any] = {"op": op, "stdin": stdin}
    if argv is not None:
        if not argv or not all(isinstance(a, str) for a in argv):
            raise InvalidArgument(f"argv must be a non-empty list of strings, not {argv!r}")
        header["argv"] = list(argv)
    else:
        header["shell"] = shell
    if env:
        header["env"] = dict(env)
    if cwd is not None:
        header["cwd"] = normalize_guest_path(cwd)
    if user is not None:
        header["user"] = user
    if timeout_s is not None:
        if timeout_s <= 0:
            raise InvalidArgument(f"timeout_s={timeout_s!r}; give a positive number")
        header["timeout_s"] = timeout_s
    return header


class ExecStream:
    """A running command. Iterate it for output; ``wait()`` or ``collect()`` for the end.

    Output arrives in the order the agent read it from the pipes. ``wait()`` discards
    output nobody iterated; ``collect()`` keeps it. Either may be called after iterating.
    """

    def __init__(self, client: AgentClient, state: StreamState, pid: int) -> None:
        self._client = client
        self._state = state
        self.pid = pid
        self._exit: ExecExit | None = None
        self._stdin_task: asyncio.Task[None] | None = None

    @property
    def exit(self) -> ExecExit | None:
        """How the command ended, once its exit arrived (None before)."""
        return self._exit

    def __aiter__(self) -> AsyncIterator[ExecOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[ExecOutput]:
        while self._exit is None:
            item = await self._next()
            if item is not None:
                yield item

    async def _next(self) -> ExecOutput | None:
        """One output chunk, or None once the exit arrived."""
        try:
            frame = await self._state.next()
        except BaseException:
            await self._finish_stdin()
            raise
        if frame.type is FrameType.DATA:
            if frame.channel == CHANNEL_STDERR:
                return ExecOutput("stderr", frame.payload)
            return ExecOutput("stdout", frame.payload)
        self._client._forget(self._state)
        await self._finish_stdin()
        if frame.type is FrameType.END:
            self._exit = ExecExit.from_wire(frame.header)
            return None
        raise self._state.unexpected(frame)

    async def _finish_stdin(self) -> None:
        task, self._stdin_task = self._stdin_task, None
        if task is None:
            return
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # re-raises an error of the caller's stdin iterable

    async def wait(self) -> ExecExit:
        """Wait for the exit, discarding output not yet iterated."""
        while self._exit is None:
            await self._next()
        return self._exit

    async def collect(self) -> ExecResult:
        """Wait for the exit and return all output not yet iterated."""
        out: list[bytes] = []
        err: list[bytes] = []
        while self._exit is None:
            item = await self._next()
            if item is not None:
                (out if item.stream == "stdout" else err).append(item.data)
        e = self._exit
        return ExecResult(
            b"".join(out), b"".join(err), e.exit_code, e.signal, e.timed_out, e.duration_ms
        )

    async def signal(self, signum: int) -> None:
        """Send ``signum`` to the command's process group. NotFound if it has exited."""
        await self._client._request(
            {"op": "signal", "target": self._state.sid, "signal": int(signum)}
        )

    async def kill(self) -> None:
        """SIGKILL the command's process group."""
        await self.signal(_signal.SIGKILL)

    async def detach(self) -> None:
        """Stop receiving output; the command keeps running to its end or timeout."""
        self._client._forget(self._state)
        await self._finish_stdin()


class AgentClient:
    """Connection to one guest agent. Create with :meth:`connect`."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        decoder: Decoder,
        info: AgentInfo,
        socket_path: Path,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._decoder = decoder
        self.info = info
        self.socket_path = socket_path
        self._streams: dict[int, StreamState] = {}
        self._next_id = 1
        self._closed = asyncio.Event()
        #: Set by whoever is about to end the connection on purpose (a pause, a delete):
        #: calls it cuts fail with this message instead of "the VM may have stopped".
        self.close_reason: str | None = None
        self._read_task = asyncio.create_task(self._read_loop(), name=f"agent-{socket_path}")

    # -- connecting ---------------------------------------------------------------------
    @classmethod
    async def connect(
        cls,
        socket_path: Path,
        timeout_s: float = 30.0,
        identity: GuestIdentity | None = None,
    ) -> AgentClient:
        """Connect and handshake, retrying while the socket is absent or refused.

        Raises ``Timeout`` if the agent has not answered within ``timeout_s`` seconds,
        ``AgentVersionMismatch`` if its protocol major differs, ``GuestError`` when the
        socket cannot be used at all.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        problem = "no answer"
        delay = 0.02
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise Timeout(
                    f"the guest agent at {socket_path} did not answer within {timeout_s:g} s "
                    f"({problem}); check the VM's console log"
                )
            try:
                async with asyncio.timeout(remaining):
                    reader, writer = await asyncio.open_unix_connection(str(socket_path))
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                problem = f"{type(exc).__name__}: {exc.strerror}"
                await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
                delay = min(delay * 2, 0.25)
                continue
            except TimeoutError:
                continue
            except OSError as exc:
                raise GuestError(
                    f"cannot connect to the guest agent at {socket_path}: {exc}"
                ) from exc
            try:
                decoder = Decoder()
                info = await cls._handshake(reader, writer, decoder, deadline, identity)
            except _HandshakeLost:
                problem = "the connection closed during the handshake"
                await _close_writer(writer)
                await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
                continue
            except TimeoutError:
                await _close_writer(writer)
                problem = "no hello reply"
                continue
            except BaseException:
                await _close_writer(writer)
                raise
            return cls(reader, writer, decoder, info, socket_path)

    @staticmethod
    async def _handshake(
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        decoder: Decoder,
        deadline: float,
        identity: GuestIdentity | None = None,
    ) -> AgentInfo:
        loop = asyncio.get_running_loop()
        nonce = secrets.token_hex(16)
        resend_s = _HELLO_FIRST_RESEND_S

        def hello() -> bytes:
            header: dict[str, Any] = {
                "op": "hello",
                "protocol": list(PROTOCOL_VERSION),
                "nonce": nonce,
                "time_ns": time.time_ns(),
                "entropy": base64.b64encode(os.urandom(64)).decode(),
            }
            if identity is not None:
                header["hostname"] = identity.hostname
                header["machine_id"] = identity.machine_id
                header["net"] = identity.net
            return encode_frame(Frame(FrameType.REQUEST, 0, header))

        while True:
            try:
                writer.write(hello())
                await writer.drain()
            except OSError as exc:
                raise _HandshakeLost() from exc
            # A hello sent while a restored guest was still waking can be lost: resend
            # quickly at first, then settle at the steady interval.
            resend_at = min(deadline, loop.time() + resend_s)
            resend_s = min(resend_s * 2, _HELLO_RESEND_S)
            # Everything before our hello's reply is stale (an earlier connection's frames
            # left in QEMU's buffers) and is dropped.
            while (remaining := resend_at - loop.time()) > 0:
                try:
                    async with asyncio.timeout(remaining):
                        data = await reader.read(_READ_SIZE)
                except TimeoutError:
                    break
                except OSError as exc:
                    raise _HandshakeLost() from exc
                if not data:
                    raise _HandshakeLost()
                for frame in decoder.feed(data):
                    if (
                        frame.type is FrameType.END
                        and frame.stream == 0
                        and frame.header.get("nonce") == nonce
                    ):
                        info = _agent_info(frame.header)
                        # The reply may answer a hello queued while the guest booted,
                        # carrying an old time: repeat it fresh (same nonce: no reset).
                        writer.write(hello())
                        return info
                decoder.pop_errors()
            if loop.time() >= deadline:
                raise TimeoutError()

    # -- plumbing -----------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    async def wait_closed(self) -> None:
        """Return when the connection is gone (closed here, or the VM stopped)."""
        await self._closed.wait()

    async def close(self) -> None:
        """Close the connection; pending calls fail with GuestError. Idempotent."""
        if not self._read_task.done():
            self._read_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._read_task
        await _close_writer(self._writer)

    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self._reader.read(_READ_SIZE)
                if not data:
                    break
                for frame in self._decoder.feed(data):
                    self._dispatch(frame)
                for error in self._decoder.pop_errors():
                    log.warning(
                        "bad frame from the guest agent at %s: %s", self.socket_path, error.message
                    )
        except OSError as exc:
            log.info("guest agent connection %s failed: %s", self.socket_path, exc)
        finally:
            self._closed.set()
            streams, self._streams = list(self._streams.values()), {}
            for state in streams:
                state.connection_lost(self.close_reason)
            self._writer.close()

    def _dispatch(self, frame: Frame) -> None:
        if frame.stream == 0:
            if frame.type is FrameType.ERROR:
                log.warning("guest agent at %s reported: %s", self.socket_path, frame.header)
            return  # repeated hello replies
        state = self._streams.get(frame.stream)
        if state is None:
            return  # a stream we abandoned
        state.deliver(frame)
        if state.done:
            self._streams.pop(frame.stream, None)

    def _send_nowait(self, frame: Frame) -> None:
        if self.closed:
            raise GuestError(self.close_reason or CLOSED_MESSAGE)
        self._writer.write(encode_frame(frame))

    async def _drain(self) -> None:
        try:
            await self._writer.drain()
        except OSError as exc:
            raise GuestError(CLOSED_MESSAGE) from exc

    def _open(self) -> StreamState:
        if self.closed:
            raise GuestError(self.close_reason or CLOSED_MESSAGE)
        while True:
            sid = self._next_id
            self._next_id = sid % MAX_STREAM_ID + 1
            if sid not in self._streams:
                break
        state = StreamState(sid, self._send_nowait, self._drain)
        self._streams[sid] = state
        return state

    def _forget(self, state: StreamState) -> None:
        """Drop a stream; if the agent still thinks it is open, tell it to stop."""
        self._streams.pop(state.sid, None)
        if not state.done:
            state.done = True
            if not self.closed:
                self._send_nowait(Frame(FrameType.CANCEL, state.sid))

    async def _start(self, header: dict[str, Any]) -> StreamState:
        state = self._open()
        try:
            self._send_nowait(Frame(FrameType.REQUEST, state.sid, header))
            await self._drain()
        except BaseException:
            self._forget(state)
            raise
        return state

    async def _request(self, header: dict[str, Any]) -> dict[str, Any]:
        state = await self._start(header)
        try:
            return await state.expect_end()
        finally:
            self._forget(state)

    # -- hooks for operation families kept in their own modules (guest/processes.py,
    # guest/pty.py): open a stream, and forget it (CANCEL if the agent still runs it).
    async def open_stream(self, header: dict[str, Any]) -> StreamState:
        return await self._start(header)

    def close_stream(self, state: StreamState) -> None:
        self._forget(state)

    # -- operations ---------------------------------------------------------------------
    async def take_identity(self, identity: GuestIdentity) -> str:
        """Give the guest ``identity`` (hostname, machine-id, network), fresh entropy and
        the time in one round trip on this connection (a hello would reset the session).
        Returns the guest's hostname afterwards. An agent that predates the op answers
        ``unknown_operation`` (``Conflict``): reconnect with the identity instead."""
        reply = await self._request(
            {
                "op": "identity",
                "time_ns": time.time_ns(),
                "entropy": base64.b64encode(os.urandom(64)).decode(),
                "hostname": identity.hostname,
                "machine_id": identity.machine_id,
                "net": identity.net,
            }
        )
        return str(reply.get("hostname", ""))

    async def ping(self) -> float:
        """Round trip to the agent, seconds."""
        started = time.perf_counter()
        await self._request({"op": "ping"})
        return time.perf_counter() - started

    async def exec(
        self,
        argv: list[str] | None = None,
        *,
        shell: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: bytes | AsyncIterable[bytes] | None = None,
        timeout_s: float | None = None,
    ) -> ExecStream:
        """Start a command; return once the agent has started it.

        Give ``argv`` (run directly) or ``shell`` (``/bin/sh -c``). ``env`` is merged
        over PATH/HOME/LANG/TERM defaults; ``cwd`` defaults to /root; ``user`` is a name
        or uid (default root). Without ``stdin`` the command reads /dev/null. After
        ``timeout_s`` seconds its process group is killed and the exit says timed_out.
        Raises InvalidArgument (e.g. command not found), NotFound (missing cwd).
        """
        header = command_header(
            "exec", argv, shell, env, cwd, user, timeout_s, stdin=stdin is not None
        )
        state = await self._start(header)
        try:
            frame = await state.next()
            if frame.type is not FrameType.REPLY or frame.header.get("event") != "started":
                raise state.unexpected(frame)
        except BaseException:
            self._forget(state)
            raise
        stream = ExecStream(self, state, int(frame.header.get("pid", 0)))
        if stdin is not None:
            stream._stdin_task = asyncio.create_task(state.upload(stdin, CHANNEL_DATA))
        return stream

    async def run(
        self,
        argv: list[str] | None = None,
        *,
        shell: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: bytes | AsyncIterable[bytes] | None = None,
        timeout_s: float | None = None,
    ) -> ExecResult:
        """:meth:`exec` and collect all output."""
        stream = await self.exec(
            argv, shell=shell, env=env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s
        )
        return await stream.collect()

    async def read_file(self, path: str) -> AsyncIterator[bytes]:
        """Stream a file's content in chunks of up to 64 KiB.

        Errors (NotFound, InvalidArgument for a directory, ...) surface on the first
        iteration. Leaving the loop early tells the agent to stop.
        """
        full = normalize_guest_path(path)
        state = await self._start({"op": "read", "path": full})
        try:
            frame = await state.next()
            if frame.type is not FrameType.REPLY:
                raise state.unexpected(frame)
            while True:
                frame = await state.next()
                if frame.type is FrameType.DATA:
                    yield frame.payload
                elif frame.type is FrameType.END:
                    return
                else:
                    raise state.unexpected(frame)
        finally:
            self._forget(state)

    async def write_file(
        self, path: str, data: bytes | AsyncIterable[bytes], *, mode: int = 0o644
    ) -> FileEntry:
        """Write a file (parents created), streaming ``data``; atomic: all or nothing."""
        full = normalize_guest_path(path)
        state = await self._start({"op": "write", "path": full, "mode": mode})
        try:
            await state.upload(data)
            return FileEntry.from_wire((await state.expect_end()).get("entry"))
        finally:
            # On any failure before END this sends CANCEL: the agent drops its temp file.
            self._forget(state)

    async def list_dir(self, path: str) -> list[FileEntry]:
        reply = await self._request({"op": "list", "path": normalize_guest_path(path)})
        return [FileEntry.from_wire(e) for e in reply.get("entries", [])]

    async def stat(self, path: str) -> FileEntry:
        reply = await self._request({"op": "stat", "path": normalize_guest_path(path)})
        return FileEntry.from_wire(reply.get("entry"))

    async def mount_volume(self, serial: str, path: str, *, read_only: bool = False) -> str:
        """Mount the disk with ``serial`` (ext4) at ``path``; the guest device name."""
        reply = await self._request(
            {"op": "volume_mount", "serial": serial, "path": path, "read_only": read_only}
        )
        return str(reply.get("device", ""))

    async def mount_shared(self, port: str, path: str, *, read_only: bool = False) -> None:
        """Mount the shared volume served on the virtio-serial port named ``port`` at
        ``path`` (the guest's FUSE, ``guest_agent/hutch_agent/ops_sharefs.py``); a no-op
        if it is mounted there already."""
        await self._request(
            {"op": "volume_mount_shared", "port": port, "path": path, "read_only": read_only}
        )

    async def freeze_fs(self, paths: list[str]) -> list[str]:
        """Flush and freeze the filesystems mounted at ``paths`` (the VM is about to be
        killed); the paths frozen."""
        reply = await self._request({"op": "volume_freeze", "paths": paths})
        frozen = reply.get("frozen")
        return [str(p) for p in frozen] if isinstance(frozen, list) else []

    async def grow_fs(self, path: str, size_bytes: int) -> int:
        """Grow the ext4 mounted at ``path`` to its disk, once the guest sees the disk at
        ``size_bytes``; the filesystem's size in bytes after."""
        reply = await self._request({"op": "fs_grow", "path": path, "size_bytes": size_bytes})
        return int(reply.get("size_bytes", 0))

    async def mkdir(self, path: str, *, mode: int = 0o755) -> FileEntry:
        """Create a directory and its parents; succeeds if it already is a directory."""
        reply = await self._request(
            {"op": "mkdir", "path": normalize_guest_path(path), "mode": mode}
        )
        return FileEntry.from_wire(reply.get("entry"))

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file or directory; a non-empty directory needs ``recursive``."""
        await self._request(
            {"op": "remove", "path": normalize_guest_path(path), "recursive": recursive}
        )

    async def rename(self, source: str, destination: str) -> FileEntry:
        reply = await self._request(
            {
                "op": "rename",
                "source": normalize_guest_path(source),
                "destination": normalize_guest_path(destination),
            }
        )
        return FileEntry.from_wire(reply.get("entry"))


def _agent_info(header: dict[str, Any]) -> AgentInfo:
    try:
        major, minor = (int(v) for v in header["protocol"])
        info = AgentInfo(
            protocol=(major, minor),
            agent_version=str(header.get("agent_version", "?")),
            kernel_release=str(header.get("kernel_release", "")),
            hostname=str(header.get("hostname", "")),
            pid=int(header.get("pid", 0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise GuestError(f"the guest agent sent a malformed hello reply: {header!r}") from exc
    if major != PROTOCOL_VERSION[0]:
        raise AgentVersionMismatch(
            f"the guest agent {info.agent_version} speaks protocol {major}.{minor}, but this "
            f"hutch speaks {PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}; rebuild the image "
            "(`hutch image build --force`) so its agent matches"
        )
    return info


async def _close_writer(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
