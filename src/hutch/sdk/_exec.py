"""Commands in the SDK, sans-IO: ``exec`` collected or streamed.

The 6 command fields are declared once, in the contract
(:class:`hutch.contract.requests.CommandRequest`); :class:`CommandArgs` types the ones
after ``cmd`` as keyword arguments (exec, exec_stream and background processes take
them), and :func:`command_body` checks them and builds the body.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

import httpx

from hutch.contract.requests import CommandRequest
from hutch.errors import InvalidArgument
from hutch.sdk._core import Call, ClientCore, one
from hutch.sdk._errors import ProtocolError
from hutch.sdk._streams import LineDecoder, error_line
from hutch.sdk._values import maybe, need

__all__ = [
    "CommandArgs",
    "ExecCalls",
    "ExecCollector",
    "ExecEvent",
    "ExecEventDecoder",
    "ExecExit",
    "ExecOutput",
    "ExecResult",
    "command_body",
]


class CommandArgs(TypedDict, total=False):
    """``env`` (added to the sandbox's), ``cwd``, ``user``, ``stdin`` (written first) and
    ``timeout_s`` (seconds; the command is killed when it runs longer)."""

    env: Mapping[str, str] | None
    cwd: str | None
    user: str | None
    stdin: str | bytes | None
    timeout_s: float | None


def check_cmd(cmd: str | Sequence[str]) -> str | list[str]:
    if isinstance(cmd, str):
        if not cmd.strip():
            raise InvalidArgument("cmd is empty; give a shell string or a list of arguments")
        return cmd
    args = list(cmd)
    if not args or not all(isinstance(a, str) for a in args):
        raise InvalidArgument(f"cmd must be a string or a non-empty list of strings, got {cmd!r}")
    return args


def command_body(cmd: str | Sequence[str], args: CommandArgs) -> dict[str, Any]:
    """The JSON body of a command, checked before sending; fields at their default are
    left out (the daemon applies the same defaults)."""
    given: dict[str, Any] = {key: value for key, value in args.items() if value is not None}
    request = CommandRequest(cmd=check_cmd(cmd), **given)
    body = request.non_defaults()
    if "env" in body:
        body["env"] = dict(body["env"])
    stdin = body.get("stdin")
    if isinstance(stdin, bytes):
        body["stdin"] = stdin.decode()
    timeout_s = request.timeout_s
    if timeout_s is not None and timeout_s <= 0:
        raise InvalidArgument(f"timeout_s={timeout_s!r} must be > 0 seconds")
    return body


@dataclass(frozen=True)
class ExecResult:
    """A finished command. ``exit_code`` is None when a signal (``signal``) ended it."""

    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    duration_ms: int

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @classmethod
    def from_dict(cls, obj: Any) -> ExecResult:
        w = "exec result"
        return cls(
            exit_code=maybe(obj, "exit_code", int, w),
            signal=maybe(obj, "signal", int, w),
            stdout=need(obj, "stdout", str, w),
            stderr=need(obj, "stderr", str, w),
            duration_ms=need(obj, "duration_ms", int, w),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "signal": self.signal,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "duration_ms": self.duration_ms,
        }


@dataclass(frozen=True)
class ExecOutput:
    """A chunk of a running command's output, in arrival order."""

    stream: Literal["stdout", "stderr"]
    data: str


@dataclass(frozen=True)
class ExecExit:
    """The last event of a command: how it ended."""

    exit_code: int | None
    signal: int | None
    duration_ms: int


ExecEvent = ExecOutput | ExecExit


class ExecEventDecoder(LineDecoder[ExecEvent]):
    """NDJSON exec events → :class:`ExecOutput` ... :class:`ExecExit`.

    An ``error`` line raises the mapped hutch error (e.g. ``Timeout``); a body that ends
    before the exit event raises :class:`ProtocolError`.
    """

    what = "exec stream"
    ended_early = (
        "the exec stream ended before the command's exit event; the daemon may "
        "have restarted or the connection dropped"
    )

    def item(self, obj: Any) -> ExecEvent:
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind in ("stdout", "stderr"):
            data = obj.get("data")
            if not isinstance(data, str):
                raise ProtocolError(f"exec stream: {kind} event without string data: {obj!r}")
            return ExecOutput(kind, data)
        if kind == "exit":
            self.done = True
            code, sig, ms = obj.get("exit_code"), obj.get("signal"), obj.get("duration_ms")
            if not all(
                v is None or (isinstance(v, int) and not isinstance(v, bool))
                for v in (code, sig, ms)
            ):
                raise ProtocolError(f"exec stream: malformed exit event {obj!r}")
            return ExecExit(exit_code=code, signal=sig, duration_ms=ms or 0)
        if kind == "error":
            self.done = True
            raise error_line(obj, "exec failed")
        raise ProtocolError(f"exec stream: unknown event {obj!r}")


class ExecCollector:
    """Accumulates streamed events into the :class:`ExecResult` a plain exec returns."""

    def __init__(self) -> None:
        self._out: list[str] = []
        self._err: list[str] = []
        self._exit: ExecExit | None = None

    def add(self, event: ExecEvent) -> None:
        if isinstance(event, ExecExit):
            self._exit = event
        elif event.stream == "stdout":
            self._out.append(event.data)
        else:
            self._err.append(event.data)

    def result(self) -> ExecResult:
        if self._exit is None:
            raise ProtocolError("the exec stream ended without an exit event")
        return ExecResult(
            exit_code=self._exit.exit_code,
            signal=self._exit.signal,
            stdout="".join(self._out),
            stderr="".join(self._err),
            duration_ms=self._exit.duration_ms,
        )


class ExecCalls:
    """Builds exec requests. No I/O."""

    def __init__(self, core: ClientCore) -> None:
        self.core = core

    def request(
        self, sandbox_id: str, cmd: str | Sequence[str], args: CommandArgs, *, stream: bool
    ) -> httpx.Request:
        body = {**command_body(cmd, args), "stream": stream}
        # The daemon bounds the command; the HTTP wait only needs to outlast that bound.
        timeout_s, read = args.get("timeout_s"), self.core.config.timeouts.read
        read_timeout = None if timeout_s is None or read is None else timeout_s + read
        return self.core.request(
            "POST",
            self.core.sandbox_path(sandbox_id, "/exec"),
            json_body=body,
            read_timeout=read_timeout,
        )

    def collected(
        self, sandbox_id: str, cmd: str | Sequence[str], args: CommandArgs
    ) -> Call[ExecResult]:
        req = self.request(sandbox_id, cmd, args, stream=False)
        return Call(req, one(ExecResult.from_dict))
