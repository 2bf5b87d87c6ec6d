"""The guest's network settings, as the host hands them over in ``hello``.

Every new session can carry them, because a clone or fork wakes up with the address of
the VM it was copied from; the host side enforces the real address anyway (anti-spoof).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
from typing import Any

from hutch_agent import rtnl

log = logging.getLogger("hutch-agent")

RESOLV_CONF = "/etc/resolv.conf"
MAC_RE = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")


def find_nic() -> str | None:
    """The first network interface that is not loopback (the guest has one NIC)."""
    try:
        names = sorted(os.listdir("/sys/class/net"))
    except OSError:
        return None
    for name in names:
        if name != "lo":
            return name
    return None


def apply_network(net: Any) -> None:
    """``net``: {"address": "a.b.c.d/len", "gateway": ip, "dns": ip, "mac": optional} to
    configure the NIC, or None to take it down (network mode "none"). Errors are logged,
    never raised: the host checks connectivity where it matters, and the agent must keep
    serving."""
    nic = find_nic()
    if nic is None:
        if net is not None:
            log.warning("no network interface to configure")
        return
    dns: ipaddress.IPv4Address | None = None
    if net is not None:
        try:
            address = ipaddress.IPv4Interface(str(net["address"]))
            gateway = ipaddress.IPv4Address(str(net["gateway"]))
            dns = ipaddress.IPv4Address(str(net.get("dns") or gateway))
            mac = net.get("mac")
            if mac is not None and not MAC_RE.match(str(mac)):
                raise ValueError(f"mac {mac!r} is not xx:xx:xx:xx:xx:xx")
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("ignoring bad network settings %r: %s", net, exc)
            return
    try:
        if net is None:
            rtnl.take_down_nic(nic)
        else:
            rtnl.configure_nic(nic, address, gateway, None if mac is None else str(mac))
    except OSError as exc:
        log.warning("configuring %s failed: %s", nic, exc)
        return
    try:
        with open(RESOLV_CONF, "w") as f:
            f.write(f"nameserver {dns}\n" if dns else "# no network\n")
    except OSError as exc:
        log.warning("could not write %s: %s", RESOLV_CONF, exc)
