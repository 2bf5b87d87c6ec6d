"""hutch: self-hosted micro-VM sandboxes for code written by AI agents.

``from hutch import Sandbox, AsyncSandbox`` is the client API (see :mod:`hutch.sdk`).
The SDK is imported on first use (PEP 562 ``__getattr__``), so the daemon's own modules,
which import ``hutch.config`` and friends, do not pay for httpx at startup.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hutch.errors import (
    AgentVersionMismatch,
    BlobError,
    BuildFailed,
    Busy,
    Capacity,
    Conflict,
    Forbidden,
    GuestError,
    HutchError,
    ImageBuildError,
    ImageMismatch,
    ImageMissing,
    InvalidArgument,
    InvalidDockerfile,
    InvalidImage,
    NetworkError,
    NotFound,
    QuotaExceeded,
    RegistryError,
    SecretError,
    SnapshotError,
    StateError,
    StoreError,
    Timeout,
    Unauthorized,
    Unavailable,
    UnknownImage,
    VmError,
)
from hutch.version import __version__

if TYPE_CHECKING:
    from hutch.sdk import (
        ApiKeyMissing,
        AsyncSandbox,
        DaemonUnreachable,
        ExecExit,
        ExecOutput,
        ExecResult,
        FileEntry,
        ProtocolError,
        Sandbox,
        SandboxInfo,
        SnapshotInfo,
    )

__all__ = [
    "AgentVersionMismatch",
    "ApiKeyMissing",
    "AsyncSandbox",
    "BlobError",
    "BuildFailed",
    "Busy",
    "Capacity",
    "Conflict",
    "DaemonUnreachable",
    "ExecExit",
    "ExecOutput",
    "ExecResult",
    "FileEntry",
    "Forbidden",
    "GuestError",
    "HutchError",
    "ImageBuildError",
    "ImageMismatch",
    "ImageMissing",
    "InvalidArgument",
    "InvalidDockerfile",
    "InvalidImage",
    "NetworkError",
    "NotFound",
    "ProtocolError",
    "QuotaExceeded",
    "RegistryError",
    "Sandbox",
    "SandboxInfo",
    "SecretError",
    "SnapshotError",
    "SnapshotInfo",
    "StateError",
    "StoreError",
    "Timeout",
    "Unauthorized",
    "Unavailable",
    "UnknownImage",
    "VmError",
    "__version__",
]

_FROM_SDK = frozenset(
    {
        "ApiKeyMissing",
        "AsyncSandbox",
        "DaemonUnreachable",
        "ExecExit",
        "ExecOutput",
        "ExecResult",
        "FileEntry",
        "ProtocolError",
        "Sandbox",
        "SandboxInfo",
        "SnapshotInfo",
    }
)


def __getattr__(name: str) -> Any:
    if name in _FROM_SDK:
        value = getattr(importlib.import_module("hutch.sdk"), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'hutch' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _FROM_SDK)
