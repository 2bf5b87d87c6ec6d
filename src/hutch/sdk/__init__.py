"""hutch's Python SDK: ``Sandbox`` / ``AsyncSandbox`` handles over the REST API v1.

A client only (it imports the contract, never the daemon's code). Layout, after httpx:

- a sans-IO core: ``_core`` (request plumbing, failures) and one module per resource that
  builds its requests, reads its answers and holds its value types: ``_sandboxes``
  (create, lifecycle, snapshots, images), ``_exec``, ``_files`` (+ ``_tar``),
  ``_processes``, ``_contexts`` (code interpreter), ``_net`` (egress, ports, networks),
  ``_secrets`` (write-only secrets), ``_pty`` (terminals), ``_usage`` (usage, cost, the
  event log); ``_streams`` decodes streamed bodies. The create and command fields are the
  contract's (``hutch.contract.requests``), declared once.
- the shells that do I/O: ``_async/``, written by hand, and ``_sync/``, generated from it
  by ``scripts/unasync.py`` (a test fails when it is stale); where the two must differ,
  ``_io_async``/``_io_sync``.

Configuration: ``_config`` (URL, key, timeouts). The in-memory fake for tests is
:mod:`hutch.testing`.
"""

from __future__ import annotations

from hutch.contract.enums import PauseMode
from hutch.contract.volumes import VolumeMount
from hutch.sdk._async.client import AsyncClient, AsyncResponseStream
from hutch.sdk._async.contexts import AsyncContext, AsyncContexts
from hutch.sdk._async.files import AsyncFiles, AsyncFileWatcher
from hutch.sdk._async.net import (
    AsyncEgress,
    AsyncEgressPolicies,
    AsyncNetworks,
    AsyncPorts,
    AsyncSandboxNetworks,
)
from hutch.sdk._async.processes import AsyncProcess, AsyncProcesses
from hutch.sdk._async.pty import AsyncPty, AsyncTerminal
from hutch.sdk._async.sandbox import AsyncSandbox
from hutch.sdk._async.secrets import AsyncSecrets
from hutch.sdk._async.volumes import AsyncVolumes
from hutch.sdk._config import DEFAULT_URL, Timeouts
from hutch.sdk._contexts import ContextInfo, Execution, ExecutionError, Result
from hutch.sdk._errors import ApiKeyMissing, ClientClosed, DaemonUnreachable, ProtocolError
from hutch.sdk._exec import ExecEvent, ExecExit, ExecOutput, ExecResult
from hutch.sdk._files import ArchiveWritten, FileEntry, WatchEvent, WrittenFile
from hutch.sdk._hosts import HostInfo
from hutch.sdk._images import BuildEvent, ImageProgress
from hutch.sdk._net import (
    DryRunEvent,
    EgressEvent,
    EgressInfo,
    NamedPolicyInfo,
    NetworkInfo,
    NetworkModeArg,
    PortInfo,
)
from hutch.sdk._processes import (
    ProcessChunk,
    ProcessDropped,
    ProcessEnd,
    ProcessEvent,
    ProcessInfo,
    ProcessOutput,
)
from hutch.sdk._projects import CreatedKeyInfo, KeyInfo, ProjectInfo
from hutch.sdk._pty import PtyInfo
from hutch.sdk._sandboxes import (
    Health,
    ImageInfo,
    PauseModeArg,
    SandboxInfo,
    SandboxNetInfo,
    SnapshotInfo,
)
from hutch.sdk._secrets import SecretInfo
from hutch.sdk._sync.client import Client, ResponseStream
from hutch.sdk._sync.contexts import Context, Contexts
from hutch.sdk._sync.files import Files, FileWatcher
from hutch.sdk._sync.net import Egress, EgressPolicies, Networks, Ports, SandboxNetworks
from hutch.sdk._sync.processes import Process, Processes
from hutch.sdk._sync.pty import Pty, Terminal
from hutch.sdk._sync.sandbox import Sandbox
from hutch.sdk._sync.secrets import Secrets
from hutch.sdk._sync.volumes import Volumes
from hutch.sdk._usage import Event, EventPage, Usage, UsageRow
from hutch.sdk._volumes import VolumeInfo, VolumeUser
from hutch.version import __version__

__all__ = [
    "DEFAULT_URL",
    "ApiKeyMissing",
    "ArchiveWritten",
    "AsyncClient",
    "AsyncContext",
    "AsyncContexts",
    "AsyncEgress",
    "AsyncEgressPolicies",
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
    "AsyncSecrets",
    "AsyncTerminal",
    "AsyncVolumes",
    "BuildEvent",
    "Client",
    "ClientClosed",
    "Context",
    "ContextInfo",
    "Contexts",
    "CreatedKeyInfo",
    "DaemonUnreachable",
    "DryRunEvent",
    "Egress",
    "EgressEvent",
    "EgressInfo",
    "EgressPolicies",
    "Event",
    "EventPage",
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
    "HostInfo",
    "ImageInfo",
    "ImageProgress",
    "KeyInfo",
    "NamedPolicyInfo",
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
    "ProjectInfo",
    "ProtocolError",
    "Pty",
    "PtyInfo",
    "ResponseStream",
    "Result",
    "Sandbox",
    "SandboxInfo",
    "SandboxNetInfo",
    "SandboxNetworks",
    "SecretInfo",
    "Secrets",
    "SnapshotInfo",
    "Terminal",
    "Timeouts",
    "Usage",
    "UsageRow",
    "VolumeInfo",
    "VolumeMount",
    "VolumeUser",
    "Volumes",
    "WatchEvent",
    "WrittenFile",
    "__version__",
]
