"""What the code interpreter gives back, as plain values: a context's description, the
outputs of a run (:class:`Execution`, :class:`Result`, :class:`ExecutionError`) and the
sans-IO readers that build them from a streamed or a whole answer."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from hutch.sdk._errors import ProtocolError, error_for
from hutch.sdk._types import _get, _opt, _time

__all__ = [
    "ContextInfo",
    "Execution",
    "ExecutionBuilder",
    "ExecutionError",
    "Result",
    "ResultCallback",
    "RunDecoder",
    "TextCallback",
]

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
            id=_get(obj, "id", str, w),
            language=_get(obj, "language", str, w),
            cwd=_get(obj, "cwd", str, w),
            state=_get(obj, "state", str, w),
            pid=_opt(obj, "pid", int, w),
            created_at=_time(obj, "created_at", w),
            runs=_get(obj, "runs", int, w),
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
        outputs = _get(obj, "outputs", list, "run result")
        builder = cls()
        for item in outputs:
            builder.add(item)
        ex = builder.finish(
            _get(obj, "status", str, "run result"), _get(obj, "duration_ms", int, "run result")
        )
        return ex


class RunDecoder:
    """NDJSON run stream → output dicts, then a final ``{"type": "end", ...}``."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.done = False

    def feed(self, chunk: bytes) -> Sequence[dict[str, Any]]:
        self._buffer += chunk
        items: list[dict[str, Any]] = []
        while not self.done and (end := self._buffer.find(b"\n")) >= 0:
            line = bytes(self._buffer[:end]).strip()
            del self._buffer[: end + 1]
            if line:
                items.append(self._item(line))
        return items

    def eof(self) -> Sequence[dict[str, Any]]:
        if not self.done:
            raise ProtocolError(
                "the run stream ended before its end event; the daemon may have restarted "
                "or the connection dropped"
            )
        return []

    def _item(self, line: bytes) -> dict[str, Any]:
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ProtocolError(f"run stream: not a JSON line: {line[:200]!r}") from exc
        if not isinstance(obj, dict):
            raise ProtocolError(f"run stream: not an object: {obj!r}")
        kind = obj.get("type")
        if kind == "end":
            self.done = True
        elif kind == "error" and "code" in obj:  # the request failed, not the code
            self.done = True
            message = obj.get("message")
            raise error_for(
                obj.get("code") if isinstance(obj.get("code"), str) else None,
                None,
                message if isinstance(message, str) else f"run failed: {obj!r}",
            )
        return obj
