"""The lines of hutch's nft table for the overlay between hosts (pure, no I/O): what
:mod:`hutch.net.nft`'s skeleton adds when the daemon has a tunnel
(:mod:`hutch.net.tunnel`, workers of a cluster), and nothing without one."""

from __future__ import annotations

from dataclasses import dataclass

from hutch.net.nft_common import TableConfig, quote

__all__ = ["TunnelRules"]


@dataclass(frozen=True)
class TunnelRules:
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
    def of(cls, cfg: TableConfig) -> TunnelRules:
        tun = cfg.tunnel
        if tun is None:
            return cls()
        dev = quote(tun.dev)
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
