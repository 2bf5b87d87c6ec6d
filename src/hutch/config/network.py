"""The sandboxes' network: the address pool, the resolver's upstream, the egress proxy's
upstream CAs, where exposed ports listen, and the per-sandbox budgets of the data path."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hutch.config.env import _ENV_OF
from hutch.errors import InvalidArgument

if TYPE_CHECKING:
    from hutch.config.settings import Settings

DEFAULT_NET_POOL = ipaddress.IPv4Network("10.213.0.0/16")


@dataclass(frozen=True)
class NetLimits:
    """Per-sandbox budgets of the data path. Every sandbox has its own: one that uses
    up its budget (a flood) changes nothing for another. Rates are per second, bursts
    how many may come at once after a quiet spell (token buckets).

    - ``dns_rate``/``dns_burst``: queries to hutch's resolver (UDP and TCP). Past it a
      query is answered REFUSED without being looked at; past twice it the kernel drops
      the packets before they reach the daemon.
    - ``proxy_conn_rate``/``proxy_conn_burst``: new connections to the SNI/Host proxy
      (rules mode, ports 80/443). Past it a connection is closed at once; past twice it
      the kernel drops the SYNs (new TCP connections to the resolver count there too).
    - ``deny_log_rate``/``deny_log_burst``: denied packets logged one by one (NFLOG).
      Past it denials are still dropped and counted, and the log says how many were
      not logged.

    The defaults are far above what a program resolving and connecting as it works
    does (a build, a package install, a crawler); they stop floods.
    """

    dns_rate: int = 200
    dns_burst: int = 400
    proxy_conn_rate: int = 100
    proxy_conn_burst: int = 200
    deny_log_rate: int = 20
    deny_log_burst: int = 40
    #: Denials (resolver and proxy decisions) in one minute that make a *denial spike*:
    #: one summary line in the sandbox's egress log and the enforcer's
    #: ``denial_spike_hook`` (the event log's ``egress.denied``), once per minute.
    deny_spike_per_min: int = 120


#: setting -> (accepted range, what it counts): the validation messages say both.
NET_LIMIT_SETTINGS: dict[str, tuple[tuple[int, int], str]] = {
    "dns_rate": ((1, 100_000), "DNS queries per second per sandbox"),
    "dns_burst": ((1, 1_000_000), "DNS queries at once per sandbox"),
    "proxy_conn_rate": ((1, 100_000), "new proxy connections per second per sandbox"),
    "proxy_conn_burst": ((1, 1_000_000), "new proxy connections at once per sandbox"),
    "deny_log_rate": ((1, 100_000), "denied packets logged per second per sandbox"),
    "deny_log_burst": ((1, 1_000_000), "denied packets logged at once per sandbox"),
    "deny_spike_per_min": ((1, 1_000_000), "denials per minute per sandbox that raise an alert"),
}


def parse_dns_upstream(value: str) -> tuple[str, int]:
    """Parse ``ip[:port]`` (``[v6]:port`` for IPv6 with a port); the port defaults to 53."""
    text = value.strip()
    host, port = text, 53
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":") or not rest[1:].isdigit():
                raise InvalidArgument(f"HUTCH_DNS_UPSTREAM={value!r} is not [ipv6]:port")
            port = int(rest[1:])
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        if not port_text.isdigit():
            raise InvalidArgument(f"HUTCH_DNS_UPSTREAM={value!r}: port is not a number")
        port = int(port_text)
    try:
        ipaddress.ip_address(host)
    except ValueError as exc:
        raise InvalidArgument(
            f"HUTCH_DNS_UPSTREAM={value!r}: {host!r} is not an IP address; "
            "accepted: ip[:port], e.g. 192.0.2.53 or 192.0.2.53:5353"
        ) from exc
    if not 0 < port < 65536:
        raise InvalidArgument(f"HUTCH_DNS_UPSTREAM={value!r}: port {port} is out of 1-65535")
    return host, port


def parse_net_pool(value: str) -> ipaddress.IPv4Network:
    """Parse the sandbox address pool: an IPv4 CIDR of /8 to /28."""
    try:
        pool = ipaddress.IPv4Network(value.strip(), strict=True)
    except ValueError as exc:
        raise InvalidArgument(
            f"HUTCH_NET_POOL={value!r} is not an IPv4 network (example: 10.213.0.0/16): {exc}"
        ) from exc
    if not 8 <= pool.prefixlen <= 28:
        raise InvalidArgument(f"HUTCH_NET_POOL={value!r}: prefix length must be 8-28")
    return pool


def _net_limit(source: str, key: str, value: Any) -> int:
    (lo, hi), what = NET_LIMIT_SETTINGS[key]
    env = _ENV_OF.get(key, key)
    shown = env if source == "environment" else f"{source}: {key}"
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or not lo <= int(text) <= hi:
        raise InvalidArgument(f"{shown}={value!r} is not valid; accepted: {lo}-{hi} ({what})")
    return int(text)


def _network_settings(s: Settings, values: dict[str, Any], source: str) -> Settings:
    if "net_pool" in values:
        s = replace(s, net_pool=parse_net_pool(str(values["net_pool"])))
    if "dns_upstream" in values:
        s = replace(s, dns_upstream=parse_dns_upstream(str(values["dns_upstream"])))
    if "egress_upstream_ca" in values:
        raw_ca = str(values["egress_upstream_ca"]).strip()
        ca_path = Path(raw_ca).resolve() if raw_ca else None
        if ca_path is not None and not ca_path.is_file():
            raise InvalidArgument(
                f"{source}: egress_upstream_ca={raw_ca!r} is not a file; accepted: a PEM "
                "file of CA certificates (empty: the host's trust store)"
            )
        s = replace(s, egress_upstream_ca=ca_path)
    if "ports_bind" in values:
        bind = str(values["ports_bind"])
        try:
            ipaddress.ip_address(bind)
        except ValueError as exc:
            raise InvalidArgument(f"{source}: ports_bind={bind!r} is not an IP address") from exc
        s = replace(s, ports_bind=bind)
    return s


def _net_limits_settings(s: Settings, values: dict[str, Any], source: str) -> Settings:
    net_limits = {k: _net_limit(source, k, values[k]) for k in NET_LIMIT_SETTINGS if k in values}
    if net_limits:
        s = replace(s, net_limits=replace(s.net_limits, **net_limits))
    return s
