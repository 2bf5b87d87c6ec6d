"""Shared volumes inside the guest: ``volume_mount_shared`` {port, path, read_only}
mounts the volume served on the virtio-serial port named ``port`` at ``path`` (made if
missing) with the kernel's FUSE, and serves it from a thread of the agent for as long as
the guest runs. Mounting the same port at the same path again is a no-op (a daemon that
re-sends after a restart); another path for a port already mounted is refused.

The mount: ``fuse.hutchshare``, ``nosuid,nodev`` (and ``ro``), ``allow_other`` (every
guest user sees it) and ``default_permissions`` (the kernel checks modes; the host
checks only confinement). The loop reads one request at a time from ``/dev/fuse`` and
answers it (``fuse_fs``); it outlives host reconnects (``sharefs_client``) and ends
only when the kernel says the mount is gone (ENODEV).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from typing import Any

from hutch_agent import fuse_proto
from hutch_agent.errors import AgentError, os_error
from hutch_agent.fuse_fs import ShareFs
from hutch_agent.ops import Op
from hutch_agent.sharefs_client import ShareFsClient
from hutch_agent.streams import Stream

log = logging.getLogger("hutch-agent")

FSTYPE = b"fuse.hutchshare"
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOATIME = 1024
_PORTS_DIR = "/dev/virtio-ports"
_FUSE_DEV = "/dev/fuse"

_lock = threading.Lock()
#: port name -> the mount it serves (path)
_mounted: dict[str, str] = {}


def _mount(source: bytes, target: bytes, fstype: bytes, flags: int, data: bytes) -> None:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mount.argtypes = [
        ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p,
    ]  # fmt: skip
    if lib.mount(source, target, fstype, flags, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target.decode(errors="replace"))


def serve(fuse_fd: int, fs: ShareFs) -> None:
    """Answer the kernel's requests on ``fuse_fd`` until the mount goes away."""
    while not fs.destroyed:
        try:
            request = os.read(fuse_fd, fuse_proto.READ_BUFFER)
        except InterruptedError:
            continue
        except OSError as exc:
            if exc.errno == errno.ENOENT:  # the request was interrupted before we read it
                continue
            if exc.errno != errno.ENODEV:
                log.error("sharefs: /dev/fuse read failed: %s", exc)
            break
        if not request:
            break
        out = fs.handle(request)
        if out is None:
            continue
        try:
            os.write(fuse_fd, out)
        except OSError as exc:
            # ENOENT: the request was aborted meanwhile; the kernel dropped it.
            if exc.errno not in (errno.ENOENT, errno.EINTR):
                log.warning("sharefs: reply write failed: %s", exc)
    os.close(fuse_fd)


def _str(h: dict[str, Any], key: str) -> str:
    v = h.get(key)
    if not isinstance(v, str) or not v:
        raise AgentError("invalid_argument", f"{key} must be a non-empty string")
    return v


def op_volume_mount_shared(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    port, path = _str(h, "port"), _str(h, "path")
    if "/" in port or port in (".", ".."):
        raise AgentError("invalid_argument", f"port {port!r} is not a port name")
    if not os.path.isabs(path):
        raise AgentError("invalid_argument", f"path {path!r} must be absolute")
    read_only = bool(h.get("read_only", False))
    with _lock:
        if port in _mounted:
            if _mounted[port] == path:
                return {"port": port, "path": path}
            raise AgentError(
                "exists", f"port {port} is mounted at {_mounted[port]} already, not {path}"
            )
        try:
            os.makedirs(path, exist_ok=True)
            chan = os.open(os.path.join(_PORTS_DIR, port), os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise os_error(exc) from exc
        try:
            fuse_fd = os.open(_FUSE_DEV, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            os.close(chan)
            raise AgentError("io_error", f"cannot open {_FUSE_DEV}: {exc.strerror}") from exc
        options = (
            f"fd={fuse_fd},rootmode=40000,user_id=0,group_id=0,allow_other,"
            f"default_permissions,max_read={fuse_proto.MAX_WRITE}"
        )
        flags = MS_NOSUID | MS_NODEV | MS_NOATIME | (MS_RDONLY if read_only else 0)
        try:
            _mount(b"hutchshare", path.encode(), FSTYPE, flags, options.encode())
        except OSError as exc:
            os.close(fuse_fd)
            os.close(chan)
            raise AgentError("io_error", f"mount on {path}: {exc.strerror}") from exc
        fs = ShareFs(ShareFsClient(chan), read_only=read_only)
        threading.Thread(
            target=serve, args=(fuse_fd, fs), name=f"sharefs-{port}", daemon=True
        ).start()
        _mounted[port] = path
    log.info("sharefs: %s mounted at %s%s", port, path, " (read-only)" if read_only else "")
    return {"port": port, "path": path}


OPS: dict[str, Op] = {"volume_mount_shared": op_volume_mount_shared}
