"""The code interpreter in the SDK, sans-IO: ``sb.contexts``, ``ctx.run(code)``,
``sb.run_code``.

:class:`InterpreterCalls` builds requests and reads answers, :class:`RunDecoder` reads
streamed runs and :class:`ExecutionBuilder` turns outputs into an :class:`Execution`; the
value types (a context's description, the outputs of a run) are what the calls return.
The shells are in ``_async/contexts.py`` and, generated from it, ``_sync/contexts.py``.
"""

from __future__ import annotations

import base64
import builtins
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, Protocol
from urllib.parse import quote

import httpx

from hutch.errors import InvalidArgument
from hutch.sdk._core import Call, ClientCore, list_of, nothing, one
from hutch.sdk._errors import ProtocolError
from hutch.sdk._streams import LineDecoder, error_line
from hutch.sdk._values import maybe, moment, need

__all__ = [
    "ContextInfo",
    "Execution",
    "ExecutionBuilder",
    "ExecutionError",
    "InterpreterCalls",
    "Result",
    "ResultCallback",
    "RunDecoder",
    "TextCallback",
    "context_id",
]


class HasId(Protocol):
    @property
    def id(self) -> str: ...


#: A callback per output: stdout/stderr get text, results and displays a :class:`Result`.
TextCallback = Callable[[str], object]
ResultCallback = Callable[["Result"], object]


@dataclass(frozen=True)
class ContextInfo:
    """A Python context in a sandbox: its own interpreter, whose state persists."""

    id: str
    language: str
    cwd: str
    state: Literal["idle", "busy", "dead"]
    pid: int | None
    created_at: datetime | None
    runs: int

    @classmethod
    def from_dict(cls, obj: Any) -> ContextInfo:
        w = "context"
        return cls(
            id=need(obj, "id", str, w),
            language=need(obj, "language", str, w),
            cwd=need(obj, "cwd", str, w),
            state=need(obj, "state", str, w),
            pid=maybe(obj, "pid", int, w),
            created_at=moment(obj, "created_at", w),
            runs=need(obj, "runs", int, w),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "language": self.language,
            "cwd": self.cwd,
            "state": self.state,
            "pid": self.pid,
            "created_at": self.created_at.isoformat() if self.created_at else None,
            "runs": self.runs,
        }


@dataclass(frozen=True)
class Result:
    """A rich value: the last expression (``is_main_result``) or a ``display()``.

    ``data`` is the mime bundle as sent; the properties pick the usual formats (``png``
    and ``jpeg`` decoded to bytes).
    """

    data: dict[str, Any]
    is_main_result: bool = False

    def _str(self, mime: str) -> str | None:
        value = self.data.get(mime)
        return value if isinstance(value, str) else None

    def _bytes(self, mime: str) -> bytes | None:
        value = self.data.get(mime)
        if not isinstance(value, str):
            return None
        try:
            return base64.b64decode(value, validate=True)
        except ValueError as exc:
            raise ProtocolError(f"{mime} output is not base64") from exc

    @property
    def text(self) -> str | None:
        return self._str("text/plain")

    @property
    def html(self) -> str | None:
        return self._str("text/html")

    @property
    def markdown(self) -> str | None:
        return self._str("text/markdown")

    @property
    def svg(self) -> str | None:
        return self._str("image/svg+xml")

    @property
    def png(self) -> bytes | None:
        return self._bytes("image/png")

    @property
    def jpeg(self) -> bytes | None:
        return self._bytes("image/jpeg")

    @property
    def latex(self) -> str | None:
        return self._str("text/latex")

    @property
    def json(self) -> Any:
        return self.data.get("application/json")

    def formats(self) -> list[str]:
        """The mime types present, e.g. ``["text/plain", "image/png"]``."""
        return list(self.data)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "result" if self.is_main_result else "display", "data": self.data}


@dataclass(frozen=True)
class ExecutionError:
    """An exception raised by the code: ``name`` (e.g. ``ZeroDivisionError``),
    ``value`` (its message) and the formatted ``traceback`` lines."""

    name: str
    value: str
    traceback: list[str]

    @property
    def traceback_text(self) -> str:
        return "\n".join(self.traceback)

    def to_dict(self) -> dict[str, Any]:
        return {"ename": self.name, "evalue": self.value, "traceback": self.traceback}


@dataclass
class Execution:
    """What a run produced. ``results`` holds displays and the main result in order;
    ``text`` is the main result's plain text; ``error`` is set when the code raised."""

    outputs: list[dict[str, Any]] = field(default_factory=list)
    results: list[Result] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""
    error: ExecutionError | None = None
    status: str = "ok"
    duration_ms: int = 0

    @property
    def result(self) -> Result | None:
        return next((r for r in self.results if r.is_main_result), None)

    @property
    def text(self) -> str | None:
        main = self.result
        return main.text if main is not None else None

    @property
    def images(self) -> list[bytes]:
        """Every PNG the run produced (plots, displays), in order."""
        return [png for r in self.results if (png := r.png) is not None]

    def to_dict(self) -> dict[str, Any]:
        return {
            "outputs": self.outputs,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "result": self.result.data if self.result else None,
            "error": self.error.to_dict() if self.error else None,
            "status": self.status,
            "duration_ms": self.duration_ms,
        }


class ExecutionBuilder:
    """Turns outputs (collected or streamed) into an :class:`Execution`, calling the
    callbacks as each arrives."""

    def __init__(
        self,
        on_stdout: TextCallback | None = None,
        on_stderr: TextCallback | None = None,
        on_result: ResultCallback | None = None,
    ) -> None:
        self.execution = Execution()
        self._out: list[str] = []
        self._err: list[str] = []
        self._callbacks = (on_stdout, on_stderr, on_result)

    def add(self, item: Any) -> None:
        if not isinstance(item, dict):
            raise ProtocolError(f"run output is not an object: {item!r}")
        on_stdout, on_stderr, on_result = self._callbacks
        ex = self.execution
        ex.outputs.append(item)
        kind = item.get("type")
        if kind in ("stdout", "stderr"):
            text = str(item.get("text", ""))
            (self._out if kind == "stdout" else self._err).append(text)
            callback = on_stdout if kind == "stdout" else on_stderr
            if callback is not None:
                callback(text)
        elif kind in ("result", "display"):
            data = item.get("data")
            if not isinstance(data, dict):
                raise ProtocolError(f"run output: {kind} without a data object")
            result = Result(data, is_main_result=kind == "result")
            ex.results.append(result)
            if on_result is not None:
                on_result(result)
        elif kind == "error":
            ex.error = ExecutionError(
                str(item.get("ename", "")),
                str(item.get("evalue", "")),
                [str(line) for line in item.get("traceback") or []],
            )

    def finish(self, status: str, duration_ms: int) -> Execution:
        ex = self.execution
        ex.stdout, ex.stderr = "".join(self._out), "".join(self._err)
        ex.status, ex.duration_ms = status, duration_ms
        return ex

    @classmethod
    def from_response(cls, obj: Any) -> Execution:
        outputs = need(obj, "outputs", list, "run result")
        builder = cls()
        for item in outputs:
            builder.add(item)
        ex = builder.finish(
            need(obj, "status", str, "run result"), need(obj, "duration_ms", int, "run result")
        )
        return ex


class RunDecoder(LineDecoder[dict[str, Any]]):
    """NDJSON run stream → output dicts, then a final ``{"type": "end", ...}``."""

    what = "run stream"
    ended_early = (
        "the run stream ended before its end event; the daemon may have restarted "
        "or the connection dropped"
    )

    def item(self, obj: Any) -> dict[str, Any]:
        if not isinstance(obj, dict):
            raise ProtocolError(f"run stream: not an object: {obj!r}")
        kind = obj.get("type")
        if kind == "end":
            self.done = True
        elif kind == "error" and "code" in obj:  # the request failed, not the code
            self.done = True
            raise error_line(obj, "run failed")
        return obj


class InterpreterCalls:
    """Builds every code-interpreter request and reads every answer. No I/O."""

    def __init__(self, core: ClientCore) -> None:
        self.core = core

    def _path(self, sandbox_id: str, context_id: str | None = None, suffix: str = "") -> str:
        base = "/contexts"
        if context_id is not None:
            if not isinstance(context_id, str) or not context_id:
                raise InvalidArgument(f"context id must be a non-empty string, got {context_id!r}")
            base += "/" + quote(context_id, safe="")
        return self.core.sandbox_path(sandbox_id, base + suffix)

    def create(
        self,
        sandbox_id: str,
        language: str = "python",
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> Call[ContextInfo]:
        body: dict[str, Any] = {"language": language}
        if cwd is not None:
            body["cwd"] = cwd
        if env:
            body["env"] = dict(env)
        req = self.core.request("POST", self._path(sandbox_id), json_body=body)
        return Call(req, one(ContextInfo.from_dict))

    def list(self, sandbox_id: str) -> Call[builtins.list[ContextInfo]]:
        req = self.core.request("GET", self._path(sandbox_id))
        return Call(req, list_of("contexts", ContextInfo.from_dict))

    def get(self, sandbox_id: str, context_id: str) -> Call[ContextInfo]:
        req = self.core.request("GET", self._path(sandbox_id, context_id))
        return Call(req, one(ContextInfo.from_dict))

    def delete(self, sandbox_id: str, context_id: str) -> Call[None]:
        return Call(self.core.request("DELETE", self._path(sandbox_id, context_id)), nothing)

    def interrupt(self, sandbox_id: str, context_id: str) -> Call[ContextInfo]:
        req = self.core.request("POST", self._path(sandbox_id, context_id, "/interrupt"))
        return Call(req, one(ContextInfo.from_dict))

    def restart(self, sandbox_id: str, context_id: str) -> Call[ContextInfo]:
        req = self.core.request("POST", self._path(sandbox_id, context_id, "/restart"))
        return Call(req, one(ContextInfo.from_dict))

    def run_request(
        self, sandbox_id: str, context_id: str, code: str, timeout_s: float | None, stream: bool
    ) -> httpx.Request:
        if not isinstance(code, str):
            raise InvalidArgument(f"code must be a string of Python source, got {code!r}")
        body: dict[str, Any] = {"code": code}
        if timeout_s is not None:
            if timeout_s <= 0:
                raise InvalidArgument(f"timeout_s={timeout_s!r} must be > 0 seconds")
            body["timeout_s"] = timeout_s
        # The daemon bounds the run; the HTTP wait only needs to outlast that bound.
        read = self.core.config.timeouts.read
        read_timeout = None if timeout_s is None or read is None else timeout_s + read
        return self.core.request(
            "POST",
            self._path(sandbox_id, context_id, "/run"),
            params=[("stream", "1")] if stream else None,
            json_body=body,
            read_timeout=read_timeout,
        )

    def run(
        self, sandbox_id: str, context_id: str, code: str, timeout_s: float | None
    ) -> Call[Execution]:
        req = self.run_request(sandbox_id, context_id, code, timeout_s, stream=False)
        return Call(req, one(ExecutionBuilder.from_response))


def context_id(context: str | HasId | None) -> str | None:
    """The id of a context given as a context object or as its id."""
    if context is None or isinstance(context, str):
        return context
    return context.id
