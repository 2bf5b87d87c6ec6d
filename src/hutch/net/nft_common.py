"""What every part of hutch's nft renderer shares (pure, no I/O): the table's fixed
config, the sandbox as the dataplane sees it, and the text helpers that build rules.

The renderer is three modules on top of this one: :mod:`hutch.net.nft` (the table: its
skeleton and the shared sets), :mod:`hutch.net.nft_sandbox` (one sandbox's objects and
policy chains) and :mod:`hutch.net.nft_tunnel` (the skeleton's lines for the overlay).
The layout of the table they render is drawn in :mod:`hutch.net.nft`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from typing import Literal, Protocol

from hutch.config import NetLimits
from hutch.errors import InvalidArgument
from hutch.net.addressing import sandbox_key, tap_prefix
from hutch.net.tunnel import TunnelConfig

__all__ = [
    "DENY_REASONS",
    "TAP_DENY",
    "TAP_LIMITED",
    "TAP_NOLOG",
    "PolicyLike",
    "SandboxNet",
    "TableConfig",
    "add_element",
    "deny_rules",
    "elements",
    "net_elements",
    "net_port_elements",
    "quote",
    "table_name",
]

# The reason word at the end of each NFLOG prefix (hutch.net.nflog hands it back).
DENY_REASONS = (
    "unregistered",  # a h<tag>* interface hutch does not know
    "ipv6",  # the data path is IPv4 only
    "spoof",  # source address is not the sandbox's own
    "host",  # the host's own addresses (daemon API included)
    "link-local",  # 169.254.0.0/16: cloud metadata
    "sandbox",  # another sandbox, not a peer on a shared network
    "multicast",  # multicast, broadcast, 0.0.0.0/8
    "smtp",  # tcp port 25
    "policy",  # the sandbox's egress policy does not allow it
    "quic",  # udp 443 in rules mode without an ip/cidr rule for it (no SNI check)
)

# The per-sandbox counters, found by the input interface (shared rules).
TAP_DENY = "counter name iifname map @deny_ctr"
TAP_NOLOG = "counter name iifname map @nolog_ctr"
TAP_LIMITED = "counter name iifname map @limit_ctr"


class PolicyLike(Protocol):
    """What the renderer needs of ``hutch.net.rules.EgressPolicy``."""

    @property
    def mode(self) -> Literal["open", "rules", "deny-all"]: ...

    @property
    def observe(self) -> str | None:
        """Not None: open, but web traffic still goes through the proxy (learn, dry run)."""
        ...

    @property
    def screened(self) -> bool:
        """Open, less what it denies, with web traffic through the proxy (default allow
        with name denies, request rules or inspection full)."""
        ...

    @property
    def web_only(self) -> bool:
        """Screened, and nothing but DNS and the proxied web ports leaves (full)."""
        ...

    def ip_networks(self) -> list[IPv4Network]: ...

    def ip_port_networks(self) -> list[tuple[IPv4Network, int]]: ...

    def ip_denied(self) -> list[tuple[IPv4Network, int | None]]: ...

    def texts(self) -> list[str]: ...


@dataclass(frozen=True)
class TableConfig:
    """What stays fixed for the life of one daemon's table."""

    tag: str  # 4 hex digits (Settings.daemon_tag)
    pool: IPv4Network  # Settings.net_pool
    dns_port: int  # hutch's resolver, UDP and TCP, bound on 0.0.0.0
    proxy_port: int  # hutch's SNI/Host proxy, TCP
    nflog_group: int  # NFLOG group the denials go to (0..65535)
    # QEMU's unprivileged uid (hutch.vm.runas): IP traffic it originates is dropped. It
    # needs none (its NIC is a tap, its channels unix sockets); a QEMU that escaped its
    # guest must not get the network its guest's rules deny. None: no such rule.
    vmm_uid: int | None = None
    # Per-sandbox log budget and the kernel ceilings (KERNEL_CEILING x these).
    limits: NetLimits = field(default_factory=NetLimits)
    # This daemon's end of the overlay between hosts (hutch.net.tunnel); None: no
    # tunnel rules (one host).
    tunnel: TunnelConfig | None = None

    def __post_init__(self) -> None:
        tap_prefix(self.tag)  # validates the tag
        for what, port in (("dns_port", self.dns_port), ("proxy_port", self.proxy_port)):
            if not 0 < port < 65536:
                raise InvalidArgument(f"{what} {port} is not a TCP/UDP port (1..65535)")
        if not 0 <= self.nflog_group < 65536:
            raise InvalidArgument(f"nflog_group {self.nflog_group} is not in 0..65535")
        if self.vmm_uid is not None and not 0 < self.vmm_uid < 1 << 32:
            raise InvalidArgument(f"vmm_uid {self.vmm_uid} is not a non-root uid")

    @property
    def table(self) -> str:
        return table_name(self.tag)


@dataclass(frozen=True)
class SandboxNet:
    """One sandbox with network ``default``, as the dataplane sees it."""

    sandbox_id: str  # sb-<12 hex>
    tap: str  # its tap (tap_name(tag, sandbox_id))
    guest: IPv4Address  # the guest's address (anti-spoof)
    policy: PolicyLike

    @property
    def key(self) -> str:
        return sandbox_key(self.sandbox_id)


def table_name(tag: str) -> str:
    tap_prefix(tag)  # validates
    return f"hutch_{tag}"


def quote(text: str) -> str:
    """A double-quoted nft string. Our strings are generated (hex, ids), never user text,
    but refuse quotes anyway so a bug cannot become an injection."""
    if '"' in text or "\n" in text or "\\" in text:
        raise InvalidArgument(f"{text!r} cannot be used in an nft script")
    return f'"{text}"'


def elements(items: Iterable[str]) -> str:
    """The inside of an nft ``{ ... }`` element list."""
    return ", ".join(items)


def net_elements(networks: Iterable[IPv4Network]) -> list[str]:
    """Interval-set elements without overlaps (nft refuses overlapping intervals)."""
    collapsed = ipaddress.collapse_addresses(sorted(set(networks)))
    return [str(n.network_address) if n.prefixlen == 32 else str(n) for n in collapsed]


def net_port_elements(pairs: Iterable[tuple[IPv4Network, int]]) -> list[str]:
    """``network . port`` elements, collapsed per port (by port, then address)."""
    by_port: dict[int, list[IPv4Network]] = {}
    for net, port in pairs:
        by_port.setdefault(port, []).append(net)
    return [f"{n} . {port}" for port in sorted(by_port) for n in net_elements(by_port[port])]


def add_element(cfg: TableConfig, obj: str, items: Sequence[str]) -> str:
    """One ``add element`` command for all of ``items`` (batched: fewer commands)."""
    return f"add element inet {cfg.table} {obj} {{ {elements(items)} }}"


def deny_rules(
    cfg: TableConfig,
    match: str,
    who: str,
    reason: str,
    counter: str,
    unlogged: str | None = None,
) -> list[str]:
    """Three rules: count; past the interface's log budget, count as unlogged and drop;
    else log and drop. The count stands alone so that a counter-map miss (which ends a
    rule) can only skip counting, and each of the other two ends in its own drop (a miss
    in the second falls through to the third, which drops too). ``unlogged``: the
    counter of denials past the budget (default: the tap's, for the shared rules)."""
    prefix = quote(f"h{cfg.tag} {who} {reason}")
    lim = cfg.limits
    if unlogged is None:
        unlogged = TAP_NOLOG if counter == TAP_DENY else ""
    budget = (
        f"update @log_budget {{ iifname limit rate over {lim.deny_log_rate}/second "
        f"burst {lim.deny_log_burst} packets }}"
    )
    return [
        f"{match} {counter}".strip(),
        f"{match} {budget} {unlogged} drop".replace("  ", " ").strip(),
        f"{match} log group {cfg.nflog_group} prefix {prefix} drop".strip(),
    ]
