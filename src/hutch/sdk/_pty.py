"""Interactive terminals in the SDK: ``sb.pty.open(rows, cols)`` → :class:`Terminal`.

A terminal is a program (a login shell by default) on a PTY in the sandbox, reached over
the daemon's WebSocket ``/v1/sandboxes/{id}/pty``. It outlives the connection:
:meth:`Terminal.detach` (or a dropped network) leaves it running with its scrollback, and
``sb.pty.attach(pty_id)`` picks it up again. :class:`TerminalState` is the sans-IO core
(URLs, control frames, what a received frame means); :class:`Terminal` (websockets' sync
client) and :class:`AsyncTerminal` (its asyncio client) only move frames.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote, urlencode

import websockets.asyncio.client as ws_async
import websockets.sync.client as ws_sync
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from hutch.errors import HutchError, InvalidArgument, Timeout
from hutch.sdk._async_client import AsyncClient
from hutch.sdk._client import Client
from hutch.sdk._closing import AsyncClosesOnExit, ClosesOnExit
from hutch.sdk._core import Call, ClientCore, _json, _list_of
from hutch.sdk._errors import DaemonUnreachable, ProtocolError, error_for
from hutch.sdk._processes import SignalArg
from hutch.sdk._types import _get, _opt, _time
from hutch.version import __version__

__all__ = ["AsyncPty", "AsyncTerminal", "Pty", "PtyInfo", "Terminal", "TerminalState"]

SIZE_RANGE = (1, 1000)


@dataclass(frozen=True)
class PtyInfo:
    """A terminal as the daemon reported it (``GET .../ptys``)."""

    pty_id: str
    pid: int
    argv: list[str]
    state: str
    exit_code: int | None
    signal: int | None
    rows: int
    cols: int
    attached: bool
    started_at: datetime | None
    ended_at: datetime | None

    @classmethod
    def from_dict(cls, obj: Any) -> PtyInfo:
        w = "terminal"
        return cls(
            pty_id=_get(obj, "pty_id", str, w),
            pid=_get(obj, "pid", int, w),
            argv=[str(a) for a in _get(obj, "argv", list, w)],
            state=_get(obj, "state", str, w),
            exit_code=_opt(obj, "exit_code", int, w),
            signal=_opt(obj, "signal", int, w),
            rows=_get(obj, "rows", int, w),
            cols=_get(obj, "cols", int, w),
            attached=bool(_get(obj, "attached", bool, w)),
            started_at=_time(obj, "started_at", w),
            ended_at=_time(obj, "ended_at", w),
        )


def _size(rows: int, cols: int) -> tuple[int, int]:
    lo, hi = SIZE_RANGE
    for name, value in (("rows", rows), ("cols", cols)):
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise InvalidArgument(f"{name}={value!r} is out of range; accepted: {lo}-{hi}")
    return rows, cols


class TerminalState:
    """What one terminal connection knows; turns received frames into output. No I/O."""

    def __init__(self) -> None:
        self.pty_id: str | None = None
        self.pid: int | None = None
        #: Set when the program ended: its exit code, or the signal that ended it.
        self.exit_code: int | None = None
        self.signal: int | None = None
        self.exited = False
        #: Another client attached to the same terminal and took it over.
        self.detached = False

    @property
    def ended(self) -> bool:
        return self.exited or self.detached

    @staticmethod
    def url(
        core: ClientCore,
        sandbox_id: str,
        *,
        rows: int = 24,
        cols: int = 80,
        cmd: str | None = None,
        term: str = "xterm-256color",
        pty_id: str | None = None,
    ) -> tuple[str, dict[str, str]]:
        """The WebSocket URL and headers to open (or, with ``pty_id``, reattach)."""
        rows, cols = _size(rows, cols)
        query: dict[str, str] = {"rows": str(rows), "cols": str(cols), "term": term}
        if cmd is not None:
            if not cmd.strip():
                raise InvalidArgument("cmd is empty; leave it out for a login shell")
            query["cmd"] = cmd
        if pty_id is not None:
            query = {"pty_id": pty_id}
        base = core.base_url
        scheme = "wss://" if base.startswith("https://") else "ws://"
        address = base.split("://", 1)[-1]
        path = core._sandbox_path(sandbox_id, "/pty")
        headers = {
            "Authorization": f"Bearer {core.config.require_key()}",
            "User-Agent": f"hutch-python/{__version__}",
        }
        return f"{scheme}{address}{path}?{urlencode(query)}", headers

    @staticmethod
    def resize(rows: int, cols: int) -> str:
        rows, cols = _size(rows, cols)
        return json.dumps({"type": "resize", "rows": rows, "cols": cols})

    @staticmethod
    def signal_frame(sig: SignalArg) -> str:
        if isinstance(sig, bool) or not isinstance(sig, int | str) or sig in ("", 0):
            raise InvalidArgument(f"signal={sig!r}; give a number (2) or a name ('INT')")
        return json.dumps({"type": "signal", "signal": sig})

    CLOSE = json.dumps({"type": "close"})

    def receive(self, message: str | bytes) -> bytes | None:
        """Output bytes for a binary frame; None for a control frame (state updated).
        An ``error`` frame raises the mapped hutch error."""
        if isinstance(message, bytes):
            return message
        try:
            obj = json.loads(message)
        except ValueError as exc:
            raise ProtocolError(f"terminal: control frame is not JSON: {message[:200]!r}") from exc
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind == "ready":
            self.pty_id = _get(obj, "pty_id", str, "terminal ready")
            self.pid = _opt(obj, "pid", int, "terminal ready")
        elif kind == "exit":
            self.exited = True
            self.exit_code = _opt(obj, "exit_code", int, "terminal exit")
            self.signal = _opt(obj, "signal", int, "terminal exit")
        elif kind == "detached":
            self.detached = True
        elif kind == "error":
            code, msg = obj.get("code"), obj.get("message")
            raise error_for(
                code if isinstance(code, str) else None,
                None,
                msg if isinstance(msg, str) else f"terminal error: {obj!r}",
            )
        else:
            raise ProtocolError(f"terminal: unknown control frame {obj!r}")
        return None

    def lost(self, exc: ConnectionClosed) -> HutchError:
        return DaemonUnreachable(
            f"the terminal connection closed ({exc}); the terminal keeps running: reattach "
            f"with pty_id={self.pty_id!r}"
        )


def _open_failed(url: str, exc: Exception) -> HutchError:
    if isinstance(exc, TimeoutError):
        return Timeout(f"the hutch daemon did not open the terminal at {url} in time")
    return DaemonUnreachable(
        f"cannot open a terminal at {url} ({exc}); is the daemon running and this sandbox id right?"
    )


class Terminal(ClosesOnExit):
    """A blocking terminal session. ``recv()`` output, ``send()`` keystrokes."""

    def __init__(self, ws: ws_sync.ClientConnection) -> None:
        self._ws = ws
        self.state = TerminalState()
        while self.state.pty_id is None:  # the ready frame (or the error) comes first
            self._next(None)

    @classmethod
    def connect(cls, url: str, headers: Mapping[str, str], open_timeout: float | None) -> Terminal:
        try:
            ws = ws_sync.connect(
                url,
                additional_headers=dict(headers),
                open_timeout=open_timeout,
                max_size=None,
                legacy=True,
            )
        except (OSError, InvalidHandshake, InvalidURI, TimeoutError) as exc:
            raise _open_failed(url, exc) from exc
        try:
            return cls(ws)
        except BaseException:
            ws.close()
            raise

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
            message = self._ws.recv(timeout)
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

    close = detach


class AsyncTerminal(AsyncClosesOnExit):
    """An asyncio terminal session; see :class:`Terminal`."""

    def __init__(self, ws: ws_async.ClientConnection) -> None:
        self._ws = ws
        self.state = TerminalState()

    @classmethod
    async def connect(
        cls, url: str, headers: Mapping[str, str], open_timeout: float | None
    ) -> AsyncTerminal:
        try:
            ws = await ws_async.connect(
                url,
                additional_headers=dict(headers),
                open_timeout=open_timeout,
                max_size=None,
            )
        except (OSError, InvalidHandshake, InvalidURI, TimeoutError) as exc:
            raise _open_failed(url, exc) from exc
        term = cls(ws)
        try:
            while term.state.pty_id is None:
                await term._next()
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

    async def _next(self) -> bytes | None:
        try:
            message = await self._ws.recv()
        except ConnectionClosed as exc:
            if self.state.ended:
                return b""
            raise self.state.lost(exc) from exc
        return self.state.receive(message)

    async def recv(self) -> bytes:
        """The next output bytes; b"" once the session ended. Bound it with
        ``asyncio.timeout`` if needed."""
        while True:
            if self.state.ended:
                return b""
            data = await self._next()
            if data is not None:
                return data

    async def send(self, data: bytes | str) -> None:
        await self._ws.send(data.encode() if isinstance(data, str) else bytes(data))

    async def resize(self, rows: int, cols: int) -> None:
        await self._ws.send(TerminalState.resize(rows, cols))

    async def signal(self, sig: SignalArg) -> None:
        await self._ws.send(TerminalState.signal_frame(sig))

    async def kill(self) -> None:
        await self._ws.send(TerminalState.CLOSE)

    async def detach(self) -> None:
        await self._ws.close()

    close = detach
    aclose = detach


def _list_call(core: ClientCore, sandbox_id: str) -> Call[builtins.list[PtyInfo]]:
    req = core.request("GET", core._sandbox_path(sandbox_id, "/ptys"))
    return Call(req, _list_of("ptys", PtyInfo.from_dict))


def _close_call(core: ClientCore, sandbox_id: str, pty_id: str) -> Call[PtyInfo]:
    if not isinstance(pty_id, str) or not pty_id:
        raise InvalidArgument(f"pty_id must be a non-empty string, got {pty_id!r}")
    path = core._sandbox_path(sandbox_id, f"/ptys/{quote(pty_id, safe='')}")
    req = core.request("DELETE", path)
    return Call(req, lambda r: PtyInfo.from_dict(_json(r)))


class Pty:
    """``sb.pty``: interactive terminals in the sandbox."""

    def __init__(self, client: Client, sandbox_id: str) -> None:
        self._client = client
        self._id = sandbox_id

    def open(
        self,
        rows: int = 24,
        cols: int = 80,
        *,
        cmd: str | None = None,
        term: str = "xterm-256color",
    ) -> Terminal:
        """A new terminal running ``cmd`` (default: a login shell)."""
        url, headers = TerminalState.url(
            self._client.core, self._id, rows=rows, cols=cols, cmd=cmd, term=term
        )
        return Terminal.connect(url, headers, self._client.core.config.timeouts.connect)

    def attach(self, pty_id: str) -> Terminal:
        """Reattach to a running terminal: its scrollback first, then live output."""
        url, headers = TerminalState.url(self._client.core, self._id, pty_id=pty_id)
        return Terminal.connect(url, headers, self._client.core.config.timeouts.connect)

    def list(self) -> builtins.list[PtyInfo]:
        return self._client.call(_list_call(self._client.core, self._id))

    def close(self, pty_id: str) -> PtyInfo:
        """Hang up a terminal and forget it."""
        return self._client.call(_close_call(self._client.core, self._id, pty_id))


class AsyncPty:
    """``sb.pty`` of an ``AsyncSandbox``; see :class:`Pty`."""

    def __init__(self, client: AsyncClient, sandbox_id: str) -> None:
        self._client = client
        self._id = sandbox_id

    async def open(
        self,
        rows: int = 24,
        cols: int = 80,
        *,
        cmd: str | None = None,
        term: str = "xterm-256color",
    ) -> AsyncTerminal:
        url, headers = TerminalState.url(
            self._client.core, self._id, rows=rows, cols=cols, cmd=cmd, term=term
        )
        return await AsyncTerminal.connect(url, headers, self._client.core.config.timeouts.connect)

    async def attach(self, pty_id: str) -> AsyncTerminal:
        url, headers = TerminalState.url(self._client.core, self._id, pty_id=pty_id)
        return await AsyncTerminal.connect(url, headers, self._client.core.config.timeouts.connect)

    async def list(self) -> builtins.list[PtyInfo]:
        return await self._client.call(_list_call(self._client.core, self._id))

    async def close(self, pty_id: str) -> PtyInfo:
        return await self._client.call(_close_call(self._client.core, self._id, pty_id))
