# Generated from src/hutch/sdk/_async/processes.py by scripts/unasync.py: do not edit.
"""The background-process shells: ``sb.processes`` and the ``Process`` handles it gives.
Requests are built and answers read by :class:`ProcessCalls`.

A background process has no deadline unless given one, keeps running while nobody
watches (and across a memory pause), and keeps its newest 2 MiB of output (stdout and
stderr together) for ``output()`` / ``stream()`` to fetch by offset.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Unpack

from hutch.sdk._exec import CommandArgs
from hutch.sdk._processes import (
    ProcessCalls,
    ProcessEvent,
    ProcessEventDecoder,
    ProcessInfo,
    ProcessOutput,
    SignalArg,
)
from hutch.sdk._sync.client import Client, ResponseStream

__all__ = ["Process", "Processes"]


class Process:
    """A background process in a sandbox (``sb.processes.start(...)``)."""

    def __init__(self, client: Client, sandbox_id: str, info: ProcessInfo) -> None:
        self._client = client
        self._calls = ProcessCalls(client.core)
        self._sandbox_id = sandbox_id
        self._info = info

    @property
    def pid(self) -> int:
        return self._info.pid

    @property
    def info(self) -> ProcessInfo:
        """What the daemon said last; :meth:`refresh` asks again."""
        return self._info

    def _keep(self, info: ProcessInfo) -> ProcessInfo:
        self._info = info
        return info

    def refresh(self) -> ProcessInfo:
        return self._keep(self._client.call(self._calls.get(self._sandbox_id, self.pid)))

    def output(self, offset: int = 0) -> ProcessOutput:
        """What is buffered from ``offset`` on (stdout and stderr apart)."""
        out = self._client.call(self._calls.output(self._sandbox_id, self.pid, offset))
        self._info = out.process
        return out

    def stream(self, offset: int = 0) -> ResponseStream[ProcessEvent]:
        """Output from ``offset``, live until the process exits (the last event is a
        :class:`ProcessEnd`). Use ``with`` or ``close()`` to stop early."""
        request = self._calls.follow_request(self._sandbox_id, self.pid, offset)
        return ResponseStream(self._client, request, ProcessEventDecoder())

    def write_stdin(self, data: str | bytes, eof: bool = False) -> ProcessInfo:
        """Write to its stdin (it must have been started with ``keep_stdin=True``)."""
        call = self._calls.write_stdin(self._sandbox_id, self.pid, data, eof)
        return self._keep(self._client.call(call))

    def close_stdin(self) -> ProcessInfo:
        return self.write_stdin(b"", eof=True)

    def signal(self, sig: SignalArg) -> ProcessInfo:
        """Signal its process group. ``Conflict`` if it has already exited."""
        call = self._calls.signal(self._sandbox_id, self.pid, sig)
        return self._keep(self._client.call(call))

    def kill(self) -> ProcessInfo:
        """SIGKILL its process group; returns it exited (a no-op if it already was)."""
        return self._keep(self._client.call(self._calls.kill(self._sandbox_id, self.pid)))

    def wait(self, timeout_s: float | None = None) -> ProcessInfo:
        """Wait for the exit; after ``timeout_s`` it comes back still running."""
        call = self._calls.wait(self._sandbox_id, self.pid, timeout_s)
        return self._keep(self._client.call(call))

    def __repr__(self) -> str:
        info = self._info
        return f"{type(self).__name__}(pid={self.pid}, state={info.state!r}, argv={info.argv!r})"


class Processes:
    """``sb.processes``: commands running detached in the sandbox."""

    def __init__(self, client: Client, sandbox_id: str) -> None:
        self._client = client
        self._calls = ProcessCalls(client.core)
        self._id = sandbox_id

    def start(
        self,
        cmd: str | Sequence[str],
        *,
        keep_stdin: bool = False,
        **options: Unpack[CommandArgs],
    ) -> Process:
        """Start ``cmd`` (a string runs with /bin/sh -c) and return at once. ``stdin`` is
        written first; ``keep_stdin`` keeps the pipe open for ``write_stdin``. The other
        options are those of ``exec`` (``env``, ``cwd``, ``user``, ``timeout_s``)."""
        call = self._calls.start(self._id, cmd, options, keep_stdin=keep_stdin)
        return Process(self._client, self._id, self._client.call(call))

    def list(self) -> builtins.list[Process]:
        infos = self._client.call(self._calls.list(self._id))
        return [Process(self._client, self._id, info) for info in infos]

    def get(self, pid: int) -> Process:
        """``NotFound`` if the sandbox has no such background process."""
        info = self._client.call(self._calls.get(self._id, pid))
        return Process(self._client, self._id, info)
