"""File operations: read and write streamed in chunks, list, stat, mkdir, remove, rename."""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import shutil
import stat
import tempfile
from typing import Any

from hutch_agent.errors import AgentError
from hutch_agent.framing import (
    CHUNK,
    DATA,
    REPLY,
)
from hutch_agent.ops import Op
from hutch_agent.paths import checked, entry
from hutch_agent.streams import Stream


# -- files ------------------------------------------------------------------------
def op_read(st: Stream, h: dict[str, Any]) -> dict[str, Any] | None:
    path = checked(h.get("path"))
    # O_NONBLOCK so opening a FIFO cannot hang; regular files ignore it.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise AgentError("is_a_directory", f"{path!r} is a directory; list it instead")
        if not stat.S_ISREG(info.st_mode):
            raise AgentError("invalid_argument", f"{path!r} is not a regular file")
        st.send(REPLY, {"event": "opened", "size": info.st_size})
        total = 0
        while True:
            data = os.read(fd, CHUNK)
            if not data:
                return {"bytes": total}
            if not st.take_credit():
                return None
            st.send(DATA, None, data)
            total += len(data)
    finally:
        os.close(fd)


def op_write(st: Stream, h: dict[str, Any]) -> dict[str, Any] | None:
    path = checked(h.get("path"))
    mode = h.get("mode", 0o644)
    if not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise AgentError("invalid_argument", f"mode {mode!r} is not a permission mode")
    parent = posixpath.dirname(path)
    if os.path.isdir(path):
        raise AgentError("is_a_directory", f"{path!r} is a directory")
    try:
        os.makedirs(parent, exist_ok=True)
    except FileExistsError as exc:
        raise AgentError(
            "not_a_directory", f"a parent of {path!r} exists and is not a directory"
        ) from exc
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=".hutch-upload-")
    try:
        try:
            for chunk in st.inbound_frames():
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return {"entry": entry(path)}


def op_list(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    path = checked(h.get("path"))
    if not os.path.isdir(path):
        os.lstat(path)  # not_found first
        raise AgentError("not_a_directory", f"{path!r} is not a directory")
    with os.scandir(path) as it:
        items = sorted(it, key=lambda e: e.name)
    return {
        "entries": [
            entry(posixpath.join(path, e.name), e.stat(follow_symlinks=False)) for e in items
        ]
    }


def op_stat(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    return {"entry": entry(checked(h.get("path"), follow=False))}


def op_mkdir(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    path = checked(h.get("path"))
    mode = h.get("mode", 0o755)
    if not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise AgentError("invalid_argument", f"mode {mode!r} is not a permission mode")
    try:
        os.makedirs(path, mode, exist_ok=True)
    except FileExistsError as exc:
        raise AgentError("exists", f"{path!r} exists and is not a directory") from exc
    return {"entry": entry(path)}


def op_remove(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    path = checked(h.get("path"), follow=False)
    if path == "/":
        raise AgentError("invalid_argument", "refusing to remove /")
    info = os.lstat(path)
    if stat.S_ISDIR(info.st_mode):
        if h.get("recursive"):
            shutil.rmtree(path)
        else:
            try:
                os.rmdir(path)
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise AgentError(
                        "not_empty",
                        f"directory {path!r} is not empty; pass recursive to remove it",
                    ) from exc
                raise
    else:
        os.unlink(path)
    return {}


def op_rename(st: Stream, h: dict[str, Any]) -> dict[str, Any]:
    source = checked(h.get("source"), follow=False)
    destination = checked(h.get("destination"), follow=False)
    os.rename(source, destination)
    return {"entry": entry(destination)}


OPS: dict[str, Op] = {
    "read": op_read,
    "write": op_write,
    "list": op_list,
    "stat": op_stat,
    "mkdir": op_mkdir,
    "remove": op_remove,
    "rename": op_rename,
}
