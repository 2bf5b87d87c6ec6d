"""Values the agent client returns, and the hutch error for an agent ERROR frame (the codes
are the contract's: :mod:`hutch.contract.agent_codes`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from hutch.contract.agent_codes import agent_error
from hutch.errors import GuestError, HutchError

__all__ = [
    "AgentInfo",
    "ExecExit",
    "ExecOutput",
    "ExecResult",
    "FileEntry",
    "error_from_wire",
]


@dataclass(frozen=True)
class AgentInfo:
    """What the agent said in its hello reply."""

    protocol: tuple[int, int]
    agent_version: str
    kernel_release: str
    hostname: str
    pid: int


@dataclass(frozen=True)
class FileEntry:
    """A file in the guest. ``mode`` holds the permission bits; ``mtime`` is epoch seconds."""

    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float

    @classmethod
    def from_wire(cls, data: Any) -> FileEntry:
        try:
            return cls(
                name=str(data["name"]),
                path=str(data["path"]),
                type=data["type"],
                size=int(data["size"]),
                mode=int(data["mode"]),
                mtime=float(data["mtime"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise GuestError(f"the guest agent sent a malformed file entry: {data!r}") from exc


@dataclass(frozen=True)
class ExecOutput:
    stream: Literal["stdout", "stderr"]
    data: bytes


@dataclass(frozen=True)
class ExecExit:
    """How a command ended: ``exit_code`` when it exited, ``signal`` when it was killed.

    ``timed_out`` means hutch killed it at its ``timeout_s``; ``duration_ms`` is wall time
    measured in the guest from start to exit.
    """

    exit_code: int | None
    signal: int | None
    timed_out: bool
    duration_ms: int

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> ExecExit:
        try:
            return cls(
                exit_code=None if data.get("exit_code") is None else int(data["exit_code"]),
                signal=None if data.get("signal") is None else int(data["signal"]),
                timed_out=bool(data.get("timed_out", False)),
                duration_ms=int(data.get("duration_ms", 0)),
            )
        except (TypeError, ValueError) as exc:
            raise GuestError(f"the guest agent sent a malformed exit: {data!r}") from exc


@dataclass(frozen=True)
class ExecResult:
    stdout: bytes
    stderr: bytes
    exit_code: int | None
    signal: int | None
    timed_out: bool
    duration_ms: int

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def error_from_wire(header: dict[str, Any], feature: str | None = None) -> HutchError:
    """The hutch error for an agent ERROR frame (unknown codes become GuestError);
    ``feature``: see :func:`hutch.contract.agent_codes.agent_error`."""
    code = str(header.get("code", "internal"))
    message = str(header.get("message", "no message"))
    return agent_error(code, message, feature)
