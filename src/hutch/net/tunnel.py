"""The overlay between hosts of a cluster: private networks whose members run on
different hosts (ARCHITECTURE.md, "Private networks across hosts").

Sandboxes are routed, not bridged (each has its own /30 on its tap), so the overlay is
routed too: one VXLAN device per daemon, ``hx<tag>`` (VNI :data:`VNI`, UDP ``port`` on
``local``, MAC derived from the host id, no learning), and for each member of another
host that shares a network with a member here, three static entries (the device itself
is made over rtnetlink with the kernel's local bypass off, :mod:`hutch.net.vxlan`)::

  ip route replace ADDR/32 dev hx<tag> table T      (T: this daemon's routing table)
  ip neigh replace ADDR lladdr MAC_OF_PEER dev hx<tag> nud permanent
  bridge fdb replace MAC_OF_PEER dev hx<tag> dst PEER_IP port PEER_PORT self permanent

Only packets from this daemon's taps to the other hosts' pools take table ``T``: nft
marks them (``meta mark``, :data:`TunnelConfig.mark`) and one ``ip rule fwmark M lookup
T`` sends them there; everything else keeps the main table. That is what lets several
workers share one network namespace on one machine (a test cluster): each has its own
device, port, mark and table, and a peer's guest address, which the main table reaches
through that peer's own tap, is reached from here through the tunnel like on another
machine. The guest sees none of it: it talks to its gateway as always, and the
endpoints are host addresses it may never reach (nft ``tunnel_peers``).

Pure argv rendering (``render_*``) plus :class:`TunnelDriver`, which runs it. Every
change is idempotent (``replace``; deletes of missing entries are fine), so a crashed
daemon's leftovers are removed by :meth:`TunnelDriver.down` at its next start.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address
from pathlib import Path

from hutch.errors import InvalidArgument, NetworkError
from hutch.net import links, vxlan
from hutch.net.addressing import tap_prefix

__all__ = [
    "RULE_PRIORITY",
    "VNI",
    "TunnelConfig",
    "TunnelDriver",
    "TunnelPeer",
    "TunnelState",
    "host_mac",
    "is_local_address",
    "render_down",
    "render_sync",
    "render_up",
]

log = logging.getLogger(__name__)

#: The VXLAN network identifier of hutch's overlay (one per cluster: isolation between
#: private networks is nft's member sets on both ends, not the VNI; see ARCHITECTURE.md).
VNI = 4213
#: Priority of the ``ip rule`` (before ``main`` at 32766).
RULE_PRIORITY = 31000

Argv = tuple[str, ...]


def host_mac(host_id: str) -> str:
    """A stable, locally administered unicast MAC for a host's tunnel device."""
    digest = hashlib.sha256(f"hutch-tunnel:{host_id}".encode()).digest()
    return "02:" + ":".join(f"{b:02x}" for b in digest[:5])


@dataclass(frozen=True)
class TunnelConfig:
    """This daemon's end of the overlay: its tag (device ``hx<tag>``), host id (the
    MAC), the underlay address and UDP port it receives on."""

    tag: str
    host_id: str
    local: IPv4Address
    port: int

    def __post_init__(self) -> None:
        tap_prefix(self.tag)  # validates the tag
        if not 0 < self.port < 65536:
            raise InvalidArgument(f"tunnel port {self.port} is not a UDP port (1..65535)")

    @property
    def dev(self) -> str:
        # 'x' is not a hex digit: never matched by any daemon's tap wildcard h<tag>*.
        return f"hx{self.tag}"

    @property
    def mac(self) -> str:
        return host_mac(self.host_id)

    @property
    def mark(self) -> int:
        """The packet mark nft sets on this daemon's traffic into the tunnel."""
        return 0x68780000 | int(self.tag, 16)

    @property
    def table(self) -> int:
        """This daemon's routing table (one per daemon: one machine may run several)."""
        return 0x6878_0000 | int(self.tag, 16)


@dataclass(frozen=True, order=True)
class TunnelPeer:
    """Another host's end: its underlay address, UDP port and device MAC."""

    host: str
    address: IPv4Address
    port: int
    mac: str


@dataclass(frozen=True)
class TunnelState:
    """What the tunnel carries: the peers, and each remote member address with the
    host (a peer's ``host``) it lives on. Empty: no device at all."""

    peers: tuple[TunnelPeer, ...] = ()
    routes: tuple[tuple[IPv4Address, str], ...] = ()

    @property
    def empty(self) -> bool:
        return not self.routes

    def peer(self, host: str) -> TunnelPeer | None:
        return next((p for p in self.peers if p.host == host), None)


def _rule(cfg: TunnelConfig, verb: str) -> Argv:
    return (
        "ip", "rule", verb, "priority", str(RULE_PRIORITY), "fwmark", f"{cfg.mark:#x}",
        "lookup", str(cfg.table),
    )  # fmt: skip


def render_up(cfg: TunnelConfig) -> list[Argv]:
    """After the device is created (:func:`hutch.net.vxlan.create_vxlan`, on a fresh
    slate: :func:`render_down` first): its settings, up, and the ip rule."""
    dev = cfg.dev
    return [
        ("sysctl", "-q", "-w", f"net.ipv6.conf.{dev}.disable_ipv6=1"),
        # The device has no address, and the kernel's reverse-path check (strict or
        # loose) drops every packet arriving on an address-less device: off here (the
        # effective value is the larger of this and conf.all, checked at up). The source
        # check is nft's: out of the tunnel only members' addresses pass (`ingress`).
        ("sysctl", "-q", "-w", f"net.ipv4.conf.{dev}.rp_filter=0"),
        ("ip", "link", "set", "dev", dev, "up"),
        _rule(cfg, "add"),
    ]


def render_down(cfg: TunnelConfig) -> list[Argv]:
    """Remove everything (the device takes its routes, neighbours and fdb entries with
    it). Each command may fail harmlessly when there is nothing to remove."""
    return [
        _rule(cfg, "del"),
        ("ip", "route", "flush", "table", str(cfg.table)),
        ("ip", "link", "del", "dev", cfg.dev),
    ]


def _fdb(cfg: TunnelConfig, verb: str, peer: TunnelPeer) -> Argv:
    extra: tuple[str, ...] = ("port", str(peer.port), "self", "permanent")
    return (
        "bridge", "fdb", verb, peer.mac, "dev", cfg.dev, "dst", str(peer.address),
        *(extra if verb != "del" else ("self",)),
    )  # fmt: skip


def render_sync(cfg: TunnelConfig, old: TunnelState, new: TunnelState) -> list[Argv]:
    """Commands that turn ``old`` into ``new`` on an existing device: stale routes and
    neighbours first, stale peers, then new peers and new routes (a route is added
    only after its peer's fdb entry and its neighbour exist)."""
    dev, table = cfg.dev, str(cfg.table)
    out: list[Argv] = []
    new_routes = dict(new.routes)
    for address, host in sorted(old.routes):
        if new_routes.get(address) != host or new.peer(host) != old.peer(host):
            out.append(("ip", "route", "del", f"{address}/32", "dev", dev, "table", table))
            out.append(("ip", "neigh", "del", str(address), "dev", dev))
    for gone in sorted(set(old.peers) - set(new.peers)):
        out.append(_fdb(cfg, "del", gone))
    for added in sorted(set(new.peers) - set(old.peers)):
        out.append(_fdb(cfg, "replace", added))
    old_routes = dict(old.routes)
    for address, host in sorted(new.routes):
        peer = new.peer(host)
        if peer is None:
            continue  # no endpoint known for that host (yet): unreachable, as before
        if old_routes.get(address) == host and old.peer(host) == peer:
            continue
        neigh = ("ip", "neigh", "replace", str(address), "lladdr", peer.mac, "dev", dev)
        out.append((*neigh, "nud", "permanent"))
        out.append(("ip", "route", "replace", f"{address}/32", "dev", dev, "table", table))
    return out


def is_local_address(address: IPv4Address) -> bool:
    """The address is one of this machine's (a UDP socket binds to it: no
    IP_FREEBIND, so the kernel refuses any other)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.bind((str(address), 0))
        except OSError:
            return False
    return True


def _rp_filter_all() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/conf/all/rp_filter").read_text())
    except (OSError, ValueError):
        return 0


async def _run(argv: Sequence[str], *, check: bool) -> None:
    code, _, err = await links.run_command(argv)
    if code != 0 and check:
        raise NetworkError(f"`{' '.join(argv)}` failed (exit {code}): {err.strip()}")


class TunnelDriver:
    """Runs the rendered commands; remembers what it set up (``state``)."""

    def __init__(self, cfg: TunnelConfig) -> None:
        self.cfg = cfg
        self.state = TunnelState()
        self.up = False
        #: Whether the kernel turned the device's local bypass off (known once created).
        self.bypass_off = False

    async def down(self) -> None:
        """Remove the device, its entries, the rule and the table (also what a crashed
        daemon left). Safe to call at any time, twice."""
        for argv in render_down(self.cfg):
            await _run(argv, check=False)
        # A crash between two `ip rule add`s could leave duplicates: delete them all.
        for _ in range(8):
            code, _, _ = await links.run_command(_rule(self.cfg, "del"))
            if code != 0:
                break
        self.state, self.up = TunnelState(), False

    async def sync(self, new: TunnelState) -> None:
        """Make the tunnel carry exactly ``new``: created on the first route, removed
        with the last. On failure the device is removed (fail closed: remote members
        are unreachable) and NetworkError raised; the next sync builds it again."""
        if new == self.state and (self.up or new.empty):
            return
        try:
            if new.empty:
                if self.up:
                    await self.down()
                return
            if not self.up:
                await self.down()
                await self._create()
                self.up = True
            self._refuse_local_peers_with_bypass(new)
            for argv in render_sync(self.cfg, self.state, new):
                await _run(argv, check="del" not in argv)
            self.state = new
        except NetworkError:
            log.warning("tunnel %s: could not apply the overlay; removing it", self.cfg.dev)
            await self.down()
            raise

    async def _create(self) -> None:
        cfg = self.cfg
        self.bypass_off = await asyncio.to_thread(
            vxlan.create_vxlan, cfg.dev, mac=cfg.mac, vni=VNI, local=cfg.local, port=cfg.port
        )
        strict = _rp_filter_all()
        if strict:
            raise NetworkError(
                f"net.ipv4.conf.all.rp_filter is {strict}: the kernel would drop every "
                f"packet out of the tunnel device {cfg.dev} (it has no address); set it "
                "to 0 (each device keeps its own setting) or HUTCH_TUNNEL_PORT=0"
            )
        for argv in render_up(cfg):
            await _run(argv, check=True)

    def _refuse_local_peers_with_bypass(self, new: TunnelState) -> None:
        """With the kernel's VXLAN local bypass on, a packet to a peer whose end is on
        this machine loops back into this device until its TTL runs out (see
        :mod:`hutch.net.vxlan`): refuse that, naming what is needed."""
        if self.bypass_off:
            return
        used = {host for _, host in new.routes}
        local = [p for p in new.peers if p.host in used and is_local_address(p.address)]
        if local:
            ends = ", ".join(f"{p.host} at {p.address}:{p.port}" for p in local)
            raise NetworkError(
                f"tunnel {self.cfg.dev}: the peers {ends} are on this machine, and this "
                "kernel cannot turn the VXLAN local bypass off (IFLA_VXLAN_LOCALBYPASS "
                "needs Linux 6.6 or later): their packets would loop; run one worker per "
                "machine, or a newer kernel"
            )
