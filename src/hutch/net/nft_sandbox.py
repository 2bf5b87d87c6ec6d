"""One sandbox's part of hutch's nft table (pure, no I/O): its sets, counters and
chains, its policy rules, and the scripts that add, remove or re-police it and add the
addresses its resolver learned. The table around it is :mod:`hutch.net.nft`.

Objects per sandbox (``<key>``: the sandbox id's 12 hex digits)::

  sb_<key>            the policy: open accept | deny-all drop | rules: the a_<key>_* sets
                      accept, udp 443 (QUIC) to learned addresses dropped, else drop
  px_<key>            rules mode (or screened/observed): tcp 80/443 -> the proxy unless an
                      ip/cidr rule allows the address
  e_<key>             ct mark <policy mark> accept (established flows of this policy)
  a_<key>_ip/_ipport  what the ip/cidr rules allow (interval sets)
  a_<key>_dns/_dnsport  addresses the resolver answered for allowed names (TTL timeouts)
  a_<key>_keep/_keepport  the same, for established flows only (KEEP_S timeouts)
  c_<key>_allow/_deny/_nolog/_limit/_tx  named counters (see :mod:`hutch.net.nft`)

and one element per shared set or map that registers its tap (``taps``, ``tap_src``,
the ``*_vmap`` verdict maps and the ``*_ctr`` counter maps).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address

from hutch.net.addressing import sandbox_key
from hutch.net.nft_common import (
    PolicyLike,
    SandboxNet,
    TableConfig,
    add_element,
    deny_rules,
    elements,
    net_elements,
    net_port_elements,
    quote,
)

__all__ = [
    "KEEP_S",
    "LearnedAddress",
    "policy_mark",
    "render_add_sandbox",
    "render_learned",
    "render_remove_sandbox",
    "render_replace_policy",
    "sandbox_decls",
    "sandbox_fill",
    "sandbox_register",
]

#: Seconds an address learned for a name keeps its established flows alive across rule
#: changes that still allow the name (its DNS TTL only bounds new connections).
KEEP_S = 86400

# A sandbox's sets, in the order they are flushed and deleted.
_SETS = ("ip", "ipport", "dns", "dnsport", "keep", "keepport")
# Its named counters, in the order they are deleted.
_COUNTERS = ("allow", "deny", "nolog", "limit", "tx")


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


def policy_mark(policy: PolicyLike) -> int:
    """The conntrack mark of flows a policy accepted: 32 bits of a digest of its rules
    (never 0, the mark of flows nobody marked). The same rules give the same mark, so a
    daemon restart or a change back to earlier rules does not disturb their flows."""
    text = "\n".join([policy.mode, *policy.texts()])
    mark = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")
    return mark or 1


def _names(key: str) -> dict[str, str]:
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


def sandbox_decls(cfg: TableConfig, key: str) -> list[str]:
    """``add`` commands for a sandbox's sets, counters and chains (no-ops when present)."""
    n, t = _names(key), cfg.table
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


def sandbox_fill(cfg: TableConfig, sb: SandboxNet) -> list[str]:
    """Elements of the policy sets and the rules of sb_<key> and px_<key> (chains empty)."""
    key, t = sb.key, cfg.table
    n = _names(key)
    policy = sb.policy
    lines: list[str] = []
    # Rules mode: what the ip/cidr rules allow; default allow with ip/cidr denies: the
    # allow rules before them (accepted first, so first match wins).
    lowered = policy.mode == "rules" or (policy.mode == "open" and bool(policy.ip_denied()))
    ips = net_elements(policy.ip_networks()) if lowered else []
    ipports = net_port_elements(policy.ip_port_networks()) if lowered else []
    if ips:
        lines.append(add_element(cfg, n["ip"], ips))
    if ipports:
        lines.append(add_element(cfg, n["ipport"], ipports))

    # The checks every sandbox shares (spoofing, always-denied destinations) ran in the
    # egress chain already; this chain holds only the policy, so a policy swap is small.
    # Every accept marks the flow with this policy (established flows skip the policy
    # only while their mark is current: e_<key>).
    sid, deny = sb.sandbox_id, f"counter name {quote(n['deny'])}"
    nolog = f"counter name {quote(n['nolog'])}"  # its denials past the log budget
    mark = f"{policy_mark(policy):#010x}"
    allow = f"ct mark set {mark} counter name {quote(n['allow'])} accept"
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
            anyport = net_elements(net for net, port in denied if port is None)
            if anyport:
                match = f"ip daddr {{ {elements(anyport)} }}"
                rules += deny_rules(cfg, match, sid, "policy", deny, nolog)
            ported = net_port_elements((net, port) for net, port in denied if port is not None)
            if ported:
                match = f"meta l4proto @tcp_udp ip daddr . th dport {{ {elements(ported)} }}"
                rules += deny_rules(cfg, match, sid, "policy", deny, nolog)
        if policy.screened:
            rules += deny_rules(cfg, "udp dport 443", sid, "quic", deny, nolog)
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
        rules += deny_rules(cfg, "udp dport 443", sid, "quic", deny, nolog)
        rules.append(f"ip daddr @{n['dns']} {allow}")
        rules.append(f"meta l4proto @tcp_udp ip daddr . th dport @{n['dnsport']} {allow}")
        established = "ct state established,related"
        rules.append(f"{established} ip daddr @{n['keep']} {keep}")
        rules.append(
            f"{established} meta l4proto @tcp_udp ip daddr . th dport @{n['keepport']} {keep}"
        )
    rules += deny_rules(cfg, "", sid, "policy", deny, nolog)
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


def _tap_elements(sb: SandboxNet) -> list[tuple[str, str]]:
    """(object, element) pairs that register a sandbox's tap in the shared sets/maps."""
    n, tap = _names(sb.key), quote(sb.tap)
    return [
        ("taps", tap),
        ("tap_src", f"{tap} . {sb.guest}"),
        ("sb_vmap", f"{tap} : jump {n['chain']}"),
        ("px_vmap", f"{tap} : jump {n['px']}"),
        ("est_vmap", f"{tap} : jump {n['est']}"),
        ("deny_ctr", f"{tap} : {quote(n['deny'])}"),
        ("nolog_ctr", f"{tap} : {quote(n['nolog'])}"),
        ("limit_ctr", f"{tap} : {quote(n['limit'])}"),
        ("tx_ctr", f"{tap} : {quote(n['tx'])}"),
    ]


def sandbox_register(cfg: TableConfig, sandboxes: Iterable[SandboxNet]) -> list[str]:
    """One ``add element`` per shared object (batched: far fewer commands for nft)."""
    by_obj: dict[str, list[str]] = {}
    for sb in sandboxes:
        for obj, elem in _tap_elements(sb):
            by_obj.setdefault(obj, []).append(elem)
    return [add_element(cfg, obj, elems) for obj, elems in by_obj.items()]


def render_add_sandbox(cfg: TableConfig, sb: SandboxNet) -> str:
    """Register one sandbox (sets, counters, chains, tap). Re-running it is harmless:
    its chains are flushed and refilled, its policy sets refilled."""
    n = _names(sb.key)
    lines = sandbox_decls(cfg, sb.key)
    lines += [
        f"flush chain inet {cfg.table} {n['chain']}",
        f"flush chain inet {cfg.table} {n['px']}",
        f"flush chain inet {cfg.table} {n['est']}",
        f"flush set inet {cfg.table} {n['ip']}",
        f"flush set inet {cfg.table} {n['ipport']}",
    ]
    lines += sandbox_fill(cfg, sb)
    lines += sandbox_register(cfg, [sb])
    return "\n".join(lines) + "\n"


def render_remove_sandbox(cfg: TableConfig, sb: SandboxNet) -> str:
    """Unregister one sandbox and delete its objects. Idempotent: every object is first
    added (a no-op when present) so that deleting it cannot fail on a missing one."""
    t = cfg.table
    n = _names(sb.key)
    lines = sandbox_decls(cfg, sb.key) + sandbox_register(cfg, [sb])
    tap = quote(sb.tap)
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
    t, n = cfg.table, _names(sb.key)
    lines = [f"flush set inet {t} {n[k]}" for k in _SETS]
    lines += [f"flush chain inet {t} {n[k]}" for k in ("chain", "px", "est")]
    lines += sandbox_fill(cfg, sb)
    return "\n".join(lines) + "\n" + render_learned(cfg, sb.sandbox_id, learned)


def render_learned(cfg: TableConfig, sandbox_id: str, learned: Iterable[LearnedAddress]) -> str:
    """Add DNS-learned addresses with their timeouts (``ttl`` in the sets new connections
    use, ``keep`` in those established flows use). An address already present gets its
    timeout refreshed (add, delete, add: the first add makes the delete safe)."""
    n = _names(sandbox_key(sandbox_id))
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
