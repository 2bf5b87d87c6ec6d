# Generated from src/hutch/sdk/_async/contexts.py by scripts/unasync.py: do not edit.
"""The code-interpreter shells: ``sb.contexts`` and the ``Context`` handles it gives.
Requests are built and answers read by :class:`InterpreterCalls`."""

from __future__ import annotations

import builtins

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
from hutch.sdk._sync.client import Client, ResponseStream

__all__ = ["Context", "Contexts", "run_code"]


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
            call = self._calls.run(self.sandbox_id, self.id, code, timeout_s)
            return self._client.call(call)
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


def run_code(
    contexts: Contexts,
    code: str,
    context: str | Context | None = None,
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
        ctx = contexts.default()
    else:
        idle = ContextInfo(cid, "python", "", "idle", None, None, 0)
        ctx = Context(contexts._client, contexts._id, idle)
    return ctx.run(
        code, timeout_s=timeout_s, on_stdout=on_stdout, on_stderr=on_stderr, on_result=on_result
    )
