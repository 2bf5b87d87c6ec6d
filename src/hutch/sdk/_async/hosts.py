"""``client.hosts``: the hosts of a cluster (admin keys). Requests are built and answers
read by :class:`hutch.sdk._hosts.HostCalls`."""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING

from hutch.sdk._hosts import HostCalls, HostInfo

if TYPE_CHECKING:
    from hutch.sdk._async.client import AsyncClient

__all__ = ["AsyncHosts"]


class AsyncHosts:
    """``client.hosts``: ``list()``, ``get(id)``, ``drain(id)`` (the host takes no new
    sandboxes and pauses its running ones), ``undrain(id)``."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._calls = HostCalls(client.core)

    async def list(self) -> builtins.list[HostInfo]:
        return await self._client.call(self._calls.list())

    async def get(self, host_id: str) -> HostInfo:
        return await self._client.call(self._calls.get(host_id))

    async def drain(self, host_id: str) -> HostInfo:
        return await self._client.call(self._calls.drain(host_id))

    async def undrain(self, host_id: str) -> HostInfo:
        return await self._client.call(self._calls.drain(host_id, undo=True))
