"""The data behind :class:`hutch.testing.FakeHutch`: fake sandboxes, snapshots and
command runs, the error a test can make the fake answer with, and small request helpers.

The fake raises the real error classes (:mod:`hutch.errors`); its router answers them
with the contract's table (:mod:`hutch.contract.http_errors`), as the daemon does."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from hutch.contract.enums import DEFAULT_NETWORK_MODE
from hutch.contract.limits import (
    DEFAULT_DISK_GIB,
    DEFAULT_IMAGE,
    DEFAULT_MEMORY_MIB,
    DEFAULT_VCPUS,
)
from hutch.errors import InvalidArgument, StateError

__all__ = [
    "TIME",
    "Chunks",
    "FakeError",
    "FakeRun",
    "FakeSandbox",
    "FakeSnapshot",
    "json_body",
    "require",
]

TIME = "2026-11-30T03:00:00.123Z"
_PAUSED_TIME = "2026-11-30T03:05:00.000Z"
_SNAPSHOT_TIME = "2026-11-30T03:10:00.000Z"


@dataclass
class FakeRun:
    """What a faked command does: output chunks in order, then how it ends.

    ``error`` ends the stream with an error line (e.g. ``("timeout", "...")``) and, for
    a non-streamed exec, answers with that error instead.
    """

    output: Sequence[tuple[str, str]] = ()
    exit_code: int | None = 0
    signal: int | None = None
    duration_ms: int = 7
    error: tuple[str, str] | None = None


@dataclass
class FakeSandbox:
    id: str
    spec: dict[str, Any]
    state: str = "running"
    files: dict[str, bytes] = field(default_factory=dict)
    modes: dict[str, int] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=lambda: {"/", "/root", "/tmp"})
    pause_mode: str | None = None
    parent_id: str | None = None
    #: How many times it was resumed (explicitly or by ``auto_resume``).
    resumes: int = 0
    # -- networking (see _net) --
    #: Canonical egress rules in force ([]: open); for a policy, one line per rule.
    egress: list[str] = field(default_factory=list)
    #: The ordered policy in force (canonical document), or None for a rule list.
    egress_doc: dict[str, Any] | None = None
    #: What GET .../egress reports; tests set them.
    allowed: int = 0
    denied: int = 0
    rate_limited: int = 0
    log_dropped: int = 0
    #: GET .../egress/log answers these (API form, oldest first); tests append them.
    egress_events: list[dict[str, Any]] = field(default_factory=list)
    #: Exposed guest ports -> their API form.
    ports: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: Private network ids it is on.
    networks: list[str] = field(default_factory=list)
    #: The guest address; None with network "none".
    address: str | None = None

    def pause(self, mode: str) -> None:
        self.state, self.pause_mode = "paused", mode

    def resume(self) -> None:
        self.state, self.pause_mode = "running", None
        self.resumes += 1

    def to_json(self) -> dict[str, Any]:
        ended = self.state in ("destroyed", "failed")
        return {
            "id": self.id,
            "name": self.spec.get("name"),
            "image": self.spec.get("image", DEFAULT_IMAGE),
            "state": self.state,
            "vcpus": self.spec.get("vcpus", DEFAULT_VCPUS),
            "memory_mib": self.spec.get("memory_mib", DEFAULT_MEMORY_MIB),
            "disk_gib": self.spec.get("disk_gib", DEFAULT_DISK_GIB),
            "metadata": self.spec.get("metadata") or {},
            "timeout_s": self.spec.get("timeout_s"),
            "created_at": TIME,
            "started_at": TIME,
            "expires_at": None,
            "ended_at": TIME if self.state == "destroyed" else None,
            "error": None,
            "pause_mode": self.pause_mode,
            "paused_at": _PAUSED_TIME if self.state == "paused" else None,
            "parent_id": self.parent_id,
            "auto_resume": bool(self.spec.get("auto_resume", False)),
            "auto_pause_s": self.spec.get("auto_pause_s"),
            "auto_delete_s": self.spec.get("auto_delete_s"),
            "snapshot_id": self.spec.get("snapshot"),
            "network": {
                "mode": self.spec.get("network", DEFAULT_NETWORK_MODE.value),
                "address": None if ended else self.address,
                "networks": [] if ended else list(self.networks),
            },
            "env_secrets": dict(self.spec.get("env_secrets") or {}),
            "placement_labels": dict((self.spec.get("placement") or {}).get("labels") or {}),
        }


@dataclass
class FakeSnapshot:
    """A named snapshot: the spec (image and shape) and files of a sandbox at one moment."""

    id: str
    name: str
    sandbox_id: str
    spec: dict[str, Any]
    files: dict[str, bytes]
    modes: dict[str, int]
    dirs: set[str]

    @property
    def size_bytes(self) -> int:
        # Memory image plus the files: deterministic, and grows with what was written.
        memory = int(self.spec.get("memory_mib", DEFAULT_MEMORY_MIB)) << 20
        return memory + sum(len(data) for data in self.files.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "sandbox_id": self.sandbox_id,
            "image": self.spec.get("image", DEFAULT_IMAGE),
            "vcpus": self.spec.get("vcpus", DEFAULT_VCPUS),
            "memory_mib": self.spec.get("memory_mib", DEFAULT_MEMORY_MIB),
            "disk_gib": self.spec.get("disk_gib", DEFAULT_DISK_GIB),
            "size_bytes": self.size_bytes,
            "created_at": _SNAPSHOT_TIME,
        }


class FakeError(Exception):
    """An API error body with any status and code, for :meth:`FakeHutch.fail_next` (the
    fake itself raises the real :mod:`hutch.errors` classes)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class Chunks(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A body that yields the given chunks one by one, to sync and async clients."""

    def __init__(self, chunks: Sequence[bytes]) -> None:
        self._chunks = list(chunks)

    def __iter__(self) -> Iterator[bytes]:
        yield from self._chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk


def require(sb: FakeSandbox, *states: str) -> None:
    """StateError (409 invalid_state) unless ``sb`` is in one of ``states``."""
    if sb.state not in states:
        raise StateError(f"sandbox {sb.id}", sb.state, states)


def json_body(request: httpx.Request) -> dict[str, Any]:
    try:
        body = json.loads(request.content or b"{}")
    except ValueError as exc:
        raise InvalidArgument(f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidArgument("body must be a JSON object")
    return body
