# Generated from src/hutch/sdk/_async/hosts.py by scripts/unasync.py: do not edit.
"""``client.hosts``: the hosts of a cluster (admin keys). Requests are built and answers
read by :class:`hutch.sdk._hosts.HostCalls`."""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING

from hutch.sdk._hosts import HostCalls, HostInfo

if TYPE_CHECKING:
    from hutch.sdk._sync.client import Client

__all__ = ["Hosts"]


class Hosts:
    """``client.hosts``: ``list()``, ``get(id)``, ``drain(id)`` (the host takes no new
    sandboxes and pauses its running ones), ``undrain(id)``."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._calls = HostCalls(client.core)

    def list(self) -> builtins.list[HostInfo]:
        return self._client.call(self._calls.list())

    def get(self, host_id: str) -> HostInfo:
        return self._client.call(self._calls.get(host_id))

    def drain(self, host_id: str) -> HostInfo:
        return self._client.call(self._calls.drain(host_id))

    def undrain(self, host_id: str) -> HostInfo:
        return self._client.call(self._calls.drain(host_id, undo=True))
