"""The code-interpreter shells: ``sb.contexts`` and the ``Context`` handles it gives.
Requests are built and answers read by :class:`InterpreterCalls`."""

from __future__ import annotations

import builtins

from hutch.sdk._async.client import AsyncClient, AsyncResponseStream
from hutch.sdk._contexts import (
    ContextInfo,
    Execution,
    ExecutionBuilder,
    InterpreterCalls,
    ResultCallback,
    RunDecoder,
    TextCallback,
    context_id,
)

__all__ = ["AsyncContext", "AsyncContexts", "run_code"]


class AsyncContext:
    """One Python context (``sb.contexts.create()``): ``ctx.run("x = 1")``."""

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
        """Run ``code``; variables persist for the next run. An exception in the code is
        ``execution.error`` (not raised). With callbacks, outputs stream into them."""
        if on_stdout is None and on_stderr is None and on_result is None:
            call = self._calls.run(self.sandbox_id, self.id, code, timeout_s)
            return await self._client.call(call)
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
        """Stop the running code (KeyboardInterrupt); variables are kept."""
        self.info = await self._client.call(self._calls.interrupt(self.sandbox_id, self.id))

    async def restart(self) -> None:
        """A fresh interpreter: every variable is gone."""
        self.info = await self._client.call(self._calls.restart(self.sandbox_id, self.id))

    async def refresh(self) -> ContextInfo:
        self.info = await self._client.call(self._calls.get(self.sandbox_id, self.id))
        return self.info

    async def delete(self) -> None:
        await self._client.call(self._calls.delete(self.sandbox_id, self.id))


class AsyncContexts:
    """``sb.contexts``: the sandbox's Python contexts."""

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
        """``NotFound`` if there is no such context."""
        info = await self._client.call(self._calls.get(self._id, context_id))
        return AsyncContext(self._client, self._id, info)

    async def default(self) -> AsyncContext:
        """The context ``sb.run_code`` uses when given none (created on first use)."""
        if self._default is None:
            self._default = await self.create()
        return self._default


async def run_code(
    contexts: AsyncContexts,
    code: str,
    context: str | AsyncContext | None = None,
    *,
    timeout_s: float | None = None,
    on_stdout: TextCallback | None = None,
    on_stderr: TextCallback | None = None,
    on_result: ResultCallback | None = None,
) -> Execution:
    """``sb.run_code``: run ``code`` in ``context`` (a context or its id; default: the
    handle's default context, so variables persist between calls)."""
    cid = context_id(context)
    if cid is None:
        ctx = await contexts.default()
    else:
        idle = ContextInfo(cid, "python", "", "idle", None, None, 0)
        ctx = AsyncContext(contexts._client, contexts._id, idle)
    return await ctx.run(
        code, timeout_s=timeout_s, on_stdout=on_stdout, on_stderr=on_stderr, on_result=on_result
    )
