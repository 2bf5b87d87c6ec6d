"""Volume operations of the guest agent client: mounting disks and shared volumes,
freezing filesystems before the VM is killed, growing a filesystem to its disk."""

from __future__ import annotations

from hutch.guest.connection import AgentConnection


class VolumeOps(AgentConnection):
    """The guest's mounted volumes."""

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
