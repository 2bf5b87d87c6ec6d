"""The code interpreter in the SDK: ``sb.contexts``, ``ctx.run(code)``, ``sb.run_code``.

One sans-IO core (:class:`InterpreterCalls` builds requests and reads answers,
:class:`RunDecoder` reads streamed runs, :class:`ExecutionBuilder` turns outputs into
an :class:`Execution`) and two thin shells (blocking and asyncio) that only send.
"""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx

from hutch.errors import InvalidArgument
from hutch.sdk._core import Call, ClientCore, _json, _list_of, _nothing
from hutch.sdk._interpreter_types import (
    ContextInfo,
    Execution,
    ExecutionBuilder,
    ExecutionError,
    Result,
    ResultCallback,
    RunDecoder,
    TextCallback,
)

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
