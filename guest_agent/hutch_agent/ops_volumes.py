"""Volumes and disk growth inside the guest.

- ``volume_mount`` {serial, path, read_only}: mount the virtio-blk disk whose serial is
  ``serial`` (ext4) at ``path`` (made if missing). Mounting the same disk at the same
  path again is a no-op (a daemon that re-sends after a restart).
- ``fs_grow`` {path, size_bytes}: the host grew the disk under the ext4 mounted at
  ``path`` (``/`` for the root disk) to ``size_bytes``; wait until the kernel sees the
  new size (virtio-blk announces it with a config interrupt), then grow the filesystem
  online (``EXT4_IOC_RESIZE_FS``, what ``resize2fs`` does). END {blocks, size_bytes}.
- ``volume_freeze`` {paths}: flush and freeze each mounted filesystem (``FIFREEZE``):
  ext4 then checkpoints its journal and marks itself clean, so the volume is left whole
  for the next sandbox when the VM is killed right after (a delete). END {frozen}.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
import time
from typing import Any

from hutch_agent.errors import AgentError, os_error
from hutch_agent.ops import Op
from hutch_agent.runtime import EXT4_IOC_RESIZE_FS
from hutch_agent.streams import Stream

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOATIME = 1024
FIFREEZE = 0xC0045877  # _IOWR('X', 119, int)
_WAIT_S = 10.0

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mount.argtypes = [
            ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p,
        ]  # fmt: skip
        lib.mount.restype = ctypes.c_int
        _libc = lib
    return _libc


def _str(h: dict[str, Any], key: str) -> str:
    v = h.get(key)
    if not isinstance(v, str) or not v:
        raise AgentError("invalid_argument", f"{key} must be a non-empty string")
    return v


def _find_disk(serial: str) -> str:
    """/dev/vdX of the virtio disk with ``serial`` (waits briefly: probing is async)."""
    deadline = time.monotonic() + _WAIT_S
    while True:
        try:
            names = sorted(os.listdir("/sys/block"))
        except OSError as exc:
            raise os_error(exc) from exc
        for name in names:
            try:
                with open(f"/sys/block/{name}/serial") as f:
                    if f.read().strip() == serial:
                        return f"/dev/{name}"
            except OSError:
                continue
        if time.monotonic() > deadline:
            raise AgentError("not_found", f"no disk with serial {serial!r} in the guest")
        time.sleep(0.05)


def _mounted_at(path: str) -> str | None:
    """The source mounted at ``path``, if any (from /proc/self/mounts)."""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 2 and fields[1] == path:
                    return fields[0]
    except OSError:
        pass
    return None


def op_volume_mount(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    serial, path = _str(h, "serial"), _str(h, "path")
    read_only = bool(h.get("read_only", False))
    device = _find_disk(serial)
    if _mounted_at(path) == device:
        return {"device": device}
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise os_error(exc) from exc
    flags = MS_NOSUID | MS_NODEV | MS_NOATIME | (MS_RDONLY if read_only else 0)
    rc = _lib().mount(device.encode(), path.encode(), b"ext4", flags, None)
    if rc != 0:
        err = ctypes.get_errno()
        hint = ""
        if read_only and err == errno.EROFS:
            hint = (
                " (its journal needs recovery: the last sandbox that used it ended without "
                "a clean unmount; mount it read-write once)"
            )
        raise AgentError("io_error", f"mount {device} on {path}: {os.strerror(err)}{hint}")
    if not read_only:
        # A volume grown while no VM had it open grew as a file only (the host never
        # parses a filesystem a guest wrote): its ext4 catches up here.
        _grow_to_device(path)
    return {"device": device}


def _grow_to_device(path: str) -> int:
    """Grow the ext4 at ``path`` to its device's size (online); the device's bytes."""
    size = _device_bytes(path)
    vfs = os.statvfs(path)
    blocks = size // vfs.f_frsize
    if blocks > vfs.f_blocks:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(fd, EXT4_IOC_RESIZE_FS, struct.pack("Q", blocks))
        except OSError as exc:
            raise os_error(exc) from exc
        finally:
            os.close(fd)
    return size


def _device_bytes(path: str) -> int:
    st = os.stat(path)
    block = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/size"
    try:
        with open(block) as f:
            return int(f.read().strip()) * 512
    except (OSError, ValueError) as exc:
        raise AgentError("invalid_argument", f"{path} is not on a block device") from exc


def op_fs_grow(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    path = _str(h, "path")
    want = h.get("size_bytes")
    if not isinstance(want, int) or isinstance(want, bool) or want <= 0:
        raise AgentError("invalid_argument", "size_bytes must be a positive integer")
    deadline = time.monotonic() + _WAIT_S
    size = _device_bytes(path)
    while size < want:
        if time.monotonic() > deadline:
            raise AgentError("io_error", f"the disk under {path} is still {size} bytes, not {want}")
        time.sleep(0.05)
        size = _device_bytes(path)
    size = _grow_to_device(path)
    return {"blocks": os.statvfs(path).f_blocks, "size_bytes": size}


def op_volume_freeze(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    paths = h.get("paths")
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise AgentError("invalid_argument", "paths must be a list of strings")
    os.sync()
    frozen = []
    for path in paths:
        if _mounted_at(path) is None:
            continue
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(fd, FIFREEZE, 0)
            frozen.append(path)
        except OSError as exc:
            raise os_error(exc) from exc
        finally:
            os.close(fd)
    return {"frozen": frozen}


OPS: dict[str, Op] = {
    "volume_mount": op_volume_mount,
    "fs_grow": op_fs_grow,
    "volume_freeze": op_volume_freeze,
}
