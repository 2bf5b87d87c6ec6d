"""Code interpreter: stateful Python contexts in a sandbox (the guest side is
``hutch_agent.kernel``; the wire side is :mod:`hutch.guest.contexts`).

Every call resumes a paused sandbox first when it has ``auto_resume``; a run counts as
activity (no auto-pause while code runs).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

from hutch.errors import InvalidArgument, NotFound
from hutch.guest.contexts import (
    ContextInfo,
    ContextRun,
    RunEnd,
    create_context,
    delete_context,
    interrupt_context,
    list_contexts,
    restart_context,
    start_run,
)
from hutch.services.activity import Lease
from hutch.services.guest_ops import GuestOps
from hutch.services.image_defaults import merged

__all__ = ["CodeRun", "ContextInfo", "InterpreterService", "RunEnd"]

CONTEXT_ID_RE = re.compile(r"^ctx-[0-9a-f]{12}$")


class CodeRun:
    """A run in progress (:class:`~hutch.guest.contexts.ContextRun`) that holds its
    lease until its outputs end, it fails, or it is closed. Iterate :meth:`outputs`;
    :attr:`end` is set after the last."""

    def __init__(self, run: ContextRun, lease: Lease) -> None:
        self._run = run
        self._lease = lease

    @property
    def end(self) -> RunEnd | None:
        return self._run.end

    async def outputs(self) -> AsyncIterator[dict[str, Any]]:
        try:
            async for item in self._run.outputs():
                yield item
        finally:
            self._lease.release()

    def close(self) -> None:
        """Give up on the run (the guest interrupts the code if it still runs) and
        release its lease. Idempotent."""
        self._run.close()
        self._lease.release()


class InterpreterService:
    def __init__(self, guest: GuestOps) -> None:
        self.guest = guest

    def _check_id(self, sandbox_id: str, context_id: str) -> None:
        if not CONTEXT_ID_RE.match(context_id):
            raise NotFound(self._unknown(sandbox_id, context_id))

    @staticmethod
    def _unknown(sandbox_id: str, context_id: str) -> str:
        return (
            f"no context {context_id!r} in sandbox {sandbox_id} (context ids look like "
            f"ctx-0123456789ab); list them with GET /v1/sandboxes/{sandbox_id}/contexts "
            "or create one with POST to the same path"
        )

    async def _agent_call(self, sandbox_id: str, context_id: str | None, call: Any) -> Any:
        try:
            return await call
        except NotFound as exc:
            if context_id is not None and "context" in exc.message:
                raise NotFound(self._unknown(sandbox_id, context_id)) from exc
            raise

    async def create(
        self,
        sandbox_id: str,
        *,
        language: str = "python",
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ContextInfo:
        rec = self.guest.get(sandbox_id)
        runtime = await self.guest.ready(sandbox_id)
        env, cwd, _ = merged(
            self.guest.guest_defaults(rec), rec, env, cwd, None, self.guest.secret_env(rec)
        )
        try:
            return await create_context(runtime.agent, language=language, cwd=cwd, env=env)
        except InvalidArgument as exc:
            if "python3" not in exc.message:
                raise
            raise InvalidArgument(
                f"image {rec.image!r} has no python3 on its PATH, and the code interpreter "
                "runs the image's own Python (the user's packages live there); use an "
                f"image with Python 3 ({exc.message})"
            ) from exc

    async def list(self, sandbox_id: str) -> list[ContextInfo]:
        runtime = await self.guest.ready(sandbox_id)
        return await list_contexts(runtime.agent)

    async def get(self, sandbox_id: str, context_id: str) -> ContextInfo:
        self._check_id(sandbox_id, context_id)
        for ctx in await self.list(sandbox_id):
            if ctx.id == context_id:
                return ctx
        raise NotFound(self._unknown(sandbox_id, context_id))

    async def delete(self, sandbox_id: str, context_id: str) -> None:
        self._check_id(sandbox_id, context_id)
        runtime = await self.guest.ready(sandbox_id)
        await self._agent_call(sandbox_id, context_id, delete_context(runtime.agent, context_id))

    async def interrupt(self, sandbox_id: str, context_id: str) -> ContextInfo:
        self._check_id(sandbox_id, context_id)
        runtime = await self.guest.ready(sandbox_id)
        await self._agent_call(sandbox_id, context_id, interrupt_context(runtime.agent, context_id))
        return await self.get(sandbox_id, context_id)

    async def restart(self, sandbox_id: str, context_id: str) -> ContextInfo:
        self._check_id(sandbox_id, context_id)
        runtime = await self.guest.ready(sandbox_id)
        info: ContextInfo = await self._agent_call(
            sandbox_id, context_id, restart_context(runtime.agent, context_id)
        )
        return info

    async def run(
        self,
        sandbox_id: str,
        context_id: str,
        code: str,
        *,
        timeout_s: float | None = None,
    ) -> CodeRun:
        """Start running ``code``; iterate the run's outputs. The run is in flight (and
        activity) until its outputs end or it is closed."""
        lease = self.guest.activity.work(sandbox_id, f"code run in {context_id}")
        try:
            self._check_id(sandbox_id, context_id)
            if not isinstance(code, str):
                raise InvalidArgument("code must be a string of Python source")
            runtime = await self.guest.ready(sandbox_id, lease)
            run: ContextRun = await self._agent_call(
                sandbox_id,
                context_id,
                start_run(runtime.agent, context_id, code, timeout_s=timeout_s),
            )
        except BaseException:
            lease.release()
            raise
        return CodeRun(run, lease)
