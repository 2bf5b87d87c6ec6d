"""Host-wide names that two test runs on one machine could both pick, handed out so they
never do: `make test` runs two pytest processes side by side (its lanes, see the
Makefile), and helpers run more on a shared machine.

- :func:`claim`: the first of some candidate names (an address pool, ...) that no other
  process holds. A claim is an ``flock`` on ``/run/lock/hutch-tests/<kind>/<name>``, taken
  on a file descriptor of its own and kept until this process exits, so two claims in one
  process exclude each other too and a killed run frees its names with its last breath.
- :func:`free_port`: a loopback TCP port for a server a test starts and that binds it
  only later (a daemon subprocess, PostgreSQL, SeaweedFS). ``bind(0)`` and close hands out
  a port from the kernel's ephemeral range, where any process's next ``bind(0)`` or
  outgoing connection may take it before the server binds; each lane
  (``HUTCH_TEST_LANE``, set by ``scripts/lanes.sh``) takes its ports instead from a range
  of its own below the ephemeral one, in turn, so no one else is handed them.
- :func:`own_tag_state_dir`: a state dir whose daemon tag (4 hex digits of its path's
  hash, naming the daemon's taps, nft table and cgroups) no live daemon of any test run
  here has: two daemons on one tag would delete each other's taps as orphans.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "LANE_PORTS",
    "LOCK_DIR",
    "Lease",
    "claim",
    "free_port",
    "own_tag_state_dir",
    "release_tag",
]

LOCK_DIR = Path("/run/lock/hutch-tests")


def _lane_ports() -> dict[str, range]:
    """Each lane's ports: 6000 each, right below the kernel's ephemeral range
    (``ip_local_port_range``, 32768-60999 by default), which bind(0) and outgoing
    connections use; none where that range starts too low to leave room."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    if low < 13024:
        return {}
    return {"a": range(low - 12000, low - 6000), "b": range(low - 6000, low)}


LANE_PORTS = _lane_ports()

_next_port: dict[str, itertools.count[int]] = {}
_tags: dict[Path, Lease] = {}


@dataclass
class Lease:
    """A claimed name; held until :meth:`release` or until this process exits."""

    name: str
    path: Path
    fd: int | None

    def release(self) -> None:
        """Free the name and remove its lock file (unlinked while still locked: whoever
        opened it meanwhile finds it is no longer the file at that path, see claim)."""
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None


def claim(kind: str, candidates: Iterable[str]) -> Lease | None:
    """The first name of ``candidates`` that no process (this one included) holds as
    ``kind``, now held by the returned lease; None when every one is taken."""
    directory = LOCK_DIR / kind
    directory.mkdir(parents=True, exist_ok=True)
    for name in candidates:
        path = directory / name
        while True:
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                break  # held: the next candidate
            try:
                current = os.stat(path).st_ino
            except FileNotFoundError:
                current = -1
            if current == os.fstat(fd).st_ino:
                return Lease(name, path, fd)
            os.close(fd)  # released and unlinked after we opened it: open it anew
    return None


def own_tag_state_dir(state_dir: Path) -> Path:
    """``state_dir`` (resolved) if no live daemon elsewhere has its daemon tag, else the
    first free sibling ``<name>.1``, ``<name>.2``, ... (so almost always ``state_dir``
    itself). Its tag stays claimed until :func:`release_tag` or this process exits; the
    same dir asked again in this process (a daemon started anew on it) keeps its claim."""
    from hutch.config import Settings

    state_dir = state_dir.resolve()
    for n in range(100):
        candidate = state_dir if n == 0 else state_dir.with_name(f"{state_dir.name}.{n}")
        if candidate in _tags:
            return candidate
        lease = claim("daemon-tag", [Settings(state_dir=candidate).daemon_tag])
        if lease is not None:
            _tags[candidate] = lease
            return candidate
    raise RuntimeError(f"no state dir beside {state_dir} with a daemon tag of its own")


def release_tag(state_dir: Path) -> None:
    """Let another daemon take ``state_dir``'s tag (its daemon stopped, its taps, table
    and cgroups are gone)."""
    lease = _tags.pop(state_dir.resolve(), None)
    if lease is not None:
        lease.release()


def free_port() -> int:
    """A loopback TCP port nothing listens on, for a server to bind soon. In a lane, the
    next free one of its range (never the same twice in a process until the range wraps);
    outside one, the kernel's choice."""
    lane = os.environ.get("HUTCH_TEST_LANE", "")
    ports = LANE_PORTS.get(lane)
    if ports is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    cursor = _next_port.setdefault(lane, itertools.count())
    for _ in range(len(ports)):
        port = ports[next(cursor) % len(ports)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use (or in TIME_WAIT): the next one
            return port
    raise RuntimeError(f"no free loopback port left in lane {lane}'s range {ports}")
