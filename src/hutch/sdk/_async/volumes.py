"""``client.volumes``: volumes of the project, which outlive sandboxes. Requests are
built and answers read by :class:`hutch.sdk._volumes.VolumeCalls`."""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING

from hutch.sdk._volumes import VolumeCalls, VolumeInfo

if TYPE_CHECKING:
    from hutch.sdk._async.client import AsyncClient

__all__ = ["AsyncVolumes"]


class AsyncVolumes:
    """``client.volumes``: create one, then mount it at create with
    ``Sandbox.create(volumes=["data:/data"])``. ``exclusive`` volumes are block devices on
    one sandbox at a time; ``shared`` ones are mounted by many sandboxes at once (fork
    children too). Their data outlives the sandbox."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._calls = VolumeCalls(client.core)

    async def create(self, name: str, size: int | str, kind: str = "exclusive") -> VolumeInfo:
        """A new empty volume of exactly ``size`` (bytes, or ``"1G"``, ``"512M"``);
        ``Conflict`` if ``name`` is taken in the project."""
        return await self._client.call(self._calls.create(name, size, kind))

    async def list(self) -> builtins.list[VolumeInfo]:
        return await self._client.call(self._calls.list())

    async def get(self, volume: str) -> VolumeInfo:
        """By id (``vol-...``) or name; ``NotFound`` if there is none."""
        return await self._client.call(self._calls.get(volume))

    async def grow(self, volume: str, size: int | str) -> VolumeInfo:
        """Grow to ``size`` (never shrink); live when a running sandbox mounts it."""
        return await self._client.call(self._calls.grow(volume, size))

    async def delete(self, volume: str) -> None:
        """``Conflict`` while sandboxes mount it (the message names them)."""
        await self._client.call(self._calls.delete(volume))
