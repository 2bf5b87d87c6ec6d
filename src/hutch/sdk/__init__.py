"""hutch's Python SDK: ``Sandbox`` / ``AsyncSandbox`` handles over the REST API v1.

Layout (after httpx): ``_core`` builds requests and reads answers without I/O;
``_client``/``_async_client`` send them (sync/asyncio); ``_sandbox``/``_async_sandbox``
are the E2B-style handles on top (create, exec, files, pause/resume/fork, named
snapshots, kill); ``_net`` adds egress rules, exposed ports and private networks
(``sb.egress``, ``sb.ports``, ``sb.networks``, ``client.networks``).
``_processes`` runs commands detached (``sb.processes``) and ``_pty`` opens interactive
terminals over a WebSocket (``sb.pty``).
Configuration: ``_config`` (URL, key, timeouts).
"""

from __future__ import annotations

from hutch.models import PauseMode
from hutch.sdk._async_client import AsyncClient, AsyncResponseStream
from hutch.sdk._async_sandbox import AsyncFiles, AsyncSandbox
from hutch.sdk._client import Client, ResponseStream
from hutch.sdk._config import DEFAULT_URL, Timeouts
from hutch.sdk._errors import ApiKeyMissing, ClientClosed, DaemonUnreachable, ProtocolError
from hutch.sdk._files_extra import ArchiveWritten, AsyncFileWatcher, FileWatcher, WatchEvent
from hutch.sdk._images import ImageProgress
from hutch.sdk._interpreter import (
    AsyncContext,
    AsyncContexts,
    Context,
    ContextInfo,
    Contexts,
    Execution,
    ExecutionError,
    Result,
)
from hutch.sdk._net import (
    AsyncEgress,
    AsyncNetworks,
    AsyncPorts,
    AsyncSandboxNetworks,
    Egress,
    Networks,
    Ports,
    SandboxNetworks,
)
from hutch.sdk._net_args import NetworkModeArg
from hutch.sdk._net_types import EgressEvent, EgressInfo, NetworkInfo, PortInfo
from hutch.sdk._processes import (
    AsyncProcess,
    AsyncProcesses,
    Process,
    ProcessChunk,
    ProcessDropped,
    ProcessEnd,
    Processes,
    ProcessEvent,
    ProcessInfo,
    ProcessOutput,
)
from hutch.sdk._pty import AsyncPty, AsyncTerminal, Pty, PtyInfo, Terminal
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
    SandboxNetInfo,
    SnapshotInfo,
    WrittenFile,
)
from hutch.version import __version__

__all__ = [
    "DEFAULT_URL",
    "ApiKeyMissing",
    "ArchiveWritten",
    "AsyncClient",
    "AsyncContext",
    "AsyncContexts",
    "AsyncEgress",
    "AsyncFileWatcher",
    "AsyncFiles",
    "AsyncNetworks",
    "AsyncPorts",
    "AsyncProcess",
    "AsyncProcesses",
    "AsyncPty",
    "AsyncResponseStream",
    "AsyncSandbox",
    "AsyncSandboxNetworks",
    "AsyncTerminal",
    "Client",
    "ClientClosed",
    "Context",
    "ContextInfo",
    "Contexts",
    "DaemonUnreachable",
    "Egress",
    "EgressEvent",
    "EgressInfo",
    "ExecEvent",
    "ExecExit",
    "ExecOutput",
    "ExecResult",
    "Execution",
    "ExecutionError",
    "FileEntry",
    "FileWatcher",
    "Files",
    "Health",
    "ImageInfo",
    "ImageProgress",
    "NetworkInfo",
    "NetworkModeArg",
    "Networks",
    "PauseMode",
    "PauseModeArg",
    "PortInfo",
    "Ports",
    "Process",
    "ProcessChunk",
    "ProcessDropped",
    "ProcessEnd",
    "ProcessEvent",
    "ProcessInfo",
    "ProcessOutput",
    "Processes",
    "ProtocolError",
    "Pty",
    "PtyInfo",
    "ResponseStream",
    "Result",
    "Sandbox",
    "SandboxInfo",
    "SandboxNetInfo",
    "SandboxNetworks",
    "SnapshotInfo",
    "Terminal",
    "Timeouts",
    "WatchEvent",
    "WrittenFile",
    "__version__",
]
