"""asyncio client for the guest agent (protocol v1, see :mod:`hutch.guest.protocol`).

One :class:`AgentClient` owns one connection to one agent: the unix socket QEMU serves
for the VM's virtio-serial port. Any number of calls may run at once; each is its own
stream. If the connection drops, every pending and later call raises ``GuestError``.

By job: the connection, handshake and stream plumbing are :mod:`hutch.guest.connection`;
the operations by area are :mod:`hutch.guest.commands` (exec, run),
:mod:`hutch.guest.files` and :mod:`hutch.guest.volumes`; :class:`AgentClient` puts them
together. Operation families with state of their own (processes, ptys, watches, archives,
contexts) use it from their own modules.
"""

from __future__ import annotations

import time

from hutch.guest.commands import CommandOps, ExecStream, command_header
from hutch.guest.connection import AgentConnection, GuestIdentity
from hutch.guest.files import FileOps
from hutch.guest.volumes import VolumeOps

__all__ = ["AgentClient", "AgentConnection", "ExecStream", "GuestIdentity", "command_header"]


class AgentClient(CommandOps, FileOps, VolumeOps):
    """Connection to one guest agent. Create with :meth:`connect`."""

    async def ping(self) -> float:
        """Round trip to the agent, seconds."""
        started = time.perf_counter()
        await self._request({"op": "ping"})
        return time.perf_counter() - started
