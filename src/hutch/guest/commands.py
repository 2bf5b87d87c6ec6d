"""Commands in the guest: the request header of a command, :class:`ExecStream` (a running
command's output and exit) and the ``exec``/``run`` operations of the client."""

from __future__ import annotations

import asyncio
import contextlib
import signal as _signal
from collections.abc import AsyncIterable, AsyncIterator, Awaitable
from typing import Any, TypeVar

from hutch.errors import InvalidArgument, Timeout
from hutch.guest._stream import StreamState
from hutch.guest.connection import AgentConnection
from hutch.guest.paths import normalize_guest_path
from hutch.guest.protocol import CHANNEL_DATA, CHANNEL_STDERR, FrameType
from hutch.guest.results import ExecExit, ExecOutput, ExecResult

T = TypeVar("T")


#: Seconds the host waits past a command's ``timeout_s`` for the agent to report its end
#: (the agent kills it at ``timeout_s``; its report is quick even under TCG). Past that
#: the guest is not answering for that command (stalled, overloaded, or hostile): the
#: call ends with ``Timeout`` instead of holding its caller, and its lease, for ever.
HOST_GRACE_S = 30.0


def program_fields(
    argv: list[str] | None,
    shell: str | None,
    env: dict[str, str] | None,
    cwd: str | None,
    user: str | int | None,
) -> dict[str, Any]:
    """The header fields saying what to run and how, for a command or a terminal: those
    given of ``argv`` (checked: a non-empty list of strings), ``shell``, ``env``, ``cwd``
    (normalized) and ``user``. Whether both or neither of argv and shell may be given is
    the caller's rule. Raises InvalidArgument naming what is wrong."""
    fields: dict[str, Any] = {}
    if argv is not None:
        if not argv or not all(isinstance(a, str) for a in argv):
            raise InvalidArgument(f"argv must be a non-empty list of strings, not {argv!r}")
        fields["argv"] = list(argv)
    if shell is not None:
        fields["shell"] = shell
    if env:
        fields["env"] = dict(env)
    if cwd is not None:
        fields["cwd"] = normalize_guest_path(cwd)
    if user is not None:
        fields["user"] = user
    return fields


def command_header(
    op: str,
    argv: list[str] | None,
    shell: str | None,
    env: dict[str, str] | None,
    cwd: str | None,
    user: str | int | None,
    timeout_s: float | None,
    *,
    stdin: bool,
) -> dict[str, Any]:
    """The request header of a command (``exec``, ``proc_start``): exactly one of ``argv``
    (run directly) or ``shell`` (``/bin/sh -c``). Raises InvalidArgument naming what is
    wrong."""
    if (argv is None) == (shell is None):
        raise InvalidArgument("give exactly one of argv (a list) or shell (a string)")
    header: dict[str, Any] = {
        "op": op,
        "stdin": stdin,
        **program_fields(argv, shell, env, cwd, user),
    }
    if timeout_s is not None:
        if timeout_s <= 0:
            raise InvalidArgument(f"timeout_s={timeout_s!r}; give a positive number")
        header["timeout_s"] = timeout_s
    return header


class ExecStream:
    """A running command. Iterate it for output; ``wait()`` or ``collect()`` for the end.

    Output arrives in the order the agent read it from the pipes. ``wait()`` discards
    output nobody iterated; ``collect()`` keeps it. Either may be called after iterating.
    """

    def __init__(
        self,
        client: AgentConnection,
        state: StreamState,
        pid: int,
        deadline: float | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """``deadline`` (loop time): when the host stops waiting for the agent's report
        of the command's end (``timeout_s`` + :data:`HOST_GRACE_S`); None: never."""
        self._client = client
        self._state = state
        self.pid = pid
        self._exit: ExecExit | None = None
        self._stdin_task: asyncio.Task[None] | None = None
        self._deadline = deadline
        self._timeout_s = timeout_s

    @property
    def exit(self) -> ExecExit | None:
        """How the command ended, once its exit arrived (None before)."""
        return self._exit

    def __aiter__(self) -> AsyncIterator[ExecOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[ExecOutput]:
        while self._exit is None:
            item = await self._next()
            if item is not None:
                yield item

    async def _next(self) -> ExecOutput | None:
        """One output chunk, or None once the exit arrived. ``Timeout`` once the host's
        deadline passed without the agent's report (the stream is given up)."""
        try:
            frame = await _before(self._deadline, self._state.next())
        except TimeoutError:
            await self._give_up()
            raise Timeout(_unanswered(self._timeout_s, "the end")) from None
        except BaseException:
            await self._finish_stdin()
            raise
        if frame.type is FrameType.DATA:
            if frame.channel == CHANNEL_STDERR:
                return ExecOutput("stderr", frame.payload)
            return ExecOutput("stdout", frame.payload)
        self._client._forget(self._state)
        await self._finish_stdin()
        if frame.type is FrameType.END:
            self._exit = ExecExit.from_wire(frame.header)
            return None
        raise self._state.unexpected(frame)

    async def _finish_stdin(self) -> None:
        task, self._stdin_task = self._stdin_task, None
        if task is None:
            return
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # re-raises an error of the caller's stdin iterable

    async def wait(self) -> ExecExit:
        """Wait for the exit, discarding output not yet iterated."""
        while self._exit is None:
            await self._next()
        return self._exit

    async def collect(self) -> ExecResult:
        """Wait for the exit and return all output not yet iterated."""
        out: list[bytes] = []
        err: list[bytes] = []
        while self._exit is None:
            item = await self._next()
            if item is not None:
                (out if item.stream == "stdout" else err).append(item.data)
        e = self._exit
        return ExecResult(
            b"".join(out), b"".join(err), e.exit_code, e.signal, e.timed_out, e.duration_ms
        )

    async def signal(self, signum: int) -> None:
        """Send ``signum`` to the command's process group. NotFound if it has exited."""
        await self._client._request(
            {"op": "signal", "target": self._state.sid, "signal": int(signum)}
        )

    async def kill(self) -> None:
        """SIGKILL the command's process group."""
        await self.signal(_signal.SIGKILL)

    async def detach(self) -> None:
        """Stop receiving output; the command keeps running to its end or timeout."""
        self._client._forget(self._state)
        await self._finish_stdin()

    async def _give_up(self) -> None:
        """The agent did not report the end in time: stop listening, and ask it once
        more (briefly) to kill the command, in case it only lost the kill."""
        await self.detach()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.kill(), 2.0)


async def _before(deadline: float | None, step: Awaitable[T]) -> T:
    """``step``, or TimeoutError once loop time ``deadline`` has passed (None: no bound)."""
    if deadline is None:
        return await step
    async with asyncio.timeout_at(deadline):
        return await step


def _unanswered(timeout_s: float | None, what: str) -> str:
    return (
        f"the guest agent did not report {what} of a command (timeout_s={timeout_s}) within "
        f"{HOST_GRACE_S:g} s after that timeout; the host stopped waiting (the guest is "
        "stalled or overloaded, or its agent is not answering); the command may still run "
        "in the guest"
    )


class CommandOps(AgentConnection):
    """Running commands: :meth:`exec` (streamed) and :meth:`run` (collected)."""

    async def exec(
        self,
        argv: list[str] | None = None,
        *,
        shell: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: bytes | AsyncIterable[bytes] | None = None,
        timeout_s: float | None = None,
    ) -> ExecStream:
        """Start a command; return once the agent has started it.

        Give ``argv`` (run directly) or ``shell`` (``/bin/sh -c``). ``env`` is merged
        over PATH/HOME/LANG/TERM defaults; ``cwd`` defaults to /root; ``user`` is a name
        or uid (default root). Without ``stdin`` the command reads /dev/null. After
        ``timeout_s`` seconds its process group is killed and the exit says timed_out.
        Raises InvalidArgument (e.g. command not found), NotFound (missing cwd).
        """
        header = command_header(
            "exec", argv, shell, env, cwd, user, timeout_s, stdin=stdin is not None
        )
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s + HOST_GRACE_S
        state = await self._start(header)
        try:
            frame = await _before(deadline, state.next())
            if frame.type is not FrameType.REPLY or frame.header.get("event") != "started":
                raise state.unexpected(frame)
        except TimeoutError:
            self._forget(state)
            raise Timeout(_unanswered(timeout_s, "the start")) from None
        except BaseException:
            self._forget(state)
            raise
        stream = ExecStream(self, state, int(frame.header.get("pid", 0)), deadline, timeout_s)
        if stdin is not None:
            stream._stdin_task = asyncio.create_task(state.upload(stdin, CHANNEL_DATA))
        return stream

    async def run(
        self,
        argv: list[str] | None = None,
        *,
        shell: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: bytes | AsyncIterable[bytes] | None = None,
        timeout_s: float | None = None,
    ) -> ExecResult:
        """:meth:`exec` and collect all output."""
        stream = await self.exec(
            argv, shell=shell, env=env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s
        )
        return await stream.collect()
