"""The code interpreter in the SDK: ``sb.contexts``, ``ctx.run(code)``, ``sb.run_code``.

One sans-IO core (:class:`InterpreterCalls` builds requests and reads answers,
:class:`RunDecoder` reads streamed runs, :class:`ExecutionBuilder` turns outputs into
an :class:`Execution`) and two thin shells (blocking and asyncio) that only send.
"""

from __future__ import annotations

import base64
import builtins
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import quote

import httpx

from hutch.errors import InvalidArgument
from hutch.sdk._core import Call, ClientCore, _json, _list_of, _nothing
from hutch.sdk._errors import ProtocolError, error_for
from hutch.sdk._types import _get, _opt, _time

if TYPE_CHECKING:
    from hutch.sdk._async_client import AsyncClient
    from hutch.sdk._client import Client

__all__ = [
    "AsyncCodeRunner",
    "AsyncContext",
    "AsyncContexts",
    "CodeRunner",
    "Context",
    "ContextInfo",
    "Contexts",
    "Execution",
    "ExecutionError",
    "InterpreterCalls",
    "Result",
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
        return self.core._sandbox_path(sandbox_id, base + suffix)

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
        return Call(req, lambda r: ContextInfo.from_dict(_json(r)))

    def list(self, sandbox_id: str) -> Call[builtins.list[ContextInfo]]:
        req = self.core.request("GET", self._path(sandbox_id))
        return Call(req, _list_of("contexts", ContextInfo.from_dict))

    def get(self, sandbox_id: str, context_id: str) -> Call[ContextInfo]:
        req = self.core.request("GET", self._path(sandbox_id, context_id))
        return Call(req, lambda r: ContextInfo.from_dict(_json(r)))

    def delete(self, sandbox_id: str, context_id: str) -> Call[None]:
        return Call(self.core.request("DELETE", self._path(sandbox_id, context_id)), _nothing)

    def interrupt(self, sandbox_id: str, context_id: str) -> Call[ContextInfo]:
        req = self.core.request("POST", self._path(sandbox_id, context_id, "/interrupt"))
        return Call(req, lambda r: ContextInfo.from_dict(_json(r)))

    def restart(self, sandbox_id: str, context_id: str) -> Call[ContextInfo]:
        req = self.core.request("POST", self._path(sandbox_id, context_id, "/restart"))
        return Call(req, lambda r: ContextInfo.from_dict(_json(r)))

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
        return Call(req, lambda r: ExecutionBuilder.from_response(_json(r)))


def _context_id(context: str | Context | AsyncContext | None) -> str | None:
    if context is None or isinstance(context, str):
        return context
    return context.id


# -- blocking shell -----------------------------------------------------------------------


class Context:
    """One Python context (``sb.contexts.create()``): ``ctx.run("x = 1")``."""

    def __init__(self, client: Client, sandbox_id: str, info: ContextInfo) -> None:
        self._client = client
        self._calls = InterpreterCalls(client.core)
        self.sandbox_id = sandbox_id
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    def run(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        on_stdout: TextCallback | None = None,
        on_stderr: TextCallback | None = None,
        on_result: ResultCallback | None = None,
    ) -> Execution:
        """Run ``code``; variables persist for the next run. An exception in the code is
        ``execution.error`` (not raised). With callbacks, outputs stream into them."""
        if on_stdout is None and on_stderr is None and on_result is None:
            return self._client.call(self._calls.run(self.sandbox_id, self.id, code, timeout_s))
        from hutch.sdk._client import ResponseStream

        request = self._calls.run_request(self.sandbox_id, self.id, code, timeout_s, True)
        builder = ExecutionBuilder(on_stdout, on_stderr, on_result)
        status, duration = "error", 0
        with ResponseStream(self._client, request, RunDecoder()) as items:
            for item in items:
                if item.get("type") == "end":
                    status, duration = str(item.get("status")), int(item.get("duration_ms", 0))
                else:
                    builder.add(item)
        return builder.finish(status, duration)

    def interrupt(self) -> None:
        """Stop the running code (KeyboardInterrupt); variables are kept."""
        self.info = self._client.call(self._calls.interrupt(self.sandbox_id, self.id))

    def restart(self) -> None:
        """A fresh interpreter: every variable is gone."""
        self.info = self._client.call(self._calls.restart(self.sandbox_id, self.id))

    def refresh(self) -> ContextInfo:
        self.info = self._client.call(self._calls.get(self.sandbox_id, self.id))
        return self.info

    def delete(self) -> None:
        self._client.call(self._calls.delete(self.sandbox_id, self.id))


class Contexts:
    """``sb.contexts``: the sandbox's Python contexts."""

    def __init__(self, client: Client, sandbox_id: str) -> None:
        self._client = client
        self._calls = InterpreterCalls(client.core)
        self._id = sandbox_id
        self._default: Context | None = None

    def create(
        self, language: str = "python", *, cwd: str | None = None, env: dict[str, str] | None = None
    ) -> Context:
        info = self._client.call(self._calls.create(self._id, language, cwd, env))
        return Context(self._client, self._id, info)

    def list(self) -> builtins.list[Context]:
        infos = self._client.call(self._calls.list(self._id))
        return [Context(self._client, self._id, info) for info in infos]

    def get(self, context_id: str) -> Context:
        """``NotFound`` if there is no such context."""
        info = self._client.call(self._calls.get(self._id, context_id))
        return Context(self._client, self._id, info)

    def default(self) -> Context:
        """The context ``sb.run_code`` uses when given none (created on first use)."""
        if self._default is None:
            self._default = self.create()
        return self._default


class CodeRunner:
    """Mixed into :class:`hutch.Sandbox`: ``sb.run_code(code)``."""

    contexts: Contexts
    _client: Client

    @property
    def id(self) -> str:
        raise NotImplementedError

    def run_code(
        self,
        code: str,
        context: str | Context | None = None,
        *,
        timeout_s: float | None = None,
        on_stdout: TextCallback | None = None,
        on_stderr: TextCallback | None = None,
        on_result: ResultCallback | None = None,
    ) -> Execution:
        """Run Python ``code`` in ``context`` (a context or its id; default: one context
        per handle, created on first use, so variables persist between calls)."""
        cid = _context_id(context)
        if cid is None:
            ctx = self.contexts.default()
        else:
            ctx = Context(
                self._client, self.id, ContextInfo(cid, "python", "", "idle", None, None, 0)
            )
        return ctx.run(
            code,
            timeout_s=timeout_s,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            on_result=on_result,
        )


# -- asyncio shell ------------------------------------------------------------------------


class AsyncContext:
    """One Python context of an ``AsyncSandbox``; see :class:`Context`."""

    def __init__(self, client: AsyncClient, sandbox_id: str, info: ContextInfo) -> None:
        self._client = client
        self._calls = InterpreterCalls(client.core)
        self.sandbox_id = sandbox_id
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    async def run(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        on_stdout: TextCallback | None = None,
        on_stderr: TextCallback | None = None,
        on_result: ResultCallback | None = None,
    ) -> Execution:
        if on_stdout is None and on_stderr is None and on_result is None:
            return await self._client.call(
                self._calls.run(self.sandbox_id, self.id, code, timeout_s)
            )
        from hutch.sdk._async_client import AsyncResponseStream

        request = self._calls.run_request(self.sandbox_id, self.id, code, timeout_s, True)
        builder = ExecutionBuilder(on_stdout, on_stderr, on_result)
        status, duration = "error", 0
        async with AsyncResponseStream(self._client, request, RunDecoder()) as items:
            async for item in items:
                if item.get("type") == "end":
                    status, duration = str(item.get("status")), int(item.get("duration_ms", 0))
                else:
                    builder.add(item)
        return builder.finish(status, duration)

    async def interrupt(self) -> None:
        self.info = await self._client.call(self._calls.interrupt(self.sandbox_id, self.id))

    async def restart(self) -> None:
        self.info = await self._client.call(self._calls.restart(self.sandbox_id, self.id))

    async def refresh(self) -> ContextInfo:
        self.info = await self._client.call(self._calls.get(self.sandbox_id, self.id))
        return self.info

    async def delete(self) -> None:
        await self._client.call(self._calls.delete(self.sandbox_id, self.id))


class AsyncContexts:
    """``sb.contexts`` of an ``AsyncSandbox``; see :class:`Contexts`."""

    def __init__(self, client: AsyncClient, sandbox_id: str) -> None:
        self._client = client
        self._calls = InterpreterCalls(client.core)
        self._id = sandbox_id
        self._default: AsyncContext | None = None

    async def create(
        self, language: str = "python", *, cwd: str | None = None, env: dict[str, str] | None = None
    ) -> AsyncContext:
        info = await self._client.call(self._calls.create(self._id, language, cwd, env))
        return AsyncContext(self._client, self._id, info)

    async def list(self) -> builtins.list[AsyncContext]:
        infos = await self._client.call(self._calls.list(self._id))
        return [AsyncContext(self._client, self._id, info) for info in infos]

    async def get(self, context_id: str) -> AsyncContext:
        info = await self._client.call(self._calls.get(self._id, context_id))
        return AsyncContext(self._client, self._id, info)

    async def default(self) -> AsyncContext:
        if self._default is None:
            self._default = await self.create()
        return self._default


class AsyncCodeRunner:
    """Mixed into :class:`hutch.AsyncSandbox`: ``await sb.run_code(code)``."""

    contexts: AsyncContexts
    _client: AsyncClient

    @property
    def id(self) -> str:
        raise NotImplementedError

    async def run_code(
        self,
        code: str,
        context: str | AsyncContext | None = None,
        *,
        timeout_s: float | None = None,
        on_stdout: TextCallback | None = None,
        on_stderr: TextCallback | None = None,
        on_result: ResultCallback | None = None,
    ) -> Execution:
        cid = _context_id(context)
        if cid is None:
            ctx = await self.contexts.default()
        else:
            ctx = AsyncContext(
                self._client, self.id, ContextInfo(cid, "python", "", "idle", None, None, 0)
            )
        return await ctx.run(
            code,
            timeout_s=timeout_s,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            on_result=on_result,
        )
