"""envd's ``filesystem.Filesystem`` service on hutch's file calls and file watch.

Entries carry what hutch's agent reports: name, path, type, size, permission bits and
modification time; ``owner``/``group`` are empty (the agent does not report them) and a
symlink's target is not given. ``ListDir`` with a depth walks the tree one listing per
directory (symlinks are listed, not followed). Both watcher styles: ``WatchDir`` (a
stream; the async and JS SDKs) and ``CreateWatcher``/``GetWatcherEvents``/
``RemoveWatcher`` (polling; the sync SDK), each over one hutch watch. hutch reports a
rename as ``renamed`` from/to; envd as RENAME of the old name and CREATE of the new one,
which is what is sent.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import posixpath
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from hutch.e2b.connect import ConnectError, timestamp
from hutch.e2b.rpc import Call, RpcService
from hutch.e2b.wiring import Hutch
from hutch.errors import HutchError, NotFound
from hutch.services.files_extra import FileWatch, WatchEvent
from hutch.services.sandboxes import FileEntry

__all__ = ["FilesystemRpc", "entry_info", "permissions"]

Message = dict[str, Any]
#: Most entries one ListDir returns (a depth walk of a huge tree is refused past it).
MAX_LIST_ENTRIES = 50_000
#: Events a polling watcher holds between two GetWatcherEvents (the oldest go first).
MAX_WATCHER_EVENTS = 10_000
MAX_WATCHERS_PER_SANDBOX = 64
KEEPALIVE: Message = {"keepalive": {}}

_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
_TYPE_CHAR = {"file": "-", "dir": "d", "symlink": "L"}


def permissions(kind: str, mode: int) -> str:
    """Go's ``FileMode.String()``, which envd reports: ``-rw-r--r--``, ``drwxr-xr-x``."""
    bits = "".join(
        ch if mode & mask else "-"
        for ch, mask in zip(
            "rwxrwxrwx", (0o400, 0o200, 0o100, 0o40, 0o20, 0o10, 4, 2, 1), strict=True
        )
    )
    return _TYPE_CHAR.get(kind, "?") + bits


def entry_info(e: FileEntry) -> Message:
    out: Message = {
        "name": e.name,
        "type": _TYPES.get(e.type, "FILE_TYPE_UNSPECIFIED"),
        "path": e.path,
        "size": str(e.size),
        "mode": e.mode & 0o7777,
        "permissions": permissions(e.type, e.mode & 0o777),
        "owner": "",
        "group": "",
        "modifiedTime": timestamp(e.mtime),
    }
    if e.type == "symlink":
        out["isSymlink"] = True
    return out


def _path(req: Message, key: str = "path") -> str:
    value = req.get(key)
    if not isinstance(value, str) or not value:
        raise ConnectError("invalid_argument", f"{key} is required")
    return value


def fs_events(ev: WatchEvent, root: str) -> list[Message]:
    """envd FilesystemEvents for one hutch watch event (names relative to ``root``)."""

    def rel(path: str) -> str:
        return posixpath.relpath(path, root) if path.startswith(root) else path

    if ev.type == "created":
        return [{"name": rel(ev.path), "type": "EVENT_TYPE_CREATE"}]
    if ev.type == "modified":
        return [{"name": rel(ev.path), "type": "EVENT_TYPE_WRITE"}]
    if ev.type == "deleted":
        return [{"name": rel(ev.path), "type": "EVENT_TYPE_REMOVE"}]
    if ev.type == "renamed":
        out = []
        if ev.from_path:
            out.append({"name": rel(ev.from_path), "type": "EVENT_TYPE_RENAME"})
        out.append({"name": rel(ev.to_path or ev.path), "type": "EVENT_TYPE_CREATE"})
        return out
    return []  # overflow: the guest dropped events; envd has no word for it


@dataclass
class _Watcher:
    sandbox_id: str
    watch: FileWatch
    events: collections.deque[Message] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_WATCHER_EVENTS)
    )
    task: asyncio.Task[None] | None = None
    ended: str | None = None


class FilesystemRpc:
    def __init__(self, hutch: Hutch) -> None:
        self.hutch = hutch
        self._watchers: dict[str, _Watcher] = {}

    def service(self) -> RpcService:
        svc = RpcService("filesystem.Filesystem")
        svc.unary("Stat", self.stat)
        svc.unary("MakeDir", self.make_dir)
        svc.unary("Move", self.move)
        svc.unary("ListDir", self.list_dir)
        svc.unary("Remove", self.remove)
        svc.server_stream("WatchDir", self.watch_dir, KEEPALIVE)
        svc.unary("CreateWatcher", self.create_watcher)
        svc.unary("GetWatcherEvents", self.get_watcher_events)
        svc.unary("RemoveWatcher", self.remove_watcher)
        return svc

    async def close(self) -> None:
        for wid in list(self._watchers):
            self._drop(wid)

    # -- files -------------------------------------------------------------------------

    async def stat(self, call: Call, req: Message) -> Message:
        return {"entry": entry_info(await self.hutch.guest.stat(call.sandbox_id, _path(req)))}

    async def make_dir(self, call: Call, req: Message) -> Message:
        path = _path(req)
        svc = self.hutch.guest
        with contextlib.suppress(NotFound):
            await svc.stat(call.sandbox_id, path)
            raise ConnectError("already_exists", f"{path} already exists")
        return {"entry": entry_info(await svc.mkdir(call.sandbox_id, path))}

    async def move(self, call: Call, req: Message) -> Message:
        entry = await self.hutch.guest.rename(
            call.sandbox_id, _path(req, "source"), _path(req, "destination")
        )
        return {"entry": entry_info(entry)}

    async def remove(self, call: Call, req: Message) -> Message:
        await self.hutch.guest.remove(call.sandbox_id, _path(req), recursive=True)
        return {}

    async def list_dir(self, call: Call, req: Message) -> Message:
        depth = req.get("depth", 1) or 1
        if isinstance(depth, str) and depth.isdigit():
            depth = int(depth)
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ConnectError("invalid_argument", f"depth={depth!r}: give 1 or more")
        svc = self.hutch.guest
        out: list[Message] = []
        level = [_path(req)]
        for _ in range(depth):
            below: list[str] = []
            for directory in level:
                for e in await svc.list_dir(call.sandbox_id, directory):
                    out.append(entry_info(e))
                    if e.type == "dir":
                        below.append(e.path)
                    if len(out) > MAX_LIST_ENTRIES:
                        raise ConnectError(
                            "resource_exhausted",
                            f"more than {MAX_LIST_ENTRIES} entries; list with a smaller depth",
                        )
            level = below
        return {"entries": out}

    # -- watching ----------------------------------------------------------------------

    async def _start(self, call: Call, req: Message) -> FileWatch:
        recursive = bool(req.get("recursive", False))
        return await self.hutch.files.watch(call.sandbox_id, _path(req), recursive=recursive)

    async def watch_dir(self, call: Call, req: Message) -> AsyncIterator[Message]:
        watch = await self._start(call, req)
        try:
            yield {"start": {}}
            async for ev in watch.events():
                for fs_event in fs_events(ev, watch.path):
                    yield {"filesystem": fs_event}
        finally:
            watch.close()

    async def create_watcher(self, call: Call, req: Message) -> Message:
        mine = [w for w in self._watchers.values() if w.sandbox_id == call.sandbox_id]
        if len(mine) >= MAX_WATCHERS_PER_SANDBOX:
            raise ConnectError(
                "resource_exhausted",
                f"{len(mine)} watchers are open in this sandbox; remove some first",
            )
        watcher = _Watcher(call.sandbox_id, await self._start(call, req))
        wid = "watcher-" + secrets.token_hex(8)
        watcher.task = asyncio.get_running_loop().create_task(self._collect(watcher))
        self._watchers[wid] = watcher
        return {"watcherId": wid}

    async def _collect(self, watcher: _Watcher) -> None:
        try:
            async for ev in watcher.watch.events():
                watcher.events.extend(fs_events(ev, watcher.watch.path))
            watcher.ended = watcher.watch.end_reason or "the watch ended"
        except HutchError as exc:
            watcher.ended = exc.message

    def _find(self, call: Call, req: Message) -> tuple[str, _Watcher]:
        wid = req.get("watcherId")
        watcher = self._watchers.get(wid) if isinstance(wid, str) else None
        if watcher is None or watcher.sandbox_id != call.sandbox_id:
            raise ConnectError("not_found", f"no watcher {wid!r} in this sandbox")
        return wid, watcher  # type: ignore[return-value]

    async def get_watcher_events(self, call: Call, req: Message) -> Message:
        wid, watcher = self._find(call, req)
        events = list(watcher.events)
        watcher.events.clear()
        if not events and watcher.ended is not None:
            self._drop(wid)
            raise ConnectError("not_found", f"watcher {wid} has ended: {watcher.ended}")
        return {"events": events}

    async def remove_watcher(self, call: Call, req: Message) -> Message:
        wid, _ = self._find(call, req)
        self._drop(wid)
        return {}

    def _drop(self, wid: str) -> None:
        watcher = self._watchers.pop(wid, None)
        if watcher is None:
            return
        watcher.watch.close()
        if watcher.task is not None:
            watcher.task.cancel()
