"""The terminal shells: ``sb.pty`` and the ``Terminal`` sessions it opens, over the
daemon's WebSocket. What a frame means is :class:`TerminalState`'s business (``_pty``)."""

from __future__ import annotations

import builtins
from collections.abc import Mapping

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from hutch.contract.limits import DEFAULT_PTY_COLS, DEFAULT_PTY_ROWS, DEFAULT_TERM
from hutch.errors import HutchError, Timeout
from hutch.sdk import _io_async as _io
from hutch.sdk._async._closing import AsyncClosesOnExit
from hutch.sdk._async.client import AsyncClient
from hutch.sdk._processes import SignalArg
from hutch.sdk._pty import PtyInfo, TerminalState, close_call, list_call, open_failed

__all__ = ["AsyncPty", "AsyncTerminal"]


class AsyncTerminal(AsyncClosesOnExit):
    """A terminal session: ``recv()`` output, ``send()`` keystrokes."""

    def __init__(self, ws: _io.WebSocket) -> None:
        self._ws = ws
        self.state = TerminalState()

    @classmethod
    async def connect(
        cls, url: str, headers: Mapping[str, str], open_timeout: float | None
    ) -> AsyncTerminal:
        """Open the WebSocket and wait for the terminal's ready frame (or its error)."""
        try:
            ws = await _io.connect_ws(url, headers, open_timeout)
        except (OSError, InvalidHandshake, InvalidURI, TimeoutError) as exc:
            raise open_failed(url, exc) from exc
        term = cls(ws)
        try:
            while term.state.pty_id is None:
                await term._next(None)
        except BaseException:
            await ws.close()
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

    # The blocking twin takes the same timeouts: ASYNC109 is waived.  # unasync: drop
    async def _next(self, timeout: float | None) -> bytes | None:  # noqa: ASYNC109
        try:
            message = await _io.recv_ws(self._ws, timeout)
        except TimeoutError as exc:
            raise Timeout(f"no terminal output within {timeout} s") from exc
        except ConnectionClosed as exc:
            if self.state.ended:
                return b""
            raise self.state.lost(exc) from exc
        return self.state.receive(message)

    async def recv(self, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        """The next output bytes; b"" once the session ended (see ``exit_code``).
        ``Timeout`` if nothing came within ``timeout`` seconds."""
        while True:
            if self.state.ended:
                return b""
            data = await self._next(timeout)
            if data is not None:
                return data

    async def read_until(self, needle: bytes | str, timeout: float = 30.0) -> bytes:  # noqa: ASYNC109
        """Output up to and including ``needle``; ``Timeout`` if it does not show up."""
        want = needle.encode() if isinstance(needle, str) else needle
        seen = b""
        while want not in seen:
            chunk = await self.recv(timeout)
            if not chunk:
                raise HutchError(f"the terminal ended before {want!r} appeared")
            seen += chunk
        return seen

    async def send(self, data: bytes | str) -> None:
        """Keystrokes (``"ls\\n"``, ``b"\\x03"`` for Ctrl-C as the tty sees it)."""
        await self._ws.send(data.encode() if isinstance(data, str) else bytes(data))

    async def resize(self, rows: int, cols: int) -> None:
        await self._ws.send(TerminalState.resize(rows, cols))

    async def signal(self, sig: SignalArg) -> None:
        """Signal the terminal's foreground job."""
        await self._ws.send(TerminalState.signal_frame(sig))

    async def kill(self) -> None:
        """Hang up the terminal for good (its program gets SIGHUP, then SIGKILL)."""
        await self._ws.send(TerminalState.CLOSE)

    async def detach(self) -> None:
        """Close this connection; the terminal keeps running. Idempotent."""
        await self._ws.close()

    async def aclose(self) -> None:
        await self.detach()

    close = detach  # unasync: drop


class AsyncPty:
    """``sb.pty``: interactive terminals in the sandbox."""

    def __init__(self, client: AsyncClient, sandbox_id: str) -> None:
        self._client = client
        self._id = sandbox_id

    async def open(
        self,
        rows: int = DEFAULT_PTY_ROWS,
        cols: int = DEFAULT_PTY_COLS,
        *,
        cmd: str | None = None,
        term: str = DEFAULT_TERM,
    ) -> AsyncTerminal:
        """A new terminal running ``cmd`` (default: a login shell)."""
        core = self._client.core
        url, headers = TerminalState.url(core, self._id, rows=rows, cols=cols, cmd=cmd, term=term)
        return await AsyncTerminal.connect(url, headers, core.config.timeouts.connect)

    async def attach(self, pty_id: str) -> AsyncTerminal:
        """Reattach to a running terminal: its scrollback first, then live output."""
        core = self._client.core
        url, headers = TerminalState.url(core, self._id, pty_id=pty_id)
        return await AsyncTerminal.connect(url, headers, core.config.timeouts.connect)

    async def list(self) -> builtins.list[PtyInfo]:
        return await self._client.call(list_call(self._client.core, self._id))

    async def close(self, pty_id: str) -> PtyInfo:
        """Hang up a terminal and forget it."""
        return await self._client.call(close_call(self._client.core, self._id, pty_id))
