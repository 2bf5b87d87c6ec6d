"""Private networks across hosts (hutch.net.tunnel, services/overlay.py)."""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import pytest

from hutch.sdk import Client, Sandbox
from tests.e2e.cluster_lab import MEMORY_MIB, Worker, owners
from tests.e2e.conftest import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.vm]

_owners = owners

#: Seconds for a member on one worker to be known on another (a poll is 1 s).
LEARN_S = 15.0
HTTP_PORT = 8000
#: Run in a guest with targets as arguments: each target's address (by the private
#: resolver) and the body of http://TARGET:8000/marker, or why not (all at once).
PROBE = """
import concurrent.futures as f, json, socket, sys, urllib.request as u
def one(t):
    try:
        ip = socket.gethostbyname(t)
    except OSError as e:
        return t, {"ip": "", "body": "ERR resolve %s" % e}
    try:
        body = u.urlopen("http://%s:8000/marker" % t, timeout=3).read().decode().strip()
    except Exception as e:
        body = "ERR %s" % type(e).__name__
    return t, {"ip": ip, "body": body}
with f.ThreadPoolExecutor(8) as pool:
    print(json.dumps(dict(pool.map(one, sys.argv[1:]))))
"""
#: Run in a guest: its network devices, and a VXLAN frame (carrying a packet to
#: argv[1]) sent to every tunnel port in argv[2:] on its gateway (the host side).
INJECT = """
import socket, struct, sys, os
gw = next(socket.inet_ntoa(struct.pack("<L", int(f[2], 16)))
          for f in (l.split() for l in open("/proc/net/route").readlines()[1:])
          if f[1] == "00000000")
ip = bytes([0x45, 0, 0, 20, 0, 0, 0, 0, 64, 17, 0, 0])
inner = (b"\\x02" * 12 + b"\\x08\\x00" + ip
         + socket.inet_aton("10.0.0.1") + socket.inet_aton(sys.argv[1]))
frame = bytes([8, 0, 0, 0]) + (4213).to_bytes(3, "big") + b"\\0" + inner
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for port in sys.argv[2:]:
    for _ in range(5):
        s.sendto(frame, (gw, int(port)))
print(" ".join(sorted(os.listdir("/sys/class/net"))))
"""


def _probe(c: Client, sandbox_id: str, *targets: str) -> dict[str, dict[str, str]]:
    done = c.exec(sandbox_id, ["python3", "-c", PROBE, *targets], timeout_s=60)
    assert done.exit_code == 0, done.stdout + done.stderr
    found: dict[str, dict[str, str]] = json.loads(done.stdout)
    return found


def _device(name: str) -> dict[str, Any] | None:
    shown = subprocess.run(
        ["ip", "-j", "-s", "-d", "link", "show", "dev", name], capture_output=True, text=True
    )
    if shown.returncode != 0:
        return None
    found: dict[str, Any] = json.loads(shown.stdout)[0]
    return found


def _packets(name: str) -> tuple[int, int]:
    """(received, sent) by the device."""
    dev = _device(name)
    assert dev is not None, f"no device {name}"
    return int(dev["stats64"]["rx"]["packets"]), int(dev["stats64"]["tx"]["packets"])


def _ip_rules_of(w: Worker) -> int:
    rules = subprocess.run(["ip", "rule", "show"], capture_output=True, text=True).stdout
    return sum(1 for line in rules.splitlines() if f"lookup {w.route_table}" in line)


def test_a_private_network_across_workers_reaches_by_name_and_nothing_else(
    cluster: list[Worker],
) -> None:
    w1, w2, w3 = cluster
    with w3.client(timeout=300.0) as c:
        net = c.networks.create("across").id
        alpha = c.create_sandbox(
            memory_mib=MEMORY_MIB, name="alpha", networks=[net], placement={"host": "w1"}
        )
        # Egress rules are each host's own: bravo may reach nothing but its peers.
        bravo = c.create_sandbox(
            memory_mib=MEMORY_MIB,
            name="bravo",
            networks=[net],
            egress=["deny-all"],
            placement={"host": "w2"},
        )
        outsider = c.create_sandbox(memory_mib=MEMORY_MIB, placement={"host": "w3"})
        sandboxes = (alpha, bravo, outsider)
        owners = _owners(cluster)
        assert [owners[s.id] for s in sandboxes] == ["w1", "w2", "w3"]
        addr = {}
        for sb in sandboxes:
            assert sb.network is not None and sb.network.address, sb
            addr[sb.id] = sb.network.address
            c.exec(sb.id, ["sh", "-c", f"echo {sb.id} > /tmp/marker"])
            serve = f"python3 -m http.server {HTTP_PORT} --directory /tmp"
            c.exec(sb.id, ["sh", "-c", f"setsid -f {serve} >/dev/null 2>&1"])
        a_addr, b_addr, o_addr = (addr[s.id] for s in sandboxes)
        sent = {w.host_id: _packets(w.tunnel)[1] for w in (w1, w2) if _device(w.tunnel)}

        # By name, TCP both ways, through each worker's own VXLAN device (with the
        # kernel's local bypass off: both ends are on 127.0.0.1 here).
        def alpha_reaches_bravo() -> bool:
            seen = _probe(c, alpha.id, "bravo")["bravo"]
            return seen == {"ip": b_addr, "body": bravo.id}

        assert wait_for(alpha_reaches_bravo, LEARN_S, interval_s=1.0)
        seen = _probe(c, alpha.id, f"{bravo.id}.hutch.internal", o_addr)
        assert seen[f"{bravo.id}.hutch.internal"] == {"ip": b_addr, "body": bravo.id}
        assert seen[o_addr]["body"].startswith("ERR"), seen  # another host's pool
        seen = _probe(c, bravo.id, "alpha", o_addr)
        assert seen["alpha"] == {"ip": a_addr, "body": alpha.id}  # deny-all, but a peer
        assert seen[o_addr]["body"].startswith("ERR"), seen
        for w in (w1, w2):
            dev = _device(w.tunnel)
            assert dev is not None and dev["linkinfo"]["info_kind"] == "vxlan"
            assert _packets(w.tunnel)[1] > sent.get(w.host_id, 0)
            assert _ip_rules_of(w) == 1
        routes = subprocess.run(
            ["ip", "route", "show", "table", w1.route_table], capture_output=True, text=True
        ).stdout
        assert routes.split() == [b_addr, "dev", w1.tunnel, "scope", "link"], routes
        assert _device(w3.tunnel) is None  # no member there: no device

        # bravo's own rules still hold for everything that is not a peer.
        c.exec(bravo.id, ["python3", "-c", PROBE, "192.0.2.1"], timeout_s=60)
        log = Sandbox(c, c.get_sandbox(bravo.id)).egress.log()
        denied = [e for e in log if e.destination == "192.0.2.1"]
        assert denied and {e.verdict for e in denied} == {"deny"}, denied

        # Off the network, on a third worker: neither name resolves, neither answers.
        seen = _probe(c, outsider.id, "alpha", "bravo", a_addr, b_addr)
        assert seen["alpha"]["ip"] == "" and seen["bravo"]["ip"] == "", seen
        assert seen[a_addr]["body"].startswith("ERR") and seen[b_addr]["body"].startswith("ERR")

        # The guest cannot see the tunnel: no such device, and a VXLAN frame it sends to
        # the tunnel ports on its host never reaches either device.
        before = {w.host_id: _packets(w.tunnel)[0] for w in (w1, w2)}
        ports = [w.daemon_env["HUTCH_TUNNEL_PORT"] for w in cluster]
        done = c.exec(alpha.id, ["python3", "-c", INJECT, b_addr, *ports])
        assert done.exit_code == 0 and done.stdout.split() == ["eth0", "lo"], done
        time.sleep(1.0)
        assert {w.host_id: _packets(w.tunnel)[0] for w in (w1, w2)} == before

        # The members go: with its last route each worker's device and rule go too.
        for sb in sandboxes:
            c.delete_sandbox(sb.id)
        assert wait_for(lambda: _device(w1.tunnel) is None and _device(w2.tunnel) is None, 20)
        assert _ip_rules_of(w1) == 0 and _ip_rules_of(w2) == 0
        c.networks.delete(net)
    assert wait_for(lambda: not {s.id for s in sandboxes} & set(_owners(cluster)), 20)
