# Generated from src/hutch/sdk/_async/pty.py by scripts/unasync.py: do not edit.
"""The terminal shells: ``sb.pty`` and the ``Terminal`` sessions it opens, over the
daemon's WebSocket. What a frame means is :class:`TerminalState`'s business (``_pty``)."""

from __future__ import annotations

import builtins
from collections.abc import Mapping

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from hutch.contract.limits import DEFAULT_PTY_COLS, DEFAULT_PTY_ROWS, DEFAULT_TERM
from hutch.errors import HutchError, Timeout
from hutch.sdk import _io_sync as _io
from hutch.sdk._processes import SignalArg
from hutch.sdk._pty import PtyInfo, TerminalState, close_call, list_call, open_failed
from hutch.sdk._sync._closing import ClosesOnExit
from hutch.sdk._sync.client import Client

__all__ = ["Pty", "Terminal"]


class Terminal(ClosesOnExit):
    """A terminal session: ``recv()`` output, ``send()`` keystrokes."""

    def __init__(self, ws: _io.WebSocket) -> None:
        self._ws = ws
        self.state = TerminalState()

    @classmethod
    def connect(cls, url: str, headers: Mapping[str, str], open_timeout: float | None) -> Terminal:
        """Open the WebSocket and wait for the terminal's ready frame (or its error)."""
        try:
            ws = _io.connect_ws(url, headers, open_timeout)
        except (OSError, InvalidHandshake, InvalidURI, TimeoutError) as exc:
            raise open_failed(url, exc) from exc
        term = cls(ws)
        try:
            while term.state.pty_id is None:
                term._next(None)
        except BaseException:
            ws.close()
            raise
        return term

    @property
    def pty_id(self) -> str:
        assert self.state.pty_id is not None
        return self.state.pty_id

    @property
    def exit_code(self) -> int | None:
        return self.state.exit_code

    @property
    def ended(self) -> bool:
        return self.state.ended

    def _next(self, timeout: float | None) -> bytes | None:
        try:
            message = _io.recv_ws(self._ws, timeout)
        except TimeoutError as exc:
            raise Timeout(f"no terminal output within {timeout} s") from exc
        except ConnectionClosed as exc:
            if self.state.ended:
                return b""
            raise self.state.lost(exc) from exc
        return self.state.receive(message)

    def recv(self, timeout: float | None = None) -> bytes:
        """The next output bytes; b"" once the session ended (see ``exit_code``).
        ``Timeout`` if nothing came within ``timeout`` seconds."""
        while True:
            if self.state.ended:
                return b""
            data = self._next(timeout)
            if data is not None:
                return data

    def read_until(self, needle: bytes | str, timeout: float = 30.0) -> bytes:
        """Output up to and including ``needle``; ``Timeout`` if it does not show up."""
        want = needle.encode() if isinstance(needle, str) else needle
        seen = b""
        while want not in seen:
            chunk = self.recv(timeout)
            if not chunk:
                raise HutchError(f"the terminal ended before {want!r} appeared")
            seen += chunk
        return seen

    def send(self, data: bytes | str) -> None:
        """Keystrokes (``"ls\\n"``, ``b"\\x03"`` for Ctrl-C as the tty sees it)."""
        self._ws.send(data.encode() if isinstance(data, str) else bytes(data))

    def resize(self, rows: int, cols: int) -> None:
        self._ws.send(TerminalState.resize(rows, cols))

    def signal(self, sig: SignalArg) -> None:
        """Signal the terminal's foreground job."""
        self._ws.send(TerminalState.signal_frame(sig))

    def kill(self) -> None:
        """Hang up the terminal for good (its program gets SIGHUP, then SIGKILL)."""
        self._ws.send(TerminalState.CLOSE)

    def detach(self) -> None:
        """Close this connection; the terminal keeps running. Idempotent."""
        self._ws.close()

    def close(self) -> None:
        self.detach()


class Pty:
    """``sb.pty``: interactive terminals in the sandbox."""

    def __init__(self, client: Client, sandbox_id: str) -> None:
        self._client = client
        self._id = sandbox_id

    def open(
        self,
        rows: int = DEFAULT_PTY_ROWS,
        cols: int = DEFAULT_PTY_COLS,
        *,
        cmd: str | None = None,
        term: str = DEFAULT_TERM,
    ) -> Terminal:
        """A new terminal running ``cmd`` (default: a login shell)."""
        core = self._client.core
        url, headers = TerminalState.url(core, self._id, rows=rows, cols=cols, cmd=cmd, term=term)
        return Terminal.connect(url, headers, core.config.timeouts.connect)

    def attach(self, pty_id: str) -> Terminal:
        """Reattach to a running terminal: its scrollback first, then live output."""
        core = self._client.core
        url, headers = TerminalState.url(core, self._id, pty_id=pty_id)
        return Terminal.connect(url, headers, core.config.timeouts.connect)

    def list(self) -> builtins.list[PtyInfo]:
        return self._client.call(list_call(self._client.core, self._id))

    def close(self, pty_id: str) -> PtyInfo:
        """Hang up a terminal and forget it."""
        return self._client.call(close_call(self._client.core, self._id, pty_id))
