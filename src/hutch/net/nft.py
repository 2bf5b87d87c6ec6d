"""Pure renderer of hutch's nftables scripts (no I/O; :mod:`hutch.net.nft_apply` runs them).

One table per daemon, ``inet hutch_<tag>``; every change is one script = one atomic
``nft -f -`` transaction (the old rules stay in force when it fails). Layout::

  prerouting (nat, dstnat)   from taps: udp/tcp 53 -> resolver port; then, unless the
                             destination is a sandbox (peers!), the host or always denied
                             (the filter chains decide those): iifname vmap @px_vmap
    px_<key>                 rules mode: tcp 80/443 -> proxy port unless an ip/cidr rule
  input (filter)             iifname "h<tag>*" -> from_tap: unregistered, IPv6, spoofed
                             dropped; DNS packets / new proxy connections past the
                             sandbox's kernel ceiling dropped; established ok;
                             redirected DNS/proxy ok; rest dropped
  forward (filter)           iifname "h<tag>*" -> egress; oifname "h<tag>*" -> ingress
    egress                   unregistered / IPv6 / spoofed (iifname . ip saddr) dropped,
                             established flows of the current policy ok (est_vmap), jump
                             peers, then host / link-local / sandbox pool / multicast /
                             tcp 25 dropped; iifname vmap @sb_vmap
    e_<key>                  ct mark <policy mark> accept (else back to the caller)
    sb_<key>                 the policy only: open accept | deny-all drop | rules: the
                             a_<key>_* sets accept, udp 443 (QUIC) to learned addresses
                             dropped, else drop (small: a swap is cheap); every accept
                             sets the flow's ct mark to the policy mark
    peers                    ip saddr @net_<nid> ip daddr @net_<nid> accept (per network)
    ingress                  to a tap: established flows of the current policy ok
                             (est_vmap), rest dropped (inbound is closed)
  sent (filter, postrouting) forwarded from a tap out of the host (not to another tap):
                             bytes counted per sandbox (``c_<key>_tx``): what it sent
                             that the filter accepted, for the meter
  postrouting (nat, srcnat)  ip saddr @pool oifname != @taps masquerade
  tunnel_mark (mangle)       with a tunnel (hutch.net.tunnel, workers of a cluster):
                             from taps to the other hosts' pools (@cluster_pools) the
                             mark that routes into the tunnel; out of it, mark 0. The
                             ingress chain then admits tunnel traffic through peers, the
                             input chain takes the tunnel port from @tunnel_peers only,
                             and peer traffic skips the masquerade and the ``sent`` meter.
                             @cluster_pools and @tunnel_peers are always denied (egress).

``<key>`` is the sandbox id's 12 hex digits, ``<nid>`` the network id's. Every denial is
logged to NFLOG group ``nflog_group`` with prefix ``h<tag> <who> <reason>`` (reasons:
:data:`DENY_REASONS`), within a log budget *per sandbox* (``log_budget``: one token
bucket per input interface, shared by every deny rule), so one sandbox's flood cannot use
up another's entries. ``<who>`` is the sandbox id in its own chain (reasons ``policy``,
``quic``) and ``-`` in the shared chains, where the packet's indev (the tap) names the
sandbox.

Named counters per sandbox, read back by :func:`hutch.net.nft_apply.read_counters`:
``c_<key>_allow`` (new connections its policy accepted, and flows it checked again after
a rule change; peer, DNS and proxy traffic not included), ``c_<key>_deny`` (packets
dropped for any reason, shared rules included via the ``deny_ctr`` map),
``c_<key>_nolog`` (of those, the ones past the log budget: not logged one by one) and
``c_<key>_limit`` (DNS packets and new resolver/proxy connections dropped past the kernel
ceiling, :data:`KERNEL_CEILING` times the daemon's limits; not denials, so not in
``deny``), ``c_<key>_tx`` (packets and bytes forwarded from its tap out of the host:
what the meter bills as egress; redirected DNS and proxy traffic is not forwarded, so the
proxy counts what it relays itself). Every counter has bytes as well as packets.

Ordering matters: the source check comes before any conntrack accept, so a guest cannot
inject packets into another sandbox's flows by spoofing its peer's address.

Rule changes reach open connections: the policy chain marks every flow it accepts with
:func:`policy_mark` (a digest of the rule list) and an established flow passes without
a policy check only while its mark is the current one (``e_<key>``). After a swap, the
next packet of an older flow goes through the new policy: accepted (and re-marked), or
dropped and logged. So that a change does not cut flows the new rules still allow, a
flow to an address learned for a name is also accepted while the name stays allowed,
for :data:`KEEP_S` after the name was resolved (``a_<key>_keep``/``_keepport``, checked
for established flows only; new connections need the TTL-bound ``a_<key>_dns`` sets).
The mark is the conntrack mark: hutch owns it for flows forwarded from its taps.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from typing import Literal, Protocol

from hutch.config import NetLimits
from hutch.errors import InvalidArgument
from hutch.net.addressing import sandbox_key, tap_prefix
from hutch.net.tunnel import TunnelConfig

__all__ = [
    "DENY_REASONS",
    "KEEP_S",
    "KERNEL_CEILING",
    "LearnedAddress",
    "PolicyLike",
    "RulesetState",
    "SandboxNet",
    "TableConfig",
    "network_key",
    "policy_mark",
    "render_add_sandbox",
    "render_cluster",
    "render_host_addrs",
    "render_learned",
    "render_networks",
    "render_remove_sandbox",
    "render_replace_policy",
    "render_table",
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

#: Seconds an address learned for a name keeps its established flows alive across rule
#: changes that still allow the name (its DNS TTL only bounds new connections).
KEEP_S = 86400

#: The kernel drops a sandbox's DNS packets and new resolver/proxy connections past this
#: many times the daemon's limits (``NetLimits``): between 1x and this, the daemon answers
#: (REFUSED, or a closed connection) so a client fails fast; past it a flood costs the
#: daemon nothing.
KERNEL_CEILING = 2

_NID_RE = re.compile(r"^net-([0-9a-f]{12})$")
_LINK_LOCAL = (IPv4Network("169.254.0.0/16"),)
_MULTICAST = (
    IPv4Network("0.0.0.0/8"),
    IPv4Network("224.0.0.0/4"),
    IPv4Network("255.255.255.255/32"),
)
_LOOPBACK = IPv4Network("127.0.0.0/8")


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


@dataclass(frozen=True)
class LearnedAddress:
    """An address hutch's resolver answered for an allowed name: new connections to it
    for ``ttl`` seconds (None: no more new ones, e.g. carried over past its TTL), its
    established flows across rule changes for ``keep`` seconds (0: not kept).
    ``port`` None: the name's rule allows any port; else only that port (tcp and udp)."""

    address: IPv4Address
    port: int | None
    ttl: int | None
    keep: int = KEEP_S


@dataclass(frozen=True)
class RulesetState:
    """Everything the full table holds."""

    config: TableConfig
    host_addrs: frozenset[IPv4Address] = frozenset()
    sandboxes: tuple[SandboxNet, ...] = ()
    # network id (net-<12 hex>) -> member guest addresses (members on other hosts too)
    networks: Mapping[str, Sequence[IPv4Address]] = field(default_factory=dict)
    # The other hosts of the cluster: their sandbox pools and tunnel endpoints.
    cluster_pools: tuple[IPv4Network, ...] = ()
    tunnel_peers: tuple[IPv4Address, ...] = ()


def table_name(tag: str) -> str:
    tap_prefix(tag)  # validates
    return f"hutch_{tag}"


def policy_mark(policy: PolicyLike) -> int:
    """The conntrack mark of flows a policy accepted: 32 bits of a digest of its rules
    (never 0, the mark of flows nobody marked). The same rules give the same mark, so a
    daemon restart or a change back to earlier rules does not disturb their flows."""
    text = "\n".join([policy.mode, *policy.texts()])
    mark = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")
    return mark or 1


def network_key(network_id: str) -> str:
    """``net-<12 hex>`` -> ``net_<12 hex>``, the name of its member set."""
    match = _NID_RE.match(network_id)
    if match is None:
        raise InvalidArgument(f"network id {network_id!r} is not net-<12 hex digits>")
    return f"net_{match.group(1)}"


# ---------------------------------------------------------------------------- helpers


def _q(text: str) -> str:
    """A double-quoted nft string. Our strings are generated (hex, ids), never user text,
    but refuse quotes anyway so a bug cannot become an injection."""
    if '"' in text or "\n" in text or "\\" in text:
        raise InvalidArgument(f"{text!r} cannot be used in an nft script")
    return f'"{text}"'


def _elements(items: Iterable[str]) -> str:
    return ", ".join(items)


def _nets(networks: Iterable[IPv4Network]) -> list[str]:
    """Interval-set elements without overlaps (nft refuses overlapping intervals)."""
    collapsed = ipaddress.collapse_addresses(sorted(set(networks)))
    return [str(n.network_address) if n.prefixlen == 32 else str(n) for n in collapsed]


def _net_ports(pairs: Iterable[tuple[IPv4Network, int]]) -> list[str]:
    by_port: dict[int, list[IPv4Network]] = {}
    for net, port in pairs:
        by_port.setdefault(port, []).append(net)
    return [f"{n} . {port}" for port in sorted(by_port) for n in _nets(by_port[port])]


def _deny(
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
    prefix = _q(f"h{cfg.tag} {who} {reason}")
    lim = cfg.limits
    if unlogged is None:
        unlogged = _TAP_NOLOG if counter == _TAP_DENY else ""
    budget = (
        f"update @log_budget {{ iifname limit rate over {lim.deny_log_rate}/second "
        f"burst {lim.deny_log_burst} packets }}"
    )
    return [
        f"{match} {counter}".strip(),
        f"{match} {budget} {unlogged} drop".replace("  ", " ").strip(),
        f"{match} log group {cfg.nflog_group} prefix {prefix} drop".strip(),
    ]


# A sandbox's sets, in the order they are flushed and deleted.
_SETS = ("ip", "ipport", "dns", "dnsport", "keep", "keepport")
# Its named counters, in the order they are deleted.
_COUNTERS = ("allow", "deny", "nolog", "limit", "tx")

# The per-sandbox counters, found by the input interface (shared rules).
_TAP_DENY = "counter name iifname map @deny_ctr"
_TAP_NOLOG = "counter name iifname map @nolog_ctr"
_TAP_LIMITED = "counter name iifname map @limit_ctr"
# Dynamic sets: one token bucket per input interface, forgotten after a minute unused.
_METER = "type ifname; flags dynamic,timeout; timeout 60s; size 65536;"


def _ceilings(cfg: TableConfig) -> list[str]:
    """Kernel ceilings per sandbox (before the conntrack accept: a flood from one socket
    is "established" after the first answer). A flood past them is dropped here, counted
    in the sandbox's ``limit`` counter, and never costs the daemon a wakeup."""
    lim, k = cfg.limits, KERNEL_CEILING
    dns = f"{k * lim.dns_rate}/second burst {k * lim.dns_burst} packets"
    conn = f"{k * lim.proxy_conn_rate}/second burst {k * lim.proxy_conn_burst} packets"
    return [
        f"udp dport {cfg.dns_port} ct status dnat "
        f"update @dns_meter {{ iifname limit rate over {dns} }} {_TAP_LIMITED} drop",
        f"tcp dport {{ {cfg.dns_port}, {cfg.proxy_port} }} ct state new ct status dnat "
        f"update @conn_meter {{ iifname limit rate over {conn} }} {_TAP_LIMITED} drop",
    ]


def _add_element(cfg: TableConfig, obj: str, items: Sequence[str]) -> str:
    return f"add element inet {cfg.table} {obj} {{ {_elements(items)} }}"


# ---------------------------------------------------------------------------- pieces


def _sb_names(key: str) -> dict[str, str]:
    return {
        "chain": f"sb_{key}",
        "px": f"px_{key}",
        "est": f"e_{key}",
        "ip": f"a_{key}_ip",
        "ipport": f"a_{key}_ipport",
        "dns": f"a_{key}_dns",
        "dnsport": f"a_{key}_dnsport",
        "keep": f"a_{key}_keep",
        "keepport": f"a_{key}_keepport",
        "allow": f"c_{key}_allow",
        "deny": f"c_{key}_deny",
        "nolog": f"c_{key}_nolog",
        "limit": f"c_{key}_limit",
        "tx": f"c_{key}_tx",
    }


def _sb_set_decls(cfg: TableConfig, key: str) -> list[str]:
    n, t = _sb_names(key), cfg.table
    return [
        f"add set inet {t} {n['ip']} {{ type ipv4_addr; flags interval; }}",
        f"add set inet {t} {n['ipport']} {{ type ipv4_addr . inet_service; flags interval; }}",
        f"add set inet {t} {n['dns']} {{ type ipv4_addr; flags timeout; }}",
        f"add set inet {t} {n['dnsport']} {{ type ipv4_addr . inet_service; flags timeout; }}",
        f"add set inet {t} {n['keep']} {{ type ipv4_addr; flags timeout; }}",
        f"add set inet {t} {n['keepport']} {{ type ipv4_addr . inet_service; flags timeout; }}",
        f"add counter inet {t} {n['allow']}",
        f"add counter inet {t} {n['deny']}",
        f"add counter inet {t} {n['nolog']}",
        f"add counter inet {t} {n['limit']}",
        f"add counter inet {t} {n['tx']}",
        f"add chain inet {t} {n['chain']}",
        f"add chain inet {t} {n['px']}",
        f"add chain inet {t} {n['est']}",
    ]


def _sb_fill(cfg: TableConfig, sb: SandboxNet) -> list[str]:
    """Elements of the policy sets and the rules of sb_<key> and px_<key> (chains empty)."""
    key, t = sb.key, cfg.table
    n = _sb_names(key)
    policy = sb.policy
    lines: list[str] = []
    # Rules mode: what the ip/cidr rules allow; default allow with ip/cidr denies: the
    # allow rules before them (accepted first, so first match wins).
    lowered = policy.mode == "rules" or (policy.mode == "open" and bool(policy.ip_denied()))
    ips = _nets(policy.ip_networks()) if lowered else []
    ipports = _net_ports(policy.ip_port_networks()) if lowered else []
    if ips:
        lines.append(_add_element(cfg, n["ip"], ips))
    if ipports:
        lines.append(_add_element(cfg, n["ipport"], ipports))

    # The checks every sandbox shares (spoofing, always-denied destinations) ran in the
    # egress chain already; this chain holds only the policy, so a policy swap is small.
    # Every accept marks the flow with this policy (established flows skip the policy
    # only while their mark is current: e_<key>).
    sid, deny = sb.sandbox_id, f"counter name {_q(n['deny'])}"
    nolog = f"counter name {_q(n['nolog'])}"  # its denials past the log budget
    mark = f"{policy_mark(policy):#010x}"
    allow = f"ct mark set {mark} counter name {_q(n['allow'])} accept"
    keep = f"ct mark set {mark} accept"
    rules: list[str] = []
    if policy.mode == "open":
        # Default allow: the allow rules' networks accepted, then the deny rules' dropped
        # (anonymous sets: the chain is refilled whole on a swap), then QUIC dropped
        # when names are checked (its server name is where the proxy does not look),
        # then everything (or, under inspection full, nothing: only DNS and the proxied
        # web ports, which never reach this chain, leave).
        denied = policy.ip_denied()
        if denied:
            if ips:
                rules.append(f"ip daddr @{n['ip']} {allow}")
            if ipports:
                rules.append(f"meta l4proto @tcp_udp ip daddr . th dport @{n['ipport']} {allow}")
            anyport = _nets(net for net, port in denied if port is None)
            if anyport:
                rules += _deny(cfg, f"ip daddr {{ {_elements(anyport)} }}", sid, "policy", deny,
                               nolog)  # fmt: skip
            ported = _net_ports((net, port) for net, port in denied if port is not None)
            if ported:
                match = f"meta l4proto @tcp_udp ip daddr . th dport {{ {_elements(ported)} }}"
                rules += _deny(cfg, match, sid, "policy", deny, nolog)
        if policy.screened:
            rules += _deny(cfg, "udp dport 443", sid, "quic", deny, nolog)
        if not policy.web_only:
            rules.append(allow)
    elif policy.mode == "rules":
        # th dport reads bytes 2-3 of any transport header (an ICMP checksum!), so the
        # port sets only apply to TCP and UDP.
        rules.append(f"ip daddr @{n['ip']} {allow}")
        rules.append(f"meta l4proto @tcp_udp ip daddr . th dport @{n['ipport']} {allow}")
        # QUIC carries its server name where the proxy does not look: UDP 443 goes only
        # where an ip/cidr rule (above) allows it, never to an address learned for a
        # name (below); clients fall back to TCP 443, whose SNI the proxy checks.
        rules += _deny(cfg, "udp dport 443", sid, "quic", deny, nolog)
        rules.append(f"ip daddr @{n['dns']} {allow}")
        rules.append(f"meta l4proto @tcp_udp ip daddr . th dport @{n['dnsport']} {allow}")
        established = "ct state established,related"
        rules.append(f"{established} ip daddr @{n['keep']} {keep}")
        rules.append(
            f"{established} meta l4proto @tcp_udp ip daddr . th dport @{n['keepport']} {keep}"
        )
    rules += _deny(cfg, "", sid, "policy", deny, nolog)
    lines += [f"add rule inet {t} {n['chain']} {r}" for r in rules]
    lines.append(f"add rule inet {t} {n['est']} ct mark {mark} accept")

    if policy.mode == "rules" or policy.screened:
        # Web traffic goes through the proxy, which checks SNI/Host against the rules and
        # connects to what the host resolved; an explicit ip/cidr rule skips it.
        lines += [
            f"add rule inet {t} {n['px']} ip daddr @{n['ip']} return",
            f"add rule inet {t} {n['px']} ip daddr . tcp dport @{n['ipport']} return",
            f"add rule inet {t} {n['px']} tcp dport @web_ports redirect to :{cfg.proxy_port}",
        ]
    elif policy.observe is not None:
        # Learn / dry run: everything passes, but the proxy sees (and logs) web traffic.
        lines.append(
            f"add rule inet {t} {n['px']} tcp dport @web_ports redirect to :{cfg.proxy_port}"
        )
    return lines


def _sb_elements(sb: SandboxNet) -> list[tuple[str, str]]:
    """(object, element) pairs that register a sandbox's tap in the shared sets/maps."""
    n, tap = _sb_names(sb.key), _q(sb.tap)
    return [
        ("taps", tap),
        ("tap_src", f"{tap} . {sb.guest}"),
        ("sb_vmap", f"{tap} : jump {n['chain']}"),
        ("px_vmap", f"{tap} : jump {n['px']}"),
        ("est_vmap", f"{tap} : jump {n['est']}"),
        ("deny_ctr", f"{tap} : {_q(n['deny'])}"),
        ("nolog_ctr", f"{tap} : {_q(n['nolog'])}"),
        ("limit_ctr", f"{tap} : {_q(n['limit'])}"),
        ("tx_ctr", f"{tap} : {_q(n['tx'])}"),
    ]


def _sb_register(cfg: TableConfig, sandboxes: Iterable[SandboxNet]) -> list[str]:
    """One ``add element`` per shared object (batched: far fewer commands for nft)."""
    by_obj: dict[str, list[str]] = {}
    for sb in sandboxes:
        for obj, elem in _sb_elements(sb):
            by_obj.setdefault(obj, []).append(elem)
    return [_add_element(cfg, obj, elems) for obj, elems in by_obj.items()]


def _skeleton(cfg: TableConfig, host_addrs: Iterable[IPv4Address]) -> str:
    wildcard = _q(tap_prefix(cfg.tag) + "*")
    hosts = _host_elements(host_addrs)
    # Shared checks first, in this order: the tap must be registered (else no counter
    # exists for it), IPv4 only, source must be the sandbox's own address (before any
    # conntrack accept, so a guest cannot inject into another sandbox's flows).
    checks = [
        *_deny(cfg, "iifname != @taps", "-", "unregistered", "counter"),
        *_deny(cfg, "meta nfproto ipv6", "-", "ipv6", _TAP_DENY),
        *_deny(cfg, "iifname . ip saddr != @tap_src", "-", "spoof", _TAP_DENY),
    ]
    from_tap = [
        *checks,
        # Before the conntrack accept: a flood from one socket is established after its
        # first answer, and must still meet the ceiling.
        *_ceilings(cfg),
        # Replies of the host's own connections (exposed ports) and of redirected DNS
        # and proxy traffic: the resolver and the proxy apply rule changes themselves.
        "ct state established,related accept",
        # Only connections nft redirected reach the resolver and proxy: a guest cannot
        # address them (or anything else on the host) directly.
        f"ct status dnat udp dport {cfg.dns_port} accept",
        f"ct status dnat tcp dport {{ {cfg.dns_port}, {cfg.proxy_port} }} accept",
        *_deny(cfg, "", "-", "host", _TAP_DENY),
    ]
    egress = [
        *checks,
        # An established flow goes on only under the policy that accepted it (its mark);
        # older ones fall through to the checks below, as a new connection would.
        "ct state established,related iifname vmap @est_vmap",
        # Members of a shared private network reach each other whatever their policies.
        "jump peers",
        *_deny(cfg, "ip daddr @host_addrs", "-", "host", _TAP_DENY),
        # The other hosts' tunnel endpoints are hosts too (the overlay is never the
        # guest's to address); their sandboxes are sandboxes (peers passed above).
        *_deny(cfg, "ip daddr @tunnel_peers", "-", "host", _TAP_DENY),
        *_deny(cfg, "ip daddr @link_local", "-", "link-local", _TAP_DENY),
        *_deny(cfg, "ip daddr @pool", "-", "sandbox", _TAP_DENY),
        *_deny(cfg, "ip daddr @cluster_pools", "-", "sandbox", _TAP_DENY),
        *_deny(cfg, "ip daddr @multicast", "-", "multicast", _TAP_DENY),
        *_deny(cfg, "tcp dport 25", "-", "smtp", _TAP_DENY),
        "iifname vmap @sb_vmap",
        # Unreachable while sb_vmap and taps agree (they change in one transaction).
        *_deny(cfg, "", "-", "unregistered", "counter"),
    ]

    link_local = _elements(_nets(_LINK_LOCAL))
    multicast = _elements(_nets(_MULTICAST))

    def body(rules: list[str]) -> str:
        return "\n".join(f"    {r}" for r in rules)

    t = _TunnelRules.of(cfg)

    return f"""table inet {cfg.table} {{
  set taps {{ type ifname; }}
  set tap_src {{ type ifname . ipv4_addr; }}
  set host_addrs {{ type ipv4_addr; flags interval; elements = {{ {_elements(hosts)} }} }}
  set link_local {{ type ipv4_addr; flags interval; elements = {{ {link_local} }} }}
  set multicast {{ type ipv4_addr; flags interval; elements = {{ {multicast} }} }}
  set pool {{ type ipv4_addr; flags interval; elements = {{ {cfg.pool} }} }}
  set cluster_pools {{ type ipv4_addr; flags interval; }}
  set tunnel_peers {{ type ipv4_addr; flags interval; }}
  set tcp_udp {{ type inet_proto; elements = {{ tcp, udp }} }}
  set web_ports {{ type inet_service; elements = {{ 80, 443 }} }}
  map sb_vmap {{ type ifname : verdict; }}
  map px_vmap {{ type ifname : verdict; }}
  map est_vmap {{ type ifname : verdict; }}
  map deny_ctr {{ type ifname : counter; }}
  map nolog_ctr {{ type ifname : counter; }}
  map limit_ctr {{ type ifname : counter; }}
  map tx_ctr {{ type ifname : counter; }}
  set log_budget {{ {_METER} }}
  set dns_meter {{ {_METER} }}
  set conn_meter {{ {_METER} }}
  chain peers {{
  }}
  chain from_tap {{
{body(from_tap)}
  }}
  chain egress {{
{body(egress)}
  }}
  chain ingress {{
    meta nfproto ipv6 drop
    ct state established,related oifname vmap @est_vmap{t.ingress}
    counter drop
  }}
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname @taps meta nfproto ipv4 udp dport 53 redirect to :{cfg.dns_port}
    iifname @taps meta nfproto ipv4 tcp dport 53 redirect to :{cfg.dns_port}
    iifname != @taps accept
    ip daddr @pool accept
    ip daddr @cluster_pools accept
    ip daddr @host_addrs accept
    ip daddr @tunnel_peers accept
    ip daddr @link_local accept
    ip daddr @multicast accept
    iifname vmap @px_vmap
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname {wildcard} jump from_tap{t.input}
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    iifname {wildcard} jump egress
    oifname {wildcard} jump ingress
  }}
  chain sent {{
    type filter hook postrouting priority filter; policy accept;{t.skip}
    iifname @taps oifname != @taps counter name iifname map @tx_ctr
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;{t.nat}
    ip saddr @pool oifname != @taps masquerade
  }}{t.mark}{_vmm_output(cfg)}
}}
"""


@dataclass(frozen=True)
class _TunnelRules:
    """The skeleton's lines for the overlay (each starts with a newline; empty without
    a tunnel). Packets from this daemon's taps to the other hosts' pools get the mark
    that routes them into the tunnel (``mark``); packets out of the tunnel lose any mark
    (one machine: the same skb must not loop back in). What arrives through the tunnel
    for a tap passes only between members of one network (``ingress``: the peers chain,
    as on the sending host). The tunnel's UDP port takes only the peers' endpoints
    (``input``). Peer traffic is neither NATed nor metered as egress (``skip``)."""

    mark: str = ""
    ingress: str = ""
    input: str = ""
    skip: str = ""
    nat: str = ""

    @classmethod
    def of(cls, cfg: TableConfig) -> _TunnelRules:
        tun = cfg.tunnel
        if tun is None:
            return cls()
        dev = _q(tun.dev)
        return cls(
            mark=f"""
  chain tunnel_mark {{
    type filter hook prerouting priority mangle; policy accept;
    iifname {dev} meta mark set 0
    iifname @taps ip daddr @cluster_pools meta mark set {tun.mark:#x}
  }}""",
            ingress=f"\n    iifname {dev} jump peers",
            input=f"\n    udp dport {tun.port} ip saddr != @tunnel_peers counter drop",
            skip=f"\n    oifname {dev} return",
            # On one machine a peer's packet also leaves through the other worker's
            # tap, past this table's masquerade: never NAT traffic between members.
            nat=f"\n    oifname {dev} return\n    ip daddr @cluster_pools return",
        )


def _vmm_output(cfg: TableConfig) -> str:
    if cfg.vmm_uid is None:
        return ""
    return f"""
  chain output {{
    type filter hook output priority filter; policy accept;
    meta skuid {cfg.vmm_uid} counter drop
  }}"""


def _host_elements(host_addrs: Iterable[IPv4Address]) -> list[str]:
    # Loopback is always the host's, whatever `ip addr` says.
    return _nets([_LOOPBACK, *(IPv4Network(a) for a in host_addrs)])


# ---------------------------------------------------------------------------- public


def render_table(state: RulesetState) -> str:
    """The whole table: delete it if it exists and create it anew, in one transaction."""
    cfg = state.config
    lines = [
        f"add table inet {cfg.table}",
        f"delete table inet {cfg.table}",
        _skeleton(cfg, state.host_addrs),
    ]
    for sb in state.sandboxes:
        lines += _sb_set_decls(cfg, sb.key)
        lines += _sb_fill(cfg, sb)
    lines += _sb_register(cfg, state.sandboxes)
    lines.append(render_networks(cfg, state.networks))
    lines.append(render_cluster(cfg, state.cluster_pools, state.tunnel_peers))
    return "\n".join(lines) + "\n"


def render_add_sandbox(cfg: TableConfig, sb: SandboxNet) -> str:
    """Register one sandbox (sets, counters, chains, tap). Re-running it is harmless:
    its chains are flushed and refilled, its policy sets refilled."""
    n = _sb_names(sb.key)
    lines = _sb_set_decls(cfg, sb.key)
    lines += [
        f"flush chain inet {cfg.table} {n['chain']}",
        f"flush chain inet {cfg.table} {n['px']}",
        f"flush chain inet {cfg.table} {n['est']}",
        f"flush set inet {cfg.table} {n['ip']}",
        f"flush set inet {cfg.table} {n['ipport']}",
    ]
    lines += _sb_fill(cfg, sb)
    lines += _sb_register(cfg, [sb])
    return "\n".join(lines) + "\n"


def render_remove_sandbox(cfg: TableConfig, sb: SandboxNet) -> str:
    """Unregister one sandbox and delete its objects. Idempotent: every object is first
    added (a no-op when present) so that deleting it cannot fail on a missing one."""
    t = cfg.table
    n = _sb_names(sb.key)
    lines = _sb_set_decls(cfg, sb.key) + _sb_register(cfg, [sb])
    tap = _q(sb.tap)
    lines += [
        f"delete element inet {t} deny_ctr {{ {tap} }}",
        f"delete element inet {t} nolog_ctr {{ {tap} }}",
        f"delete element inet {t} limit_ctr {{ {tap} }}",
        f"delete element inet {t} tx_ctr {{ {tap} }}",
        f"delete element inet {t} est_vmap {{ {tap} }}",
        f"delete element inet {t} px_vmap {{ {tap} }}",
        f"delete element inet {t} sb_vmap {{ {tap} }}",
        f"delete element inet {t} tap_src {{ {tap} . {sb.guest} }}",
        f"delete element inet {t} taps {{ {tap} }}",
        f"flush chain inet {t} {n['chain']}",
        f"flush chain inet {t} {n['px']}",
        f"flush chain inet {t} {n['est']}",
        f"delete chain inet {t} {n['chain']}",
        f"delete chain inet {t} {n['px']}",
        f"delete chain inet {t} {n['est']}",
    ]
    lines += [f"delete set inet {t} {n[k]}" for k in _SETS]
    lines += [f"delete counter inet {t} {n[k]}" for k in _COUNTERS]
    return "\n".join(lines) + "\n"


def render_replace_policy(
    cfg: TableConfig, sb: SandboxNet, learned: Iterable[LearnedAddress] = ()
) -> str:
    """Swap one sandbox's policy: flush and refill its sets and chains in one transaction.

    DNS-learned addresses (and the kept ones) are flushed too (the old policy's names
    may no longer be allowed); pass those still allowed in ``learned`` to keep them.
    The new policy's mark makes established flows of the old one pass its check again.
    """
    t, n = cfg.table, _sb_names(sb.key)
    lines = [f"flush set inet {t} {n[k]}" for k in _SETS]
    lines += [f"flush chain inet {t} {n[k]}" for k in ("chain", "px", "est")]
    lines += _sb_fill(cfg, sb)
    return "\n".join(lines) + "\n" + render_learned(cfg, sb.sandbox_id, learned)


def render_learned(cfg: TableConfig, sandbox_id: str, learned: Iterable[LearnedAddress]) -> str:
    """Add DNS-learned addresses with their timeouts (``ttl`` in the sets new connections
    use, ``keep`` in those established flows use). An address already present gets its
    timeout refreshed (add, delete, add: the first add makes the delete safe)."""
    n = _sb_names(sandbox_key(sandbox_id))
    lines: list[str] = []
    for item in learned:
        if item.port is None:
            objs, elem = (n["dns"], n["keep"]), str(item.address)
        else:
            objs, elem = (n["dnsport"], n["keepport"]), f"{item.address} . {item.port}"
        for obj, seconds in zip(objs, (item.ttl, item.keep), strict=True):
            if seconds is None or (obj in (n["keep"], n["keepport"]) and seconds <= 0):
                continue
            timeout = max(1, int(seconds))
            base = f"inet {cfg.table} {obj} {{ {elem}"
            lines += [
                f"add element {base} timeout {timeout}s }}",
                f"delete element {base} }}",
                f"add element {base} timeout {timeout}s }}",
            ]
    return "\n".join(lines) + ("\n" if lines else "")


def render_networks(
    cfg: TableConfig,
    networks: Mapping[str, Sequence[IPv4Address]],
    removed: Iterable[str] = (),
) -> str:
    """Make the private networks exactly ``networks`` (id -> member addresses): their
    member sets and the peers chain. ``removed``: ids whose sets are deleted."""
    t = cfg.table
    lines = [f"flush chain inet {t} peers"]
    for nid in sorted(networks):
        key = network_key(nid)
        lines += [
            f"add set inet {t} {key} {{ type ipv4_addr; }}",
            f"flush set inet {t} {key}",
        ]
        members = sorted(set(networks[nid]))
        if members:
            lines.append(_add_element(cfg, key, [str(a) for a in members]))
        if len(members) >= 2:
            lines.append(f"add rule inet {t} peers ip saddr @{key} ip daddr @{key} accept")
    for nid in removed:
        if nid in networks:
            continue
        key = network_key(nid)
        lines += [f"add set inet {t} {key} {{ type ipv4_addr; }}", f"delete set inet {t} {key}"]
    return "\n".join(lines) + "\n"


def render_host_addrs(cfg: TableConfig, host_addrs: Iterable[IPv4Address]) -> str:
    """Replace the host's own addresses (call again when the host's addresses change)."""
    elems = _elements(_host_elements(host_addrs))
    return (
        f"flush set inet {cfg.table} host_addrs\n"
        f"add element inet {cfg.table} host_addrs {{ {elems} }}\n"
    )


def render_cluster(
    cfg: TableConfig, pools: Iterable[IPv4Network], peers: Iterable[IPv4Address]
) -> str:
    """Make the other hosts' sandbox pools and tunnel endpoints exactly these (both
    always denied to this daemon's sandboxes; peers on shared networks pass first)."""
    t = cfg.table
    lines = [f"flush set inet {t} cluster_pools", f"flush set inet {t} tunnel_peers"]
    nets = _nets(pools)
    if nets:
        lines.append(_add_element(cfg, "cluster_pools", nets))
    hosts = _nets(IPv4Network(a) for a in peers)
    if hosts:
        lines.append(_add_element(cfg, "tunnel_peers", hosts))
    return "\n".join(lines) + "\n"
