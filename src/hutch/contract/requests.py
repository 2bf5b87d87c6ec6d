"""The fields of the two requests every client builds, declared once with their defaults.

``CreateRequest`` is the body of ``POST /v1/sandboxes`` (17 fields); ``CommandRequest``
holds the 6 fields every way of running a command takes (``POST .../exec``, ``POST
.../processes``). The REST schemas (``hutch.api``) must have exactly these fields with
these defaults, the SDK builds its request bodies from them and the in-memory fake parses
bodies into them; ``tests/unit/test_contract.py`` checks all three.

Plain values, not checked here: the daemon validates what it receives, the SDK checks
what it is about to send (``hutch.sdk._options``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from hutch.contract.enums import DEFAULT_NETWORK_MODE
from hutch.contract.limits import (
    DEFAULT_DISK_GIB,
    DEFAULT_IMAGE,
    DEFAULT_MEMORY_MIB,
    DEFAULT_VCPUS,
)
from hutch.contract.volumes import VolumeMount

__all__ = ["COMMAND_FIELDS", "CREATE_FIELDS", "SHAPE_FIELDS", "CommandRequest", "CreateRequest"]


@dataclass(frozen=True)
class CreateRequest:
    """What a create asks for. ``snapshot``: start from that snapshot, whose image and
    shape win (so the shape fields must stay at their defaults); ``egress`` None or []:
    open egress, or an ordered policy document (``hutch.contract.egress_policy``);
    ``egress_policy``: a named policy of the project to copy instead; ``networks``:
    private networks (ids or names) to join; ``env_secrets``: ``{VAR: secret name}``,
    each variable the secret's current value in every command."""

    image: str = DEFAULT_IMAGE
    vcpus: int = DEFAULT_VCPUS
    memory_mib: int = DEFAULT_MEMORY_MIB
    disk_gib: int = DEFAULT_DISK_GIB
    env: Mapping[str, str] = field(default_factory=dict)
    metadata: Mapping[str, str] = field(default_factory=dict)
    name: str | None = None
    timeout_s: int | None = None
    auto_resume: bool = False
    auto_pause_s: int | None = None
    auto_delete_s: int | None = None
    snapshot: str | None = None
    network: str = DEFAULT_NETWORK_MODE.value
    egress: Sequence[str] | Mapping[str, Any] | None = None
    egress_policy: str | None = None
    networks: Sequence[str] = ()
    #: Volumes to mount at create (``hutch.contract.volumes.VolumeMount``).
    volumes: Sequence[VolumeMount] = ()
    env_secrets: Mapping[str, str] = field(default_factory=dict)
    #: Where in a cluster (``hutch.contract.placement``): a host, labels, a strategy.
    placement: Mapping[str, Any] | None = None

    def non_defaults(self) -> dict[str, Any]:
        """The fields that differ from their default (see :func:`_non_defaults`)."""
        return _non_defaults(self)


@dataclass(frozen=True)
class CommandRequest:
    """A command: ``cmd`` is an argv list (run directly) or a string (run with
    ``/bin/sh -c``); ``env`` adds to the sandbox's environment; ``stdin`` is written to it
    first; ``timeout_s`` (seconds) kills it when it runs longer."""

    cmd: str | Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None
    stdin: str | bytes | None = None
    timeout_s: float | None = None

    def non_defaults(self) -> dict[str, Any]:
        return _non_defaults(self)


def _non_defaults(request: CreateRequest | CommandRequest) -> dict[str, Any]:
    """Fields set to something else than their default. None, and an empty collection
    where the default is one, count as unset; ``egress=[]`` is set (its default is None)."""
    out: dict[str, Any] = {}
    for f in fields(request):
        value = getattr(request, f.name)
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if value is None or value == default:
            continue
        empty = isinstance(value, Mapping | Sequence) and not value
        if empty and isinstance(default, Mapping | tuple):
            continue
        out[f.name] = value
    return out


CREATE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(CreateRequest))
#: The fields a snapshot fixes (a create from a snapshot leaves them at their defaults).
SHAPE_FIELDS: tuple[str, ...] = ("image", "vcpus", "memory_mib", "disk_gib")
COMMAND_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(CommandRequest))
