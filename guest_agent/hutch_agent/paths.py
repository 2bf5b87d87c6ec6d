"""Guest path rules of the file API (mirror of ``hutch.guest.paths``)."""

from __future__ import annotations

import os
import posixpath
import stat
from typing import Any

from hutch_agent import HOME
from hutch_agent.errors import AgentError

FORBIDDEN = ("/proc", "/sys", "/dev")


def normalize(path: Any, home: str = HOME) -> str:
    """Mirror of hutch.guest.paths.normalize_guest_path."""
    if not isinstance(path, str) or not path:
        raise AgentError("invalid_argument", "path is empty")
    if "\0" in path:
        raise AgentError("invalid_argument", f"path {path!r} contains a NUL byte")
    if len(path.encode("utf-8", "surrogateescape")) > 4096:
        raise AgentError("invalid_argument", "path is longer than 4096 bytes")
    if path.startswith("/"):
        full = "/" + posixpath.normpath(path).lstrip("/")
    else:
        full = posixpath.normpath(posixpath.join(home, path))
        if full != home and not full.startswith(home.rstrip("/") + "/"):
            raise AgentError("invalid_argument", f"relative path {path!r} climbs above {home}")
    forbidden_check(full)
    return full


def forbidden_check(full: str) -> None:
    for root in FORBIDDEN:
        if full == root or full.startswith(root + "/"):
            raise AgentError(
                "invalid_argument",
                f"path {full!r} is under {root}, which the file API does not touch",
            )


def checked(path: Any, follow: bool = True) -> str:
    """Normalise and refuse symlinks that lead into the forbidden trees."""
    full = normalize(path)
    if follow:
        forbidden_check(os.path.realpath(full))
    else:
        forbidden_check(
            os.path.join(os.path.realpath(os.path.dirname(full)), os.path.basename(full))
        )
    return full


def entry(path: str, st: os.stat_result | None = None) -> dict[str, Any]:
    st = st or os.lstat(path)
    m = st.st_mode
    kind = (
        "file"
        if stat.S_ISREG(m)
        else "dir"
        if stat.S_ISDIR(m)
        else "symlink"
        if stat.S_ISLNK(m)
        else "other"
    )
    return {
        "name": posixpath.basename(path) or "/",
        "path": path,
        "type": kind,
        "size": st.st_size,
        "mode": stat.S_IMODE(m),
        "mtime": st.st_mtime,
    }
