"""Sandbox networking on the host: addresses, taps, nftables, DNS, the egress proxy and
inbound port forwarding. Every control lives here, outside the guest."""
