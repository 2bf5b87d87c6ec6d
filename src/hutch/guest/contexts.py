"""Code-interpreter contexts over the agent's ``ctx_*`` operations.

A context is a long-lived Python process in the guest (``hutch_agent.kernel``) whose
variables persist between runs. It belongs to the agent, not to this connection: it
survives a daemon restart.

Outputs of a run, in the order they were produced, are plain dicts::

    {"type": "stdout"|"stderr", "text": str}
    {"type": "display"|"result", "data": {mime: value}}   image/png etc. base64
    {"type": "error", "ename": str, "evalue": str, "traceback": [str]}
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from hutch.errors import GuestError, InvalidArgument
from hutch.guest._lines import JsonLines, failure
from hutch.guest._stream import StreamState
from hutch.guest.client import AgentClient
from hutch.guest.paths import normalize_guest_path
from hutch.guest.protocol import FrameType

__all__ = [
    "OUTPUT_TYPES",
    "ContextInfo",
    "ContextRun",
    "RunEnd",
    "create_context",
    "delete_context",
    "interrupt_context",
    "list_contexts",
    "restart_context",
    "start_run",
]

OUTPUT_TYPES = ("stdout", "stderr", "display", "result", "error")
LANGUAGES = ("python",)


@dataclass(frozen=True)
class ContextInfo:
    id: str
    language: str
    cwd: str
    pid: int | None
    state: str  # idle | busy | dead
    created_at: float
    runs: int

    @classmethod
    def from_wire(cls, data: Any) -> ContextInfo:
        try:
            return cls(
                id=str(data["id"]),
                language=str(data["language"]),
                cwd=str(data["cwd"]),
                pid=None if data.get("pid") is None else int(data["pid"]),
                state=str(data["state"]),
                created_at=float(data["created_at"]),
                runs=int(data.get("runs", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise GuestError(f"the guest agent sent a malformed context: {data!r}") from exc


@dataclass(frozen=True)
class RunEnd:
    status: str  # ok | error | interrupted | timeout
    duration_ms: int


def _check_output(item: dict[str, Any]) -> dict[str, Any]:
    if item.get("type") not in OUTPUT_TYPES:
        raise GuestError(f"the guest agent sent an unknown output: {str(item)[:200]}")
    return item


class ContextRun:
    """A run in progress: iterate :meth:`outputs`; :attr:`end` is set after the last."""

    def __init__(self, agent: AgentClient, state: StreamState) -> None:
        self._agent = agent
        self._state = state
        self.end: RunEnd | None = None

    async def outputs(self) -> AsyncIterator[dict[str, Any]]:
        lines = JsonLines("run output")
        try:
            while True:
                frame = await self._state.next()
                if frame.type is FrameType.DATA:
                    for item in lines.feed(frame.payload):
                        yield _check_output(item)
                elif frame.type is FrameType.END:
                    self.end = RunEnd(
                        str(frame.header.get("status", "ok")),
                        int(frame.header.get("duration_ms", 0)),
                    )
                    return
                else:
                    raise failure(self._state, frame)
        finally:
            self.close()

    def close(self) -> None:
        """Give up on the run: the guest interrupts the code. Idempotent."""
        self._agent.close_stream(self._state)


async def _call(agent: AgentClient, header: dict[str, Any]) -> dict[str, Any]:
    state = await agent.open_stream(header)
    try:
        frame = await state.next()
        if frame.type is not FrameType.END:
            raise failure(state, frame)
        return frame.header
    finally:
        agent.close_stream(state)


async def create_context(
    agent: AgentClient,
    *,
    language: str = "python",
    cwd: str | None = None,
    env: dict[str, str] | None = None,
) -> ContextInfo:
    if language not in LANGUAGES:
        raise InvalidArgument(
            f"language {language!r} is not supported; supported: {', '.join(LANGUAGES)}"
        )
    header: dict[str, Any] = {"op": "ctx_create", "language": language, "env": dict(env or {})}
    if cwd is not None:
        header["cwd"] = normalize_guest_path(cwd)
    reply = await _call(agent, header)
    return ContextInfo.from_wire(reply.get("context"))


async def list_contexts(agent: AgentClient) -> list[ContextInfo]:
    reply = await _call(agent, {"op": "ctx_list"})
    return [ContextInfo.from_wire(c) for c in reply.get("contexts", [])]


async def delete_context(agent: AgentClient, context_id: str) -> None:
    await _call(agent, {"op": "ctx_delete", "id": context_id})


async def interrupt_context(agent: AgentClient, context_id: str) -> None:
    await _call(agent, {"op": "ctx_interrupt", "id": context_id})


async def restart_context(agent: AgentClient, context_id: str) -> ContextInfo:
    reply = await _call(agent, {"op": "ctx_restart", "id": context_id})
    return ContextInfo.from_wire(reply.get("context"))


async def start_run(
    agent: AgentClient, context_id: str, code: str, *, timeout_s: float | None = None
) -> ContextRun:
    """Queue ``code`` in the context; returns once the guest accepted it (NotFound for
    an unknown context surfaces here, before any output)."""
    header: dict[str, Any] = {"op": "ctx_run", "id": context_id, "code": code}
    if timeout_s is not None:
        if timeout_s <= 0:
            raise InvalidArgument(f"timeout_s={timeout_s!r}; give a positive number")
        header["timeout_s"] = timeout_s
    state = await agent.open_stream(header)
    try:
        frame = await state.next()
        if frame.type is not FrameType.REPLY:
            raise failure(state, frame)
    except BaseException:
        agent.close_stream(state)
        raise
    return ContextRun(agent, state)
