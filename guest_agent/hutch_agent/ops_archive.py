"""Whole directories as tar streams, both ways.

- ``archive_read`` ``{path}`` → REPLY ``{"event": "opened"}``, DATA (an uncompressed tar
  stream of the directory's content, member names relative to it; symlinks are stored,
  not followed; sockets and devices are skipped), END ``{bytes, entries}``.
- ``archive_write`` ``{path}`` then host DATA (a tar stream) ... EOF → END ``{entries,
  bytes}``. Members are unpacked into a staging directory inside the target and moved
  into place only once the whole archive checked out, so a refused archive changes
  nothing. Refused (``invalid_argument`` naming the member): absolute names, ``..``,
  links pointing outside the target, device files and FIFOs. Permission bits are kept
  without setuid/setgid; owners are not restored (everything belongs to root).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from typing import Any

from hutch_agent.errors import AgentError
from hutch_agent.framing import CHUNK, DATA, REPLY
from hutch_agent.ops import Op
from hutch_agent.paths import checked
from hutch_agent.streams import Cancelled, Stream

STAGING_PREFIX = ".hutch-untar-"


class FrameWriter:
    """A write-only file object that sends what tarfile writes as DATA frames."""

    def __init__(self, st: Stream) -> None:
        self.st = st
        self.buf = bytearray()
        self.total = 0

    def write(self, data: bytes) -> int:
        self.buf += data
        while len(self.buf) >= CHUNK:
            self._send(bytes(self.buf[:CHUNK]))
            del self.buf[:CHUNK]
        return len(data)

    def flush(self) -> None:
        if self.buf:
            self._send(bytes(self.buf))
            self.buf.clear()

    def _send(self, chunk: bytes) -> None:
        if not self.st.take_credit():
            raise Cancelled()
        self.st.send(DATA, None, chunk)
        self.total += len(chunk)


class FrameReader:
    """A read-only file object over the host's DATA frames (tarfile's stream mode)."""

    def __init__(self, frames: Iterator[bytes]) -> None:
        self.frames = frames
        self.buf = b""
        self.total = 0

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self.buf) < size:
            try:
                chunk = next(self.frames)
            except StopIteration:
                break
            self.buf += chunk
            self.total += len(chunk)
        if size < 0:
            data, self.buf = self.buf, b""
        else:
            data, self.buf = self.buf[:size], self.buf[size:]
        return data

    def drain(self) -> None:
        """Consume the rest (tar padding) so the host's upload completes."""
        for chunk in self.frames:
            self.total += len(chunk)


def _skip_special(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    if info.isdev() or info.isfifo():
        return None
    return info


def op_archive_read(st: Stream, h: dict[str, Any]) -> dict[str, Any] | None:
    path = checked(h.get("path"))
    if not os.path.isdir(path):
        os.stat(path)  # not_found first
        raise AgentError(
            "not_a_directory", f"{path!r} is not a directory; download a file with read"
        )
    st.send(REPLY, {"event": "opened"})
    writer = FrameWriter(st)
    entries = 0
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                full = posixpath.join(dirpath, name)
                arcname = posixpath.relpath(full, path)
                try:
                    info = tar.gettarinfo(full, arcname)
                except FileNotFoundError:
                    continue  # removed while we walked
                if info is None or _skip_special(info) is None:
                    continue  # sockets, devices, FIFOs
                if info.isreg():
                    try:
                        with open(full, "rb") as f:
                            tar.addfile(info, f)
                    except FileNotFoundError:
                        continue
                else:
                    tar.addfile(info)
                entries += 1
    writer.flush()
    return {"bytes": writer.total, "entries": entries}


def check_member(member: tarfile.TarInfo, dest: str) -> None:
    """Refuse a member that would land outside ``dest`` or is not plain data."""
    name = member.name

    def refuse(why: str) -> AgentError:
        return AgentError("invalid_argument", f"archive member {name!r} {why}; nothing was written")

    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise refuse("has an absolute path")
    if "\0" in name:
        raise refuse("contains a NUL byte")
    parts = name.split("/")
    if ".." in parts:
        raise refuse("contains '..'")
    target = os.path.realpath(posixpath.join(dest, name))
    if target != dest and not target.startswith(dest + "/"):
        raise refuse("points outside the target directory")
    if member.ischr() or member.isblk() or member.isfifo() or member.isdev():
        raise refuse("is a device file or FIFO")
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        raise refuse(f"has an unsupported type {member.type!r}")
    if member.issym() or member.islnk():
        link = member.linkname
        if link.startswith("/"):
            raise refuse(f"is a link to the absolute path {link!r}")
        base = posixpath.dirname(posixpath.join(dest, name)) if member.issym() else dest
        resolved = os.path.realpath(posixpath.join(base, link))
        if resolved != dest and not resolved.startswith(dest + "/"):
            raise refuse(f"is a link to {link!r}, outside the target directory")


def _extract(tar: tarfile.TarFile, member: tarfile.TarInfo, staging: str) -> None:
    # No setuid/setgid/sticky; directories stay writable for us; everything is root's.
    member.mode = (member.mode or 0) & 0o777 | (0o700 if member.isdir() else 0)
    member.uid = member.gid = 0
    member.uname = member.gname = "root"
    if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: the stdlib's checks too
        tar.extract(member, staging, set_attrs=True, filter="data")
    else:
        tar.extract(member, staging, set_attrs=True)


def _merge(staging: str, dest: str) -> None:
    """Move the staged tree into ``dest``: directories merge, files and links replace."""
    for dirpath, dirnames, filenames in os.walk(staging):
        rel = posixpath.relpath(dirpath, staging)
        target_dir = dest if rel == "." else posixpath.join(dest, rel)
        for name in list(dirnames):
            src = posixpath.join(dirpath, name)
            dst = posixpath.join(target_dir, name)
            if os.path.islink(src):
                dirnames.remove(name)
                filenames.append(name)
                continue
            if os.path.lexists(dst) and not os.path.isdir(dst):
                os.unlink(dst)
            if not os.path.lexists(dst):
                os.rename(src, dst)  # the whole subtree at once
                dirnames.remove(name)
            elif os.path.islink(dst):
                raise AgentError("exists", f"{dst!r} is a symlink; the archive has a directory")
        for name in filenames:
            src = posixpath.join(dirpath, name)
            dst = posixpath.join(target_dir, name)
            if os.path.isdir(dst) and not os.path.islink(dst):
                raise AgentError(
                    "is_a_directory", f"{dst!r} is a directory; the archive has a file there"
                )
            os.replace(src, dst)


def op_archive_write(st: Stream, h: dict[str, Any]) -> dict[str, Any] | None:
    dest = checked(h.get("path"))
    try:
        os.makedirs(dest, exist_ok=True)
    except FileExistsError as exc:
        raise AgentError("not_a_directory", f"{dest!r} exists and is not a directory") from exc
    dest = os.path.realpath(dest)
    staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=dest)
    reader = FrameReader(st.inbound_frames())
    entries = 0
    try:
        try:
            with tarfile.open(fileobj=reader, mode="r|*") as tar:  # type: ignore[call-overload]
                for member in tar:
                    check_member(member, dest)
                    if member.name.strip("/") in ("", "."):
                        continue
                    _extract(tar, member, staging)
                    entries += 1
        except tarfile.TarError as exc:
            filter_error = getattr(tarfile, "FilterError", None)
            if filter_error is not None and isinstance(exc, filter_error):
                name = getattr(getattr(exc, "tarinfo", None), "name", "?")
                raise AgentError(
                    "invalid_argument",
                    f"archive member {name!r} was refused: {exc}; nothing was written",
                ) from exc
            raise AgentError(
                "invalid_argument",
                f"the upload is not a valid tar stream ({exc}); nothing was written",
            ) from exc
        reader.drain()
        _merge(staging, dest)
    except AgentError:
        with contextlib.suppress(Cancelled):
            reader.drain()  # let the host finish sending so it reads our error
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"entries": entries, "bytes": reader.total}


OPS: dict[str, Op] = {"archive_read": op_archive_read, "archive_write": op_archive_write}
