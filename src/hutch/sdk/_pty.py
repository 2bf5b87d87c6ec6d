"""Interactive terminals in the SDK: ``sb.pty.open(rows, cols)`` → :class:`Terminal`.

A terminal is a program (a login shell by default) on a PTY in the sandbox, reached over
the daemon's WebSocket ``/v1/sandboxes/{id}/pty``. It outlives the connection:
:meth:`Terminal.detach` (or a dropped network) leaves it running with its scrollback, and
``sb.pty.attach(pty_id)`` picks it up again. This module is the sans-IO core:
:class:`TerminalState` (URLs, control frames, what a received frame means) and the
list/close calls. The shells that move frames (``Terminal``, ``Pty`` and their asyncio
twins, on websockets' clients) are in ``_async/pty.py`` and, generated from it,
``_sync/pty.py``.
"""

from __future__ import annotations

import builtins
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote, urlencode

from websockets.exceptions import ConnectionClosed

from hutch.contract.limits import DEFAULT_PTY_COLS, DEFAULT_PTY_ROWS, DEFAULT_TERM, PTY_SIZE_RANGE
from hutch.errors import HutchError, InvalidArgument, Timeout
from hutch.sdk._core import Call, ClientCore, list_of, one
from hutch.sdk._errors import DaemonUnreachable, ProtocolError
from hutch.sdk._processes import SignalArg
from hutch.sdk._streams import error_line
from hutch.sdk._values import maybe, moment, need
from hutch.version import __version__

__all__ = ["PtyInfo", "TerminalState", "close_call", "list_call", "open_failed"]

SIZE_RANGE = PTY_SIZE_RANGE


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
            pty_id=need(obj, "pty_id", str, w),
            pid=need(obj, "pid", int, w),
            argv=[str(a) for a in need(obj, "argv", list, w)],
            state=need(obj, "state", str, w),
            exit_code=maybe(obj, "exit_code", int, w),
            signal=maybe(obj, "signal", int, w),
            rows=need(obj, "rows", int, w),
            cols=need(obj, "cols", int, w),
            attached=bool(need(obj, "attached", bool, w)),
            started_at=moment(obj, "started_at", w),
            ended_at=moment(obj, "ended_at", w),
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
        rows: int = DEFAULT_PTY_ROWS,
        cols: int = DEFAULT_PTY_COLS,
        cmd: str | None = None,
        term: str = DEFAULT_TERM,
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
        if core.config.project is not None:
            headers["Hutch-Project"] = core.config.project
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
            self.pty_id = need(obj, "pty_id", str, "terminal ready")
            self.pid = maybe(obj, "pid", int, "terminal ready")
        elif kind == "exit":
            self.exited = True
            self.exit_code = maybe(obj, "exit_code", int, "terminal exit")
            self.signal = maybe(obj, "signal", int, "terminal exit")
        elif kind == "detached":
            self.detached = True
        elif kind == "error":
            raise error_line(obj, "terminal error")
        else:
            raise ProtocolError(f"terminal: unknown control frame {obj!r}")
        return None

    def lost(self, exc: ConnectionClosed) -> HutchError:
        return DaemonUnreachable(
            f"the terminal connection closed ({exc}); the terminal keeps running: reattach "
            f"with pty_id={self.pty_id!r}"
        )


def open_failed(url: str, exc: Exception) -> HutchError:
    if isinstance(exc, TimeoutError):
        return Timeout(f"the hutch daemon did not open the terminal at {url} in time")
    return DaemonUnreachable(
        f"cannot open a terminal at {url} ({exc}); is the daemon running and this sandbox id right?"
    )


def list_call(core: ClientCore, sandbox_id: str) -> Call[builtins.list[PtyInfo]]:
    req = core.request("GET", core.sandbox_path(sandbox_id, "/ptys"))
    return Call(req, list_of("ptys", PtyInfo.from_dict))


def close_call(core: ClientCore, sandbox_id: str, pty_id: str) -> Call[PtyInfo]:
    if not isinstance(pty_id, str) or not pty_id:
        raise InvalidArgument(f"pty_id must be a non-empty string, got {pty_id!r}")
    path = core.sandbox_path(sandbox_id, f"/ptys/{quote(pty_id, safe='')}")
    req = core.request("DELETE", path)
    return Call(req, one(PtyInfo.from_dict))
