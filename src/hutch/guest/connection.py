"""The connection core of the guest agent client (protocol v1, see
:mod:`hutch.guest.protocol`): connecting and the hello handshake, the read loop that
hands frames to their streams, and opening, forgetting and requesting on streams.

:class:`AgentConnection` owns one connection to one agent: the unix socket QEMU serves
for the VM's virtio-serial port. Any number of calls may run at once; each is its own
stream. If the connection drops, every pending and later call raises ``GuestError``. The
operations are added by area (:mod:`hutch.guest.commands`, :mod:`hutch.guest.files`,
:mod:`hutch.guest.volumes`) and put together in :class:`hutch.guest.client.AgentClient`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from hutch.errors import AgentVersionMismatch, GuestError, Timeout
from hutch.guest._stream import CLOSED_MESSAGE, StreamState
from hutch.guest.protocol import (
    MAX_STREAM_ID,
    PROTOCOL_VERSION,
    Decoder,
    Frame,
    FrameType,
    encode_frame,
)
from hutch.guest.results import AgentInfo

#: The name these log lines had before the client was split by job.
log = logging.getLogger("hutch.guest.client")

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
    #: Address-space randomization kept on even under TCG (``HUTCH_GUEST_ASLR``); False
    #: sends nothing, leaving the guest as its agent or its user set it.
    aslr: bool = False

    def header(self) -> dict[str, Any]:
        """The identity's fields of a ``hello`` or ``identity`` request."""
        fields: dict[str, Any] = {
            "hostname": self.hostname,
            "machine_id": self.machine_id,
            "net": self.net,
        }
        if self.aslr:
            fields["aslr"] = True
        return fields


class _HandshakeLost(Exception):
    """The socket closed during the handshake; QEMU may be restarting. Retry."""


class AgentConnection:
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
    ) -> Self:
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
                header.update(identity.header())
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
                **identity.header(),
            }
        )
        return str(reply.get("hostname", ""))

    # -- hooks for operation families kept in their own modules (guest/processes.py,
    # guest/pty.py): open a stream, and forget it (CANCEL if the agent still runs it).
    async def open_stream(self, header: dict[str, Any]) -> StreamState:
        return await self._start(header)

    def close_stream(self, state: StreamState) -> None:
        self._forget(state)


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
