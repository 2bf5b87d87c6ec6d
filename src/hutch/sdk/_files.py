"""Files in the SDK, sans-IO: read, write, list, stat, mkdir, rename, remove, watch and
whole-directory transfers. :class:`FileCalls` builds each request and says how to read
its answer; :class:`WatchDecoder` reads the NDJSON watch stream; local tar packing and
unpacking is in ``_tar``.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import httpx

from hutch.contract.limits import DEFAULT_FILE_MODE
from hutch.errors import InvalidArgument
from hutch.sdk._core import Call, ClientCore, check_path, list_of, nothing, one
from hutch.sdk._errors import ProtocolError
from hutch.sdk._streams import LineDecoder, error_line
from hutch.sdk._values import iso, maybe, moment, need

__all__ = [
    "ArchiveWritten",
    "FileCalls",
    "FileEntry",
    "WatchDecoder",
    "WatchEvent",
    "WrittenFile",
]

WatchEventType = Literal["watching", "created", "modified", "deleted", "renamed", "overflow"]
_EVENT_TYPES = ("watching", "created", "modified", "deleted", "renamed", "overflow")


@dataclass(frozen=True)
class FileEntry:
    """A file in a sandbox. ``mode`` is the permission bits as an int (0o644)."""

    name: str
    path: str
    type: str
    size: int
    mode: int
    mtime: datetime | None

    @classmethod
    def from_dict(cls, obj: Any) -> FileEntry:
        w = "file entry"
        raw_mode = need(obj, "mode", (str, int), w)
        try:
            mode = raw_mode if isinstance(raw_mode, int) else int(raw_mode, 8)
        except ValueError as exc:
            raise ProtocolError(f"{w}: mode {raw_mode!r} is not octal") from exc
        return cls(
            name=need(obj, "name", str, w),
            path=need(obj, "path", str, w),
            type=need(obj, "type", str, w),
            size=need(obj, "size", int, w),
            mode=mode,
            mtime=moment(obj, "mtime", w),
        )

    @property
    def is_dir(self) -> bool:
        return self.type == "dir"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "type": self.type,
            "size": self.size,
            "mode": format(self.mode, "04o"),
            "mtime": iso(self.mtime),
        }


@dataclass(frozen=True)
class WrittenFile:
    """What ``files.write`` stored: the absolute path and its size in bytes."""

    path: str
    size: int

    @classmethod
    def from_dict(cls, obj: Any) -> WrittenFile:
        return cls(path=need(obj, "path", str, "write"), size=need(obj, "size", int, "write"))


@dataclass(frozen=True)
class WatchEvent:
    """A change in the sandbox. ``renamed`` has ``from_path``/``to_path`` (``path`` is
    the new name); ``overflow`` means the guest dropped events (too many at once)."""

    type: WatchEventType
    path: str
    is_dir: bool
    time: float
    from_path: str | None = None
    to_path: str | None = None

    @classmethod
    def from_dict(cls, obj: Any) -> WatchEvent:
        w = "watch event"
        kind = need(obj, "type", str, w)
        if kind not in _EVENT_TYPES:
            raise ProtocolError(f"watch stream: unknown event {obj!r}")
        return cls(
            type=kind,
            path=need(obj, "path", str, w),
            is_dir=bool(obj.get("is_dir", True)),
            time=float(maybe(obj, "time", (int, float), w) or 0.0),
            from_path=maybe(obj, "from", str, w),
            to_path=maybe(obj, "to", str, w),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": self.type,
            "path": self.path,
            "is_dir": self.is_dir,
            "time": self.time,
        }
        if self.type == "renamed":
            out["from"], out["to"] = self.from_path, self.to_path
        return out


@dataclass(frozen=True)
class ArchiveWritten:
    """A directory transfer: where it landed, members (directories included), tar bytes."""

    path: str
    entries: int
    bytes: int

    @classmethod
    def from_dict(cls, obj: Any) -> ArchiveWritten:
        w = "archive result"
        return cls(
            path=need(obj, "path", str, w),
            entries=need(obj, "entries", int, w),
            bytes=need(obj, "bytes", int, w),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "entries": self.entries, "bytes": self.bytes}


class WatchDecoder(LineDecoder[WatchEvent]):
    """NDJSON watch stream → :class:`WatchEvent` (the first is ``watching``). A watch
    may end at any time (the daemon or the sandbox stopped): that is not an error."""

    what = "watch stream"

    def item(self, obj: Any) -> WatchEvent | None:
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind == "end":
            self.done = True
            return None
        if kind == "error":
            self.done = True
            raise error_line(obj, "watch failed")
        return WatchEvent.from_dict(obj)


class FileCalls:
    """Builds every file request of API v1. No I/O."""

    def __init__(self, core: ClientCore) -> None:
        self.core = core

    def _path(self, sandbox_id: str, suffix: str) -> str:
        return self.core.sandbox_path(sandbox_id, suffix)

    def write(
        self, sandbox_id: str, path: str, content: Any, mode: int = DEFAULT_FILE_MODE
    ) -> Call[WrittenFile]:
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            raise InvalidArgument(f"mode={mode!r} must be permission bits such as 0o644")
        params = [("path", check_path(path)), ("mode", format(mode, "04o"))]
        req = self.core.request(
            "PUT", self._path(sandbox_id, "/files"), params=params, content=content
        )
        return Call(req, one(WrittenFile.from_dict))

    def read_request(self, sandbox_id: str, path: str) -> httpx.Request:
        params = [("path", check_path(path))]
        return self.core.request("GET", self._path(sandbox_id, "/files"), params=params)

    def list(self, sandbox_id: str, path: str) -> Call[builtins.list[FileEntry]]:
        params = [("path", check_path(path))]
        req = self.core.request("GET", self._path(sandbox_id, "/files/list"), params=params)
        return Call(req, list_of("entries", FileEntry.from_dict))

    def stat(self, sandbox_id: str, path: str) -> Call[FileEntry]:
        params = [("path", check_path(path))]
        req = self.core.request("GET", self._path(sandbox_id, "/files/stat"), params=params)
        return Call(req, one(FileEntry.from_dict))

    def mkdir(self, sandbox_id: str, path: str) -> Call[FileEntry]:
        body = {"path": check_path(path)}
        req = self.core.request("POST", self._path(sandbox_id, "/files/mkdir"), json_body=body)
        return Call(req, one(FileEntry.from_dict))

    def rename(self, sandbox_id: str, source: str, destination: str) -> Call[FileEntry]:
        body = {
            "source": check_path(source, "source"),
            "destination": check_path(destination, "destination"),
        }
        req = self.core.request("POST", self._path(sandbox_id, "/files/rename"), json_body=body)
        return Call(req, one(FileEntry.from_dict))

    def remove(self, sandbox_id: str, path: str, recursive: bool = False) -> Call[None]:
        params = [("path", check_path(path)), ("recursive", "true" if recursive else "false")]
        req = self.core.request("DELETE", self._path(sandbox_id, "/files"), params=params)
        return Call(req, nothing)

    def watch_request(
        self, sandbox_id: str, path: str, recursive: bool, timeout_s: float | None = None
    ) -> httpx.Request:
        params = [("path", check_path(path)), ("recursive", "true" if recursive else "false")]
        if timeout_s is not None:
            if timeout_s <= 0:
                raise InvalidArgument(f"timeout_s={timeout_s!r} must be > 0 seconds")
            params.append(("timeout_s", repr(float(timeout_s))))
        # A quiet directory sends nothing for as long as it stays quiet: no read timeout.
        return self.core.request(
            "GET", self._path(sandbox_id, "/files/watch"), params=params, read_timeout=None
        )

    def download_request(self, sandbox_id: str, path: str) -> httpx.Request:
        params = [("path", check_path(path))]
        return self.core.request("GET", self._path(sandbox_id, "/files/archive"), params=params)

    def upload(self, sandbox_id: str, path: str, content: Any) -> Call[ArchiveWritten]:
        params = [("path", check_path(path))]
        req = self.core.request(
            "PUT", self._path(sandbox_id, "/files/archive"), params=params, content=content
        )
        return Call(req, one(ArchiveWritten.from_dict))
