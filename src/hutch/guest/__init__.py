"""Host side of the guest agent protocol: sans-IO framing and the asyncio client.

The agent itself is ``guest_agent/hutch_agent/`` (runs inside each VM).
"""

from hutch.guest.client import AgentClient, ExecStream
from hutch.guest.paths import normalize_guest_path
from hutch.guest.protocol import PROTOCOL_VERSION
from hutch.guest.results import AgentInfo, ExecExit, ExecOutput, ExecResult, FileEntry

__all__ = [
    "PROTOCOL_VERSION",
    "AgentClient",
    "AgentInfo",
    "ExecExit",
    "ExecOutput",
    "ExecResult",
    "ExecStream",
    "FileEntry",
    "normalize_guest_path",
]
