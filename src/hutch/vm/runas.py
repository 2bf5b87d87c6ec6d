"""Who QEMU runs as once it is set up (``-runas``), and that user's uid.

hutchd runs as root (taps, nft), so QEMU starts as root; it opens what it needs and then
drops to ``settings.qemu_user``. A QEMU that escaped its guest is then an unprivileged
process that cannot read the state dir, and hutch's nft table drops any IP traffic it
originates (it needs none: its NIC is a tap, its control channels unix sockets).
"""

from __future__ import annotations

import logging
import os
import pwd

from hutch.config import Settings
from hutch.errors import VmError

__all__ = ["qemu_runas", "qemu_uid", "qemu_user"]

log = logging.getLogger(__name__)


def qemu_user(settings: Settings) -> str | None:
    """``settings.qemu_user`` when the daemon is root (None when it is not: QEMU then
    already runs unprivileged, as the daemon). Raises ``VmError`` if that user is missing."""
    if os.geteuid() != 0:
        return None
    name = settings.qemu_user
    if name == "root":
        log.warning("HUTCH_QEMU_USER=root: QEMU keeps root; a QEMU escape would own the host")
        return None
    try:
        pwd.getpwnam(name)
    except KeyError:
        raise VmError(
            f"the QEMU user {name!r} does not exist; create it (`make deps` does: useradd "
            f"--system --no-create-home --shell /usr/sbin/nologin {name}) or set "
            "HUTCH_QEMU_USER to another unprivileged user (root works but is not advised)"
        ) from None
    return name


def qemu_runas(settings: Settings) -> str | None:
    """What QEMU's ``-runas`` gets: ``uid:gid`` of :func:`qemu_user`, resolved here once.

    Numeric, so that QEMU looks nothing up in the user database when it starts: a lookup
    in every QEMU is one more way for a start to fail (a start once failed with QEMU
    saying the user did not exist while ``/etc/passwd`` had it unchanged)."""
    name = qemu_user(settings)
    if name is None:
        return None
    entry = pwd.getpwnam(name)
    return f"{entry.pw_uid}:{entry.pw_gid}"


def qemu_uid(settings: Settings) -> int | None:
    """The uid QEMU runs as when it is not the daemon's own (None otherwise)."""
    try:
        name = qemu_user(settings)
    except VmError:
        return None  # the backend refuses to start VMs; nothing to filter
    return pwd.getpwnam(name).pw_uid if name else None
