"""Pure renderer of hutch's nftables table (no I/O; :mod:`hutch.net.nft_apply` runs it):
the whole table and its shared sets (networks, host addresses, cluster).

The renderer's other parts: :mod:`hutch.net.nft_common` (the config, the sandbox view
and the text helpers all of them share), :mod:`hutch.net.nft_sandbox` (one sandbox's
objects, policy chains and changes) and :mod:`hutch.net.nft_tunnel` (the overlay's
lines in the skeleton below).

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
:data:`~hutch.net.nft_common.DENY_REASONS`), within a log budget *per sandbox*
(``log_budget``: one token bucket per input interface, shared by every deny rule), so one
sandbox's flood cannot use up another's entries. ``<who>`` is the sandbox id in its own
chain (reasons ``policy``, ``quic``) and ``-`` in the shared chains, where the packet's
indev (the tap) names the sandbox.

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
:func:`~hutch.net.nft_sandbox.policy_mark` (a digest of the rule list) and an
established flow passes without a policy check only while its mark is the current one
(``e_<key>``). After a swap, the next packet of an older flow goes through the new
policy: accepted (and re-marked), or dropped and logged. So that a change does not cut
flows the new rules still allow, a flow to an address learned for a name is also
accepted while the name stays allowed, for :data:`~hutch.net.nft_sandbox.KEEP_S` after
the name was resolved (``a_<key>_keep``/``_keepport``, checked for established flows
only; new connections need the TTL-bound ``a_<key>_dns`` sets).
The mark is the conntrack mark: hutch owns it for flows forwarded from its taps.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network

from hutch.errors import InvalidArgument
from hutch.net.addressing import tap_prefix
from hutch.net.nft_common import (
    TAP_DENY,
    TAP_LIMITED,
    SandboxNet,
    TableConfig,
    add_element,
    deny_rules,
    elements,
    net_elements,
    quote,
)
from hutch.net.nft_sandbox import sandbox_decls, sandbox_fill, sandbox_register
from hutch.net.nft_tunnel import TunnelRules

__all__ = [
    "KERNEL_CEILING",
    "RulesetState",
    "network_key",
    "render_cluster",
    "render_host_addrs",
    "render_networks",
    "render_table",
]

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
# Dynamic sets: one token bucket per input interface, forgotten after a minute unused.
_METER = "type ifname; flags dynamic,timeout; timeout 60s; size 65536;"


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


def network_key(network_id: str) -> str:
    """``net-<12 hex>`` -> ``net_<12 hex>``, the name of its member set."""
    match = _NID_RE.match(network_id)
    if match is None:
        raise InvalidArgument(f"network id {network_id!r} is not net-<12 hex digits>")
    return f"net_{match.group(1)}"


def _ceilings(cfg: TableConfig) -> list[str]:
    """Kernel ceilings per sandbox (before the conntrack accept: a flood from one socket
    is "established" after the first answer). A flood past them is dropped here, counted
    in the sandbox's ``limit`` counter, and never costs the daemon a wakeup."""
    lim, k = cfg.limits, KERNEL_CEILING
    dns = f"{k * lim.dns_rate}/second burst {k * lim.dns_burst} packets"
    conn = f"{k * lim.proxy_conn_rate}/second burst {k * lim.proxy_conn_burst} packets"
    return [
        f"udp dport {cfg.dns_port} ct status dnat "
        f"update @dns_meter {{ iifname limit rate over {dns} }} {TAP_LIMITED} drop",
        f"tcp dport {{ {cfg.dns_port}, {cfg.proxy_port} }} ct state new ct status dnat "
        f"update @conn_meter {{ iifname limit rate over {conn} }} {TAP_LIMITED} drop",
    ]


def _skeleton(cfg: TableConfig, host_addrs: Iterable[IPv4Address]) -> str:
    wildcard = quote(tap_prefix(cfg.tag) + "*")
    hosts = _host_elements(host_addrs)
    # Shared checks first, in this order: the tap must be registered (else no counter
    # exists for it), IPv4 only, source must be the sandbox's own address (before any
    # conntrack accept, so a guest cannot inject into another sandbox's flows).
    checks = [
        *deny_rules(cfg, "iifname != @taps", "-", "unregistered", "counter"),
        *deny_rules(cfg, "meta nfproto ipv6", "-", "ipv6", TAP_DENY),
        *deny_rules(cfg, "iifname . ip saddr != @tap_src", "-", "spoof", TAP_DENY),
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
        *deny_rules(cfg, "", "-", "host", TAP_DENY),
    ]
    egress = [
        *checks,
        # An established flow goes on only under the policy that accepted it (its mark);
        # older ones fall through to the checks below, as a new connection would.
        "ct state established,related iifname vmap @est_vmap",
        # Members of a shared private network reach each other whatever their policies.
        "jump peers",
        *deny_rules(cfg, "ip daddr @host_addrs", "-", "host", TAP_DENY),
        # The other hosts' tunnel endpoints are hosts too (the overlay is never the
        # guest's to address); their sandboxes are sandboxes (peers passed above).
        *deny_rules(cfg, "ip daddr @tunnel_peers", "-", "host", TAP_DENY),
        *deny_rules(cfg, "ip daddr @link_local", "-", "link-local", TAP_DENY),
        *deny_rules(cfg, "ip daddr @pool", "-", "sandbox", TAP_DENY),
        *deny_rules(cfg, "ip daddr @cluster_pools", "-", "sandbox", TAP_DENY),
        *deny_rules(cfg, "ip daddr @multicast", "-", "multicast", TAP_DENY),
        *deny_rules(cfg, "tcp dport 25", "-", "smtp", TAP_DENY),
        "iifname vmap @sb_vmap",
        # Unreachable while sb_vmap and taps agree (they change in one transaction).
        *deny_rules(cfg, "", "-", "unregistered", "counter"),
    ]

    link_local = elements(net_elements(_LINK_LOCAL))
    multicast = elements(net_elements(_MULTICAST))

    def body(rules: list[str]) -> str:
        return "\n".join(f"    {r}" for r in rules)

    t = TunnelRules.of(cfg)

    return f"""table inet {cfg.table} {{
  set taps {{ type ifname; }}
  set tap_src {{ type ifname . ipv4_addr; }}
  set host_addrs {{ type ipv4_addr; flags interval; elements = {{ {elements(hosts)} }} }}
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
    return net_elements([_LOOPBACK, *(IPv4Network(a) for a in host_addrs)])


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
        lines += sandbox_decls(cfg, sb.key)
        lines += sandbox_fill(cfg, sb)
    lines += sandbox_register(cfg, state.sandboxes)
    lines.append(render_networks(cfg, state.networks))
    lines.append(render_cluster(cfg, state.cluster_pools, state.tunnel_peers))
    return "\n".join(lines) + "\n"


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
            lines.append(add_element(cfg, key, [str(a) for a in members]))
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
    elems = elements(_host_elements(host_addrs))
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
    nets = net_elements(pools)
    if nets:
        lines.append(add_element(cfg, "cluster_pools", nets))
    hosts = net_elements(IPv4Network(a) for a in peers)
    if hosts:
        lines.append(add_element(cfg, "tunnel_peers", hosts))
    return "\n".join(lines) + "\n"
