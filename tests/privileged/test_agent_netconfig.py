"""The agent's network setup (``hutch_agent.netconfig.apply_network`` over
``hutch_agent.rtnl``) against the real kernel, in a scratch network namespace whose only
NIC stands in for the guest's: read back with ``ip -j`` as the guest's NIC would be.

    netns G (the "guest")            netns P (the far end)
    eth0 ════════════ veth ═════════ peer0 (up)

The agent runs as a child process inside G (``ip netns exec G python3 -c ...``), with
its resolv.conf pointed at a scratch file so the host's is never touched.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .conftest import REPO, require_tools, sh

pytestmark = pytest.mark.privileged

AGENT = r"""
import json, logging, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
from hutch_agent import netconfig
netconfig.RESOLV_CONF = sys.argv[1]
netconfig.apply_network(json.loads(sys.argv[2]))
"""

RTNL = r"""
import sys
from ipaddress import IPv4Address, IPv4Interface
from hutch_agent import rtnl
try:
    rtnl.configure_nic("eth0", IPv4Interface(sys.argv[1]), IPv4Address(sys.argv[2]))
except rtnl.NetlinkError as exc:
    print(exc.errno, exc)
"""


@dataclass
class Lab:
    guest: str
    resolv: Path

    def run(self, script: str, *args: str) -> str:
        """``script`` in a child inside the guest netns; its stdout (the agent's log)."""
        return sh(
            "ip", "netns", "exec", self.guest, "env", f"PYTHONPATH={REPO / 'guest_agent'}",
            sys.executable, "-c", script, *args,
        ).stdout  # fmt: skip

    def apply(self, net: dict[str, str] | None) -> str:
        return self.run(AGENT, str(self.resolv), json.dumps(net))

    def show(self, *what: str) -> Any:
        return json.loads(sh("ip", "-n", self.guest, "-j", *what).stdout)

    def nic(self) -> dict[str, Any]:
        info: list[dict[str, Any]] = self.show("addr", "show", "dev", "eth0")
        return info[0]

    def ipv4(self) -> list[tuple[str, int]]:
        return [
            (a["local"], a["prefixlen"]) for a in self.nic()["addr_info"] if a["family"] == "inet"
        ]

    def routes(self) -> list[tuple[str, str | None]]:
        return sorted(
            (r["dst"], r.get("gateway")) for r in self.show("route", "show", "dev", "eth0")
        )


@contextlib.contextmanager
def scratch_lab(resolv: Path, *, ipv6: bool = True) -> Iterator[Lab]:
    """``ipv6=False``: none on eth0, so the kernel adds no link-local address on its own
    time (when the veth's carrier comes up), which would race a comparison."""
    require_tools()
    token = secrets.token_hex(3)
    guest, peer = f"hxa{token}g", f"hxa{token}p"
    sh("ip", "netns", "add", guest)
    try:
        sh("ip", "netns", "add", peer)
        sh("ip", "-n", guest, "link", "add", "eth0", "type", "veth", "peer", "name", "peer0",
           "netns", peer)  # fmt: skip
        sh("ip", "-n", peer, "link", "set", "peer0", "up")
        # What a restored snapshot wakes up with: the parent's address, an extra route.
        sh("ip", "-n", guest, "link", "set", "eth0", "address", "02:00:0a:d5:00:06")
        if not ipv6:
            sh("ip", "netns", "exec", guest, "sysctl", "-q", "-w",
               "net.ipv6.conf.eth0.disable_ipv6=1")  # fmt: skip
        else:  # a leftover the flush must take too (ip addr flush: every family)
            sh("ip", "-n", guest, "addr", "add", "2001:db8::6/64", "dev", "eth0", "nodad")
        sh("ip", "-n", guest, "addr", "add", "10.213.0.6/30", "dev", "eth0")
        sh("ip", "-n", guest, "link", "set", "eth0", "up")
        sh("ip", "-n", guest, "route", "add", "default", "via", "10.213.0.5")
        sh("ip", "-n", guest, "route", "add", "192.0.2.0/24", "via", "10.213.0.5")
        yield Lab(guest, resolv)
    finally:
        sh("ip", "netns", "del", guest, check=False)
        sh("ip", "netns", "del", peer, check=False)


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    with scratch_lab(tmp_path / "resolv.conf") as lab:
        yield lab


def kernel_state(lab: Lab) -> list[Any]:
    """What ``ip -j`` shows of the NIC and the namespace's routes (all tables), less the
    interface index (the two labs' differ)."""
    state = [lab.show(*what) for what in (("addr", "show", "dev", "eth0"),
             ("link", "show", "dev", "eth0"), ("route", "show", "table", "all"))]  # fmt: skip
    for entries in state:
        for entry in entries:
            entry.pop("ifindex", None)
    return state


@pytest.mark.parametrize("mac", ["02:00:0a:d5:00:0a", None])
def test_kernel_state_is_what_ip_batch_left(tmp_path: Path, mac: str | None) -> None:
    """The commands the agent used to hand ``ip -batch`` and ``rtnl`` in its place leave
    the same addresses, link and routes behind."""
    batch = ["addr flush dev eth0", "route flush dev eth0"]
    if mac is not None:
        batch += ["link set eth0 down", f"link set eth0 address {mac}"]
    batch += ["link set eth0 up", "addr add 10.213.0.10/30 dev eth0",
              "route replace default via 10.213.0.9 dev eth0"]  # fmt: skip
    net = {"address": "10.213.0.10/30", "gateway": "10.213.0.9"}
    if mac is not None:
        net["mac"] = mac
    with (
        scratch_lab(tmp_path / "a", ipv6=False) as old,
        scratch_lab(tmp_path / "b", ipv6=False) as new,
    ):
        commands = tmp_path / "batch"
        commands.write_text("\n".join(batch) + "\n")
        sh("ip", "-n", old.guest, "-batch", str(commands))
        assert new.apply(net) == ""
        assert kernel_state(new) == kernel_state(old)


def test_apply_network_replaces_everything_then_takes_the_nic_down(lab: Lab) -> None:
    log = lab.apply({"address": "10.213.0.10/30", "gateway": "10.213.0.9",
                     "dns": "10.213.0.9", "mac": "02:00:0a:d5:00:0a"})  # fmt: skip
    assert log == ""
    nic = lab.nic()
    assert nic["address"] == "02:00:0a:d5:00:0a"
    assert "UP" in nic["flags"]
    assert lab.ipv4() == [("10.213.0.10", 30)]
    assert [a for a in nic["addr_info"] if a["family"] == "inet6" and a["scope"] == "global"] == []
    assert lab.routes() == [("10.213.0.8/30", None), ("default", "10.213.0.9")]
    assert lab.resolv.read_text() == "nameserver 10.213.0.9\n"

    # A fork's next session: other address, gateway and MAC; dns defaults to the gateway.
    assert lab.apply({"address": "172.16.5.2/24", "gateway": "172.16.5.1",
                      "mac": "02:00:ac:10:05:02"}) == ""  # fmt: skip
    nic = lab.nic()
    assert nic["address"] == "02:00:ac:10:05:02" and "UP" in nic["flags"]
    assert lab.ipv4() == [("172.16.5.2", 24)]
    assert lab.routes() == [("172.16.5.0/24", None), ("default", "172.16.5.1")]
    assert lab.resolv.read_text() == "nameserver 172.16.5.1\n"

    # Without a MAC the link stays up and keeps the one it has.
    assert lab.apply({"address": "172.16.5.3/24", "gateway": "172.16.5.1"}) == ""
    assert lab.nic()["address"] == "02:00:ac:10:05:02"
    assert lab.ipv4() == [("172.16.5.3", 24)]

    # Network mode "none".
    assert lab.apply(None) == ""
    nic = lab.nic()
    assert "UP" not in nic["flags"]
    assert lab.ipv4() == []
    assert lab.routes() == []
    assert lab.resolv.read_text() == "# no network\n"


def test_a_refusal_names_the_operation_and_errno_and_apply_network_only_logs(lab: Lab) -> None:
    # A gateway off the address's subnet: the kernel refuses the route (ENETUNREACH).
    out = lab.run(RTNL, "10.213.0.10/30", "10.99.0.1")
    assert out.strip() == (
        "101 [Errno 101] replace default route via 10.99.0.1 dev eth0: Network is unreachable"
    )
    log = lab.apply({"address": "10.213.0.10/30", "gateway": "10.99.0.1"})
    assert "configuring eth0 failed" in log and "Network is unreachable" in log
    assert not lab.resolv.exists(), "resolv.conf is only written once the NIC is set"


def test_bad_settings_are_logged_and_change_nothing(lab: Lab) -> None:
    log = lab.apply({"address": "10.213.0.10/30", "gateway": "10.213.0.9", "mac": "nope"})
    assert "ignoring bad network settings" in log and "xx:xx:xx:xx:xx:xx" in log
    assert lab.ipv4() == [("10.213.0.6", 30)]
    nic = lab.nic()
    assert nic["address"] == "02:00:0a:d5:00:06"
    assert ("2001:db8::6", 64) in [(a["local"], a["prefixlen"]) for a in nic["addr_info"]]
