"""Keeps one shared mount of one sandbox served: connects to the chardev socket of the
mount's virtio-serial port (``hutch.vm.argv.SharePort``), serves a fresh
:class:`~hutch.storage.sharefs_server.ShareFsSession` on each connection and connects
again when one ends, until closed.

A connection ends when its QEMU does: a memory-mode pause (the resumed VM's QEMU listens
on the same path), a fork child's restore, a crash. A restarted daemon makes a new link
to the same socket (QEMU's chardev server takes the next connection). Each new session
starts with a HELLO, so a guest that was waiting for a reply sends its request again
(``sharefs_wire``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from hutch.storage.sharefs_server import ShareFsSession, serve_stream

__all__ = ["ShareLink"]

log = logging.getLogger(__name__)

_RETRY_S = (0.05, 1.0)  # first and longest wait between connection attempts


class ShareLink:
    def __init__(self, socket_path: Path, root: str | os.PathLike[str], *, read_only: bool) -> None:
        self.socket_path = socket_path
        self.root = root
        self.read_only = read_only
        #: Connections served so far (a test's and a log's view of reconnects).
        self.connections = 0
        self._task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"sharefs {self.socket_path}")

    async def wait_connected(self) -> None:
        """Return once a connection is being served (tests)."""
        await self._connected.wait()

    async def _run(self) -> None:
        wait = _RETRY_S[0]
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(self.socket_path))
            except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError):
                await asyncio.sleep(wait)  # no QEMU listening (paused, restarting)
                wait = min(wait * 2, _RETRY_S[1])
                continue
            except OSError as exc:
                log.warning("sharefs: cannot connect to %s: %s", self.socket_path, exc)
                await asyncio.sleep(_RETRY_S[1])
                continue
            wait = _RETRY_S[0]
            try:
                session = ShareFsSession(self.root, read_only=self.read_only)
            except OSError as exc:
                log.error("sharefs: cannot open the volume tree %s: %s", self.root, exc)
                writer.close()
                await asyncio.sleep(_RETRY_S[1])
                continue
            self.connections += 1
            self._connected.set()
            try:
                await serve_stream(reader, writer, session)
            finally:
                self._connected.clear()
            log.info("sharefs: %s disconnected; connecting again", self.socket_path)

    async def close(self) -> None:
        """Stop serving (the session's handles close); safe to call twice."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
