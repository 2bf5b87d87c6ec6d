"""File watch: inotify events (create, modify, delete, rename) streamed to the host.

``watch`` ``{path, recursive}`` → REPLY ``{"event": "watching", "path", "watches"}`` once
the watches are in place (so a caller can act knowing nothing will be missed), then DATA
frames of JSON lines, one event per line::

    {"type": "created"|"modified"|"deleted"|"renamed"|"overflow", "path", "is_dir",
     "time", "from"?, "to"?}

A rename inside the tree is one ``renamed`` event (``from``/``to``, paired by the inotify
cookie); a move out of the tree is ``deleted``, a move in ``created``. Bursts of writes to
one file become one ``modified`` (sent once the file is quiet for ``QUIET_S``, or after
``MAX_HOLD_S`` while writes go on). ``overflow`` says the kernel queue overflowed and
events were lost. The stream ends when the host cancels it, or with END
``{"reason": "deleted"}`` when the watched directory itself goes away.
"""

from __future__ import annotations

import json
import os
import posixpath
import select
import time
from typing import Any

from hutch_agent import inotify
from hutch_agent.errors import AgentError
from hutch_agent.framing import CHUNK, DATA, REPLY
from hutch_agent.ops import Op
from hutch_agent.paths import FORBIDDEN, checked
from hutch_agent.streams import Cancelled, Stream

QUIET_S = 0.1
MAX_HOLD_S = 1.0
#: How long a move's first half waits for its second before it counts as a delete.
MOVE_PAIR_S = 0.05
POLL_S = 0.25

_MODIFY = inotify.IN_MODIFY | inotify.IN_CLOSE_WRITE | inotify.IN_ATTRIB


def _forbidden(path: str) -> bool:
    return any(path == root or path.startswith(root + "/") for root in FORBIDDEN)


class Watcher:
    def __init__(self, st: Stream, ino: inotify.Inotify, root: str, recursive: bool) -> None:
        self.st, self.ino, self.root, self.recursive = st, ino, root, recursive
        self.out: list[dict[str, Any]] = []
        # path -> [event, first seen, last seen]
        self.modified: dict[str, list[Any]] = {}
        # cookie -> (path, is_dir, seen)
        self.moved_from: dict[int, tuple[str, bool, float]] = {}
        self.root_gone = False

    # -- watches ------------------------------------------------------------------------
    def add_tree(self, top: str, announce: bool) -> None:
        """Watch ``top`` (and below, if recursive); with ``announce``, report what is
        already inside as created (it appeared before its directory's watch existed)."""
        if self.ino.add(top) is None or not self.recursive:
            return
        for dirpath, dirnames, filenames in os.walk(top):
            keep = []
            for name in dirnames:
                full = posixpath.join(dirpath, name)
                if _forbidden(full):
                    continue
                if self.ino.add(full) is not None:
                    keep.append(name)
                if announce:
                    self.emit("created", full, True)
            dirnames[:] = keep
            if announce:
                for name in filenames:
                    self.emit("created", posixpath.join(dirpath, name), False)

    # -- events -------------------------------------------------------------------------
    def emit(self, kind: str, path: str, is_dir: bool, **extra: Any) -> None:
        self.flush_modified(force=True)  # keep order: a write before a rename comes first
        self.out.append(
            {"type": kind, "path": path, "is_dir": is_dir, "time": time.time(), **extra}
        )

    def note_modified(self, path: str, is_dir: bool, now: float) -> None:
        held = self.modified.get(path)
        if held is None:
            event = {"type": "modified", "path": path, "is_dir": is_dir, "time": time.time()}
            self.modified[path] = [event, now, now]
        else:
            held[2] = now

    def flush_modified(self, force: bool = False, now: float = 0.0) -> None:
        for path, (event, first, last) in list(self.modified.items()):
            if force or now - last >= QUIET_S or now - first >= MAX_HOLD_S:
                del self.modified[path]
                self.out.append(event)

    def expire_moves(self, now: float, force: bool = False, idle: bool = True) -> None:
        """A move's first half becomes a delete once its second has not come for
        :data:`MOVE_PAIR_S` of waiting on an empty queue (``idle``), or for
        :data:`MAX_HOLD_S` in any case. Time this agent spent handling other events is
        no evidence: a read can fall between a rename's two halves, and on a stalled
        guest the second one already waits in the queue when the clock has moved on."""
        for cookie, (path, is_dir, seen) in list(self.moved_from.items()):
            if force or (idle and now - seen >= MOVE_PAIR_S) or now - seen >= MAX_HOLD_S:
                del self.moved_from[cookie]
                if is_dir:
                    self.ino.drop_tree(path)
                self.emit("deleted", path, is_dir)

    def handle(self, ev: inotify.RawEvent, now: float) -> None:
        if ev.mask & inotify.IN_Q_OVERFLOW:
            self.emit("overflow", self.root, True)
            return
        base = self.ino.paths.get(ev.wd)
        if ev.mask & inotify.IN_IGNORED:
            if base == self.root:
                self.root_gone = True
            self.ino.forget(ev.wd)
            return
        if base is None:
            return
        if ev.mask & (inotify.IN_DELETE_SELF | inotify.IN_MOVE_SELF):
            if base == self.root:
                self.emit("deleted", base, True)
                self.root_gone = True
            return  # other directories: their parent's watch reports it
        path = posixpath.join(base, ev.name) if ev.name else base
        is_dir = bool(ev.mask & inotify.IN_ISDIR)
        if ev.mask & inotify.IN_CREATE:
            self.emit("created", path, is_dir)
            if is_dir and self.recursive:
                self.add_tree(path, announce=True)
        elif ev.mask & inotify.IN_DELETE:
            self.modified.pop(path, None)
            self.emit("deleted", path, is_dir)
        elif ev.mask & inotify.IN_MOVED_FROM:
            self.moved_from[ev.cookie] = (path, is_dir, now)
        elif ev.mask & inotify.IN_MOVED_TO:
            source = self.moved_from.pop(ev.cookie, None)
            if source is not None:
                self.emit("renamed", path, is_dir, **{"from": source[0], "to": path})
                if is_dir:
                    self.ino.rename_tree(source[0], path)
            else:
                self.emit("created", path, is_dir)
                if is_dir and self.recursive:
                    self.add_tree(path, announce=True)
        elif ev.mask & _MODIFY and ev.name:
            # Events on a watched directory itself (no name) duplicate its parent's.
            self.note_modified(path, is_dir, now)

    def send_out(self) -> None:
        """Send queued events as DATA frames of JSON lines, within the credit window."""
        batch = bytearray()
        for event in self.out:
            line = json.dumps(event, separators=(",", ":")).encode() + b"\n"
            if batch and len(batch) + len(line) > CHUNK:
                self.send(bytes(batch))
                batch.clear()
            batch += line
        self.out.clear()
        if batch:
            self.send(bytes(batch))

    def send(self, payload: bytes) -> None:
        if not self.st.take_credit():
            raise Cancelled()
        self.st.send(DATA, None, payload)

    def run(self) -> dict[str, Any] | None:
        poller = select.poll()
        poller.register(self.ino.fd, select.POLLIN)
        while not self.st.cancelled:
            wait = POLL_S
            if self.modified or self.moved_from:
                wait = min(QUIET_S, MOVE_PAIR_S) / 2
            ready = bool(poller.poll(wait * 1000))
            if ready:
                now = time.monotonic()
                for ev in self.ino.read():
                    self.handle(ev, now)
            now = time.monotonic()
            self.expire_moves(now, idle=not ready)
            self.flush_modified(now=now)
            if self.root_gone:
                self.expire_moves(now, force=True)
                self.flush_modified(force=True)
            self.send_out()
            if self.root_gone:
                return {"reason": "deleted"}
        return None


def op_watch(st: Stream, h: dict[str, Any]) -> dict[str, Any] | None:
    path = checked(h.get("path"))
    recursive = h.get("recursive", True)
    if not isinstance(recursive, bool):
        raise AgentError("invalid_argument", "recursive must be true or false")
    if not os.path.isdir(path):
        os.stat(path)  # not_found first
        raise AgentError(
            "not_a_directory", f"{path!r} is not a directory; watch the directory it is in"
        )
    ino = inotify.Inotify()
    try:
        watcher = Watcher(st, ino, path, recursive)
        watcher.add_tree(path, announce=False)
        st.send(REPLY, {"event": "watching", "path": path, "watches": len(ino.paths)})
        return watcher.run()
    finally:
        ino.close()


OPS: dict[str, Op] = {"watch": op_watch}
