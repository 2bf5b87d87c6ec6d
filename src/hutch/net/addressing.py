"""Sandbox addresses and host-side names (pure, except :func:`host_addresses`).

Every sandbox with network ``default`` takes one /30 of the daemon's IPv4 pool
(``Settings.net_pool``): block ``i`` is ``base + 4*i``; its ``.1`` is the host side of
the tap (gateway and DNS server for the guest), its ``.2`` is the guest. Block 0 is
never handed out, so the pool's network address never names a sandbox.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address

from hutch.errors import Capacity, InvalidArgument, NetworkError

__all__ = [
    "ALWAYS_DENIED_NETWORKS",
    "PRIVATE_NETWORKS",
    "AddressPool",
    "Block",
    "host_addresses",
    "is_forbidden_destination",
    "parse_ip_addr_json",
    "sandbox_key",
    "tap_name",
    "tap_prefix",
]

# Destinations no sandbox reaches, even with open egress (the nft ruleset drops them; the
# proxy and resolver refuse names resolving into them). Link-local covers cloud metadata
# (169.254.169.254); 0.0.0.0/8 and multicast/broadcast are never a real peer.
ALWAYS_DENIED_NETWORKS: tuple[IPv4Network, ...] = (
    IPv4Network("169.254.0.0/16"),
    IPv4Network("127.0.0.0/8"),
    IPv4Network("0.0.0.0/8"),
    IPv4Network("224.0.0.0/4"),
    IPv4Network("255.255.255.255/32"),
)

# Ranges a *name* must not resolve into (DNS rebinding; only an explicit ip/cidr rule
# opens them, see hutch.net.destinations): private and shared address space, reserved
# 240/4, each with the words the egress log uses. 198.18.0.0/15 (benchmarking) is
# deliberately allowed: the test suites use it as their fake internet.
PRIVATE_NETWORKS: dict[IPv4Network, str] = {
    IPv4Network("10.0.0.0/8"): "private range 10.0.0.0/8",
    IPv4Network("172.16.0.0/12"): "private range 172.16.0.0/12",
    IPv4Network("192.168.0.0/16"): "private range 192.168.0.0/16",
    IPv4Network("100.64.0.0/10"): "shared (CGNAT) range 100.64.0.0/10",
    IPv4Network("240.0.0.0/4"): "reserved range 240.0.0.0/4",
}

_SID_RE = re.compile(r"^sb-([0-9a-f]{12})$")
_TAG_RE = re.compile(r"^[0-9a-f]{4}$")


@dataclass(frozen=True)
class Block:
    """One sandbox's /30: ``gateway`` is the host side of the tap, ``guest`` the VM."""

    index: int
    network: IPv4Network
    gateway: IPv4Address
    guest: IPv4Address
    prefix: int = 30

    @property
    def guest_cidr(self) -> str:
        """The guest's address with its prefix, as the agent ``hello`` carries it."""
        return f"{self.guest}/{self.prefix}"


class AddressPool:
    """Hands out /30 blocks of an IPv4 pool by index (the store keeps the indices)."""

    def __init__(self, cidr: IPv4Network | str) -> None:
        try:
            network = IPv4Network(cidr)
        except ValueError as exc:
            raise InvalidArgument(
                f"network pool {cidr!r} is not an IPv4 CIDR (example: 10.213.0.0/16)"
            ) from exc
        if network.prefixlen > 29:
            raise InvalidArgument(
                f"network pool {network} is too small: it needs room for at least two /30 "
                "blocks (use a /29 or larger, e.g. 10.213.0.0/16)"
            )
        self.network = network

    def __repr__(self) -> str:
        return f"AddressPool({str(self.network)!r})"

    @property
    def capacity(self) -> int:
        """How many sandboxes fit (block 0 is never used)."""
        return self.network.num_addresses // 4 - 1

    def block(self, index: int) -> Block:
        """Block ``index`` (1..capacity). Raises ``InvalidArgument`` outside that range."""
        if not 1 <= index <= self.capacity:
            raise InvalidArgument(
                f"address block {index} is outside pool {self.network} (1..{self.capacity})"
            )
        base = int(self.network.network_address) + 4 * index
        return Block(
            index=index,
            network=IPv4Network((base, 30)),
            gateway=IPv4Address(base + 1),
            guest=IPv4Address(base + 2),
        )

    def first_free(self, used: Iterable[int]) -> int:
        """The lowest block index not in ``used``. Raises ``Capacity`` when all are taken."""
        taken = set(used)
        for index in range(1, self.capacity + 1):
            if index not in taken:
                return index
        raise Capacity(
            f"all {self.capacity} addresses of network pool {self.network} are in use; "
            "delete sandboxes or set a larger HUTCH_NET_POOL"
        )

    def index_of(self, address: IPv4Address | str) -> int | None:
        """The block index holding ``address`` (gateway or guest), None if outside."""
        addr = IPv4Address(address)
        if addr not in self.network:
            return None
        index = (int(addr) - int(self.network.network_address)) // 4
        return index if index >= 1 else None

    def __contains__(self, address: object) -> bool:
        return isinstance(address, IPv4Address) and address in self.network


def sandbox_key(sandbox_id: str) -> str:
    """The 12 hex digits of ``sb-<12 hex>``: the per-sandbox part of nft object names."""
    match = _SID_RE.match(sandbox_id)
    if match is None:
        raise InvalidArgument(f"sandbox id {sandbox_id!r} is not sb-<12 hex digits>")
    return match.group(1)


def tap_prefix(tag: str) -> str:
    """``h<tag>``: every tap of one daemon starts with it (nft drops unregistered ones)."""
    if not _TAG_RE.match(tag):
        raise InvalidArgument(f"daemon tag {tag!r} is not 4 lower-case hex digits")
    return f"h{tag}"


def tap_name(tag: str, sandbox_id: str) -> str:
    """``h<tag><sid hex[:10]>``: 15 characters, the kernel's limit for interface names."""
    return tap_prefix(tag) + sandbox_key(sandbox_id)[:10]


def guest_mac(sandbox_id: str) -> str:
    """The sandbox's own MAC: locally administered (02:…), from its id. A clone wakes
    up with the MAC saved in the snapshot it came from, so the agent sets this one."""
    digest = hashlib.sha256(f"hutch-mac:{sandbox_id}".encode()).digest()
    return ":".join(f"{b:02x}" for b in (0x02, *digest[:5]))


def parse_ip_addr_json(text: str) -> frozenset[IPv4Address]:
    """Every IPv4 address in ``ip -j addr`` output."""
    try:
        links = json.loads(text)
    except json.JSONDecodeError as exc:
        raise NetworkError(f"`ip -j addr` printed something that is not JSON: {exc}") from exc
    found: set[IPv4Address] = set()
    for link in links:
        for info in link.get("addr_info", []):
            if info.get("family") == "inet" and "local" in info:
                found.add(IPv4Address(info["local"]))
    return frozenset(found)


async def host_addresses(netns: str | None = None) -> frozenset[IPv4Address]:
    """All IPv4 addresses on the host's interfaces (``ip -j addr``), in ``netns`` if given.

    Raises ``NetworkError`` when ``ip`` fails.
    """
    from hutch.net.links import run_ip  # late: links imports nothing from here at load

    out = await run_ip(["-j", "addr", "show"], netns=netns)
    return parse_ip_addr_json(out)


def is_forbidden_destination(
    addr: IPv4Address | IPv6Address | str,
    pool: AddressPool | IPv4Network | None = None,
    host_addrs: Iterable[IPv4Address] = (),
) -> bool:
    """True when a name resolving to ``addr`` must be refused (DNS rebinding), or when
    ``addr`` is always denied: loopback, link-local (cloud metadata), private and CGNAT
    ranges, reserved 240/4, multicast/broadcast, unspecified, the sandbox pool and the
    host's own addresses (``host_addrs``). IPv6 is refused wholesale: the data path is
    IPv4 only. :func:`hutch.net.destinations.classify_destination` says which and why.
    """
    from hutch.net.destinations import classify_destination  # late: it imports this module

    hosts = set(host_addrs)
    return classify_destination(addr, pool, hosts.__contains__) is not None
