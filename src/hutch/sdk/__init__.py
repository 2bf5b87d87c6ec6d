"""hutch's Python SDK: ``Sandbox`` / ``AsyncSandbox`` handles over the REST API v1.

Layout (after httpx): ``_core`` builds requests and reads answers without I/O;
``_client``/``_async_client`` send them (sync/asyncio); ``_sandbox``/``_async_sandbox``
are the E2B-style handles on top (create, exec, files, pause/resume/fork, named
snapshots, kill).
Configuration: ``_config`` (URL, key, timeouts).
"""

from __future__ import annotations

from hutch.models import PauseMode
from hutch.sdk._async_client import AsyncClient, AsyncResponseStream
from hutch.sdk._async_sandbox import AsyncFiles, AsyncSandbox
from hutch.sdk._client import Client, ResponseStream
from hutch.sdk._config import DEFAULT_URL, Timeouts
from hutch.sdk._errors import ApiKeyMissing, ClientClosed, DaemonUnreachable, ProtocolError
from hutch.sdk._sandbox import Files, Sandbox
from hutch.sdk._types import (
    ExecEvent,
    ExecExit,
    ExecOutput,
    ExecResult,
    FileEntry,
    Health,
    ImageInfo,
    PauseModeArg,
    SandboxInfo,
    SnapshotInfo,
    WrittenFile,
)
from hutch.version import __version__

__all__ = [
    "DEFAULT_URL",
    "ApiKeyMissing",
    "AsyncClient",
    "AsyncFiles",
    "AsyncResponseStream",
    "AsyncSandbox",
    "Client",
    "ClientClosed",
    "DaemonUnreachable",
    "ExecEvent",
    "ExecExit",
    "ExecOutput",
    "ExecResult",
    "FileEntry",
    "Files",
    "Health",
    "ImageInfo",
    "PauseMode",
    "PauseModeArg",
    "ProtocolError",
    "ResponseStream",
    "Sandbox",
    "SandboxInfo",
    "SnapshotInfo",
    "Timeouts",
    "WrittenFile",
    "__version__",
]
