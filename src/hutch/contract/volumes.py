"""Volumes as the API accepts them: kinds, sizes, names and mount requests, written once.

A volume is a filesystem that outlives sandboxes. ``exclusive``: a block device (a raw
ext4 image on the host) attached to one sandbox at a time. ``shared``: mounted by many
sandboxes at once, served by hutchd as files over a virtio-serial port per mount (FUSE
in the guest; see ARCHITECTURE.md "Volumes").

Every check raises :class:`~hutch.errors.InvalidArgument` naming the value and what is
accepted. The REST schemas, the SDK, the CLI and the MCP tools import these.
"""

from __future__ import annotations

import enum
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass

from hutch.contract.limits import PATH_MAX_CHARS
from hutch.errors import InvalidArgument

__all__ = [
    "DEFAULT_VOLUME_KIND",
    "MAX_VOLUMES_PER_SANDBOX",
    "VOLUME_ID_PATTERN",
    "VOLUME_ID_RE",
    "VOLUME_SIZE_RANGE",
    "VolumeKind",
    "VolumeMount",
    "parse_size",
    "parse_volume_flag",
    "validate_mount_path",
    "validate_mounts",
    "validate_size",
]


class VolumeKind(enum.StrEnum):
    EXCLUSIVE = "exclusive"
    SHARED = "shared"


DEFAULT_VOLUME_KIND = VolumeKind.EXCLUSIVE
VOLUME_ID_PATTERN = r"^vol-[0-9a-f]{12}$"
VOLUME_ID_RE = re.compile(VOLUME_ID_PATTERN)
#: Bytes. 16 MiB is the smallest ext4 with a journal worth having; 1 TiB is far more than
#: a host of this size holds, and a sparse file costs only what is written.
VOLUME_SIZE_RANGE = (16 * 1024**2, 1024**4)
#: Volumes one sandbox may mount (each is a virtio-mmio transport; microvm has 24, the
#: root disk, runtime disk, NIC, serial and RNG take five).
MAX_VOLUMES_PER_SANDBOX = 8

# Mounting over (or under) these would hide or replace the system the agent runs on.
_FORBIDDEN_TREES = (
    "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc",
    "/run", "/sbin", "/sys", "/usr",
)  # fmt: skip
# These may hold a mount below them, not be replaced themselves.
_FORBIDDEN_EXACT = ("/", "/var", "/tmp", "/home", "/root")

_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def validate_size(size_bytes: int, what: str = "size") -> int:
    lo, hi = VOLUME_SIZE_RANGE
    if isinstance(size_bytes, bool) or not isinstance(size_bytes, int):
        raise InvalidArgument(f"{what}={size_bytes!r} is not a number of bytes")
    if not lo <= size_bytes <= hi:
        raise InvalidArgument(
            f"{what}={size_bytes} bytes is out of range; accepted: {lo} (16 MiB) to "
            f"{hi} (1 TiB) bytes"
        )
    return size_bytes


def parse_size(text: str | int) -> int:
    """``"1G"``, ``"512MiB"``, ``"1073741824"`` -> bytes (binary units)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise InvalidArgument(
            f"size {text!r} is not understood; give bytes or a number with K, M, G or T "
            "(binary: 1G = 1024^3 bytes)"
        )
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def validate_mount_path(path: str) -> str:
    """An absolute, normalized guest path that does not cover a system directory."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidArgument(f"mount path {path!r} must be an absolute path (e.g. /data)")
    if len(path) > PATH_MAX_CHARS or "\0" in path:
        raise InvalidArgument(f"mount path {path[:80]!r} is too long or contains a NUL")
    norm = posixpath.normpath(path)
    if norm != path.rstrip("/") and not (path == "/" and norm == "/"):
        raise InvalidArgument(
            f"mount path {path!r} is not normalized; write it as {norm!r} "
            "(no '.', '..' or repeated '/')"
        )
    if norm in _FORBIDDEN_EXACT:
        raise InvalidArgument(
            f"mount path {norm!r} would replace a system directory; mount below it "
            f"(e.g. {posixpath.join(norm, 'data')!r})"
        )
    for tree in _FORBIDDEN_TREES:
        if norm == tree or norm.startswith(tree + "/"):
            raise InvalidArgument(
                f"mount path {norm!r} is inside {tree}, which holds the guest's system; "
                f"accepted: any other absolute path, e.g. /data or /mnt/NAME"
            )
    return norm


@dataclass(frozen=True)
class VolumeMount:
    """One volume to mount at create: ``volume`` is its id or name in the project."""

    volume: str
    path: str
    read_only: bool = False


def validate_mounts(mounts: Iterable[VolumeMount]) -> list[VolumeMount]:
    """The mounts with normalized paths; no duplicate volume, no path twice or nested."""
    out = [VolumeMount(m.volume, validate_mount_path(m.path), bool(m.read_only)) for m in mounts]
    if len(out) > MAX_VOLUMES_PER_SANDBOX:
        raise InvalidArgument(
            f"{len(out)} volumes asked; a sandbox mounts at most {MAX_VOLUMES_PER_SANDBOX}"
        )
    seen_volumes: set[str] = set()
    for i, m in enumerate(out):
        if not m.volume or not isinstance(m.volume, str):
            raise InvalidArgument("a volume mount needs 'volume' (a volume id or name)")
        if m.volume in seen_volumes:
            raise InvalidArgument(f"volume {m.volume!r} is mounted twice; mount it once")
        seen_volumes.add(m.volume)
        for other in out[:i]:
            if m.path == other.path:
                raise InvalidArgument(f"two volumes are mounted at {m.path!r}")
            if m.path.startswith(other.path + "/") or other.path.startswith(m.path + "/"):
                raise InvalidArgument(
                    f"mount paths {other.path!r} and {m.path!r} are nested; use separate paths"
                )
    return out


def parse_volume_flag(text: str) -> VolumeMount:
    """``NAME:/path`` or ``NAME:/path:ro`` (the CLI's ``--volume``)."""
    name, sep, rest = text.partition(":")
    read_only = False
    if rest.endswith(":ro"):
        rest, read_only = rest[:-3], True
    elif rest.endswith(":rw"):
        rest = rest[:-3]
    if not sep or not name or not rest:
        raise InvalidArgument(f"--volume {text!r}: use NAME:/path or NAME:/path:ro")
    return VolumeMount(volume=name, path=rest, read_only=read_only)
