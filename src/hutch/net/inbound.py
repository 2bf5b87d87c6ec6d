"""Inbound: expose one guest TCP port on the host through a host-side forwarder.

Closed by default: nothing reaches a guest from outside unless a port was exposed. Each
exposed port is an asyncio listener on ``bind_host`` at an ephemeral port (or the one
asked for, so a restarted daemon can restore what the store says); every connection to
it is piped to ``guest_addr:guest_port``. Closing a port stops the listener and cuts the
connections going through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from ipaddress import IPv4Address

from hutch.errors import InvalidArgument, NetworkError
from hutch.net.proxy import close_writer, pipe_both

__all__ = ["PortForwarder"]

log = logging.getLogger(__name__)


@dataclass
class _Exposed:
    server: asyncio.Server
    host_port: int
    guest_addr: str
    guest_port: int
    conns: set[asyncio.Task[None]] = field(default_factory=set)


class PortForwarder:
    """Forwards host ``bind_host:<host port>`` to a guest port, per sandbox.
    ``connect_timeout_s``: how long a connection waits for the guest to accept.
    ``activity``: entered (with the sandbox id) for as long as a connection is open, so
    a sandbox serving someone is not idle (auto-pause)."""

    def __init__(self, bind_host: str, connect_timeout_s: float = 10) -> None:
        self.bind_host = bind_host
        self._connect_timeout_s = connect_timeout_s
        self._ports: dict[str, dict[int, _Exposed]] = {}
        self.activity: Callable[[str], contextlib.AbstractContextManager[None]] = _no_activity

    async def expose(
        self, sandbox_id: str, guest_addr: IPv4Address | str, guest_port: int, host_port: int = 0
    ) -> int:
        """Listen and return the host port. Exposing an exposed port returns its host port.
        ``host_port=0`` picks a free one. Raises InvalidArgument for a bad port and
        NetworkError when the host port cannot be bound."""
        if not 1 <= guest_port <= 65535:
            raise InvalidArgument(f"port {guest_port} is out of 1-65535")
        current = self._ports.get(sandbox_id, {}).get(guest_port)
        if current is not None:
            return current.host_port
        entry: _Exposed | None = None

        async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            assert entry is not None
            with self.activity(sandbox_id):
                await self._forward(entry, reader, writer)

        try:
            server = await asyncio.start_server(on_client, self.bind_host, host_port)
        except OSError as exc:
            raise NetworkError(
                f"cannot listen on {self.bind_host}:{host_port} to expose port {guest_port} of "
                f"{sandbox_id}: {exc}"
            ) from exc
        bound = int(server.sockets[0].getsockname()[1])
        entry = _Exposed(server, bound, str(guest_addr), guest_port)
        self._ports.setdefault(sandbox_id, {})[guest_port] = entry
        return bound

    async def close(self, sandbox_id: str, guest_port: int) -> None:
        """Stop forwarding ``guest_port`` and cut its connections. No-op if not exposed."""
        entry = self._ports.get(sandbox_id, {}).pop(guest_port, None)
        if not self._ports.get(sandbox_id):
            self._ports.pop(sandbox_id, None)
        if entry is not None:
            await _stop(entry)

    async def close_all(self, sandbox_id: str) -> None:
        """Close every port of a sandbox (on pause-to-disk, delete). Safe to call twice."""
        entries = self._ports.pop(sandbox_id, {})
        for entry in entries.values():
            await _stop(entry)

    async def shutdown(self) -> None:
        """Close everything (daemon stop)."""
        for sandbox_id in list(self._ports):
            await self.close_all(sandbox_id)

    def exposed(self, sandbox_id: str) -> dict[int, int]:
        """guest port -> host port."""
        return {g: e.host_port for g, e in self._ports.get(sandbox_id, {}).items()}

    async def _forward(
        self, entry: _Exposed, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        if task is not None:
            entry.conns.add(task)
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                up_reader, up_writer = await asyncio.open_connection(
                    entry.guest_addr, entry.guest_port
                )
        except BaseException as exc:
            # Cancellation (the port is being closed) too: the client's socket is ours.
            if isinstance(exc, (OSError, TimeoutError)):
                log.info("inbound %s:%s unreachable: %s", entry.guest_addr, entry.guest_port, exc)
            writer.close()
            if task is not None:
                entry.conns.discard(task)
            if isinstance(exc, (OSError, TimeoutError)):
                return
            raise
        try:
            await pipe_both(reader, writer, up_reader, up_writer)
        except (ConnectionError, OSError):
            pass
        finally:
            await close_writer(up_writer)
            await close_writer(writer)
            if task is not None:
                entry.conns.discard(task)


def _no_activity(sandbox_id: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


async def _stop(entry: _Exposed) -> None:
    entry.server.close()
    conns = list(entry.conns)
    for task in conns:
        task.cancel()
    await asyncio.gather(*conns, return_exceptions=True)
    with contextlib.suppress(Exception):
        await entry.server.wait_closed()
