"""Serving shared volumes to the sandboxes that mount them (ARCHITECTURE.md "Volumes").

Per shared volume with users, one host mount of its image (``SharedMounts``); per
(sandbox, mount slot), one :class:`~hutch.storage.sharefs_link.ShareLink` on the chardev
socket of the slot's port, which serves a fresh session per connection and connects
again after a pause, a fork's restore or a daemon restart. A sandbox's links start
before its VM (a link waits for its socket) and stop in its teardown's "volumes" step,
after its VM is gone; a volume's host mount goes when no link uses it (:meth:`sweep`,
also at a daemon start, which unmounts what an earlier daemon left).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from hutch.contract.volumes import VolumeKind
from hutch.storage.sharefs_link import ShareLink
from hutch.storage.volumes import VolumeFiles
from hutch.store.volumes import MountRow, VolumeStore

__all__ = ["HostMounts", "SharedVolumes"]

log = logging.getLogger(__name__)


class HostMounts(Protocol):
    """``hutch.storage.shared_mounts.SharedMounts`` (component tests use a directory)."""

    def mount(self, volume_id: str, image: Path) -> Path: ...

    def mounted(self) -> set[str]: ...

    def sweep(self, in_use: set[str]) -> list[str]: ...


class SharedVolumes:
    def __init__(
        self,
        volumes: VolumeStore,
        files: VolumeFiles,
        mounts: HostMounts,
        socket_of: Callable[[str, int], Path],
    ) -> None:
        self.volumes = volumes
        self.files = files
        self.mounts = mounts
        self._socket_of = socket_of
        self._links: dict[tuple[str, int], tuple[str, ShareLink]] = {}
        self._lock = asyncio.Lock()

    def shared_mounts(self, sandbox_id: str) -> list[MountRow]:
        """The sandbox's mount rows of shared volumes, in slot order."""
        out = []
        for m in self.volumes.mounts_of_sandbox(sandbox_id):
            row = self.volumes.get_by_id(m.volume_id)
            if row is not None and row.kind is VolumeKind.SHARED:
                out.append(m)
        return out

    def links(self, sandbox_id: str) -> list[ShareLink]:
        return [link for (sid, _), (_, link) in self._links.items() if sid == sandbox_id]

    async def serve(self, sandbox_id: str) -> None:
        """Start serving the sandbox's shared mounts (idempotent): host-mount each
        volume, then a link per slot. Raises ``StoreError`` if a mount fails."""
        async with self._lock:
            for m in self.shared_mounts(sandbox_id):
                if (sandbox_id, m.slot) in self._links:
                    continue
                tree = await asyncio.to_thread(
                    self.mounts.mount, m.volume_id, self.files.path(m.volume_id)
                )
                link = ShareLink(self._socket_of(sandbox_id, m.slot), tree, read_only=m.read_only)
                self._links[(sandbox_id, m.slot)] = (m.volume_id, link)
                link.start()
                log.info(
                    "serving shared volume %s to %s (slot %d)", m.volume_id, sandbox_id, m.slot
                )

    async def stop(self, sandbox_id: str) -> None:
        """Stop serving the sandbox (its VM is gone) and unmount the volumes no other
        sandbox uses. Safe to call twice."""
        async with self._lock:
            for key in [k for k in self._links if k[0] == sandbox_id]:
                _, link = self._links.pop(key)
                await link.close()
            await self._sweep()

    async def sweep(self) -> list[str]:
        """Unmount every shared volume no link serves (a daemon start: an earlier
        daemon's mounts); returns the ids unmounted."""
        async with self._lock:
            return await self._sweep()

    async def _sweep(self) -> list[str]:
        in_use = {vid for vid, _ in self._links.values()}
        released = await asyncio.to_thread(self.mounts.sweep, in_use)
        for vid in released:
            log.info("unmounted shared volume %s: no sandbox uses it", vid)
        return released

    async def close(self) -> None:
        """The daemon stops: links end (the VMs and the host mounts stay: the next
        daemon serves them again)."""
        async with self._lock:
            for _, link in self._links.values():
                await link.close()
            self._links.clear()
