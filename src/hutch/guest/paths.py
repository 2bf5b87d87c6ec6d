"""Which guest paths the file API accepts. The agent enforces the same policy.

Checked on the host too, so a bad path fails fast with a message that says what to change
instead of a round trip to the guest.
"""

from __future__ import annotations

import posixpath

from hutch.errors import InvalidArgument

__all__ = ["DEFAULT_HOME", "FORBIDDEN_ROOTS", "MAX_PATH_BYTES", "normalize_guest_path"]

DEFAULT_HOME = "/root"
MAX_PATH_BYTES = 4096
#: Kernel pseudo-filesystems: streaming /dev/zero never ends, /proc/sysrq-trigger can
#: crash the VM, and neither holds user files.
FORBIDDEN_ROOTS = ("/proc", "/sys", "/dev")


def normalize_guest_path(path: str, home: str = DEFAULT_HOME) -> str:
    """Return the absolute, normalised form of ``path`` or raise ``InvalidArgument``.

    Relative paths are taken from ``home`` and may not climb above it with ``..``.
    """
    if not isinstance(path, str) or not path:
        raise InvalidArgument("path is empty; give an absolute path or one relative to /root")
    if "\0" in path:
        raise InvalidArgument(f"path {path!r} contains a NUL byte")
    if len(path.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise InvalidArgument(f"path is longer than {MAX_PATH_BYTES} bytes")
    if path.startswith("/"):
        full = posixpath.normpath(path)
        # normpath keeps a leading "//" (POSIX allows it to mean something else).
        if full.startswith("//"):
            full = "/" + full.lstrip("/")
    else:
        full = posixpath.normpath(posixpath.join(home, path))
        if full != home and not full.startswith(home.rstrip("/") + "/"):
            raise InvalidArgument(
                f"relative path {path!r} climbs above {home}; use an absolute path instead"
            )
    for root in FORBIDDEN_ROOTS:
        if full == root or full.startswith(root + "/"):
            raise InvalidArgument(
                f"path {full!r} is under {root}, which the file API does not touch; "
                "use exec for kernel interfaces"
            )
    return full
