"""Private networks across hosts (hutch.net.tunnel, services/overlay.py)."""

from __future__ import annotations

import subprocess
import time

import pytest

from hutch.sdk import Sandbox
from tests.e2e.cluster.net_probe import (
    HTTP_PORT,
    INJECT,
    LEARN_S,
    PROBE,
    device,
    ip_rules_of,
    packets,
    probe,
)
from tests.e2e.cluster_lab import MEMORY_MIB, Worker, owners
from tests.e2e.conftest import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.vm]

_owners = owners


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
        sent = {w.host_id: packets(w.tunnel)[1] for w in (w1, w2) if device(w.tunnel)}

        # By name, TCP both ways, through each worker's own VXLAN device (with the
        # kernel's local bypass off: both ends are on 127.0.0.1 here).
        def alpha_reaches_bravo() -> bool:
            seen = probe(c, alpha.id, "bravo")["bravo"]
            return seen == {"ip": b_addr, "body": bravo.id}

        assert wait_for(alpha_reaches_bravo, LEARN_S, interval_s=1.0)
        seen = probe(c, alpha.id, f"{bravo.id}.hutch.internal", o_addr)
        assert seen[f"{bravo.id}.hutch.internal"] == {"ip": b_addr, "body": bravo.id}
        assert seen[o_addr]["body"].startswith("ERR"), seen  # another host's pool
        seen = probe(c, bravo.id, "alpha", o_addr)
        assert seen["alpha"] == {"ip": a_addr, "body": alpha.id}  # deny-all, but a peer
        assert seen[o_addr]["body"].startswith("ERR"), seen
        for w in (w1, w2):
            dev = device(w.tunnel)
            assert dev is not None and dev["linkinfo"]["info_kind"] == "vxlan"
            assert packets(w.tunnel)[1] > sent.get(w.host_id, 0)
            assert ip_rules_of(w) == 1
        routes = subprocess.run(
            ["ip", "route", "show", "table", w1.route_table], capture_output=True, text=True
        ).stdout
        assert routes.split() == [b_addr, "dev", w1.tunnel, "scope", "link"], routes
        assert device(w3.tunnel) is None  # no member there: no device

        # bravo's own rules still hold for everything that is not a peer.
        c.exec(bravo.id, ["python3", "-c", PROBE, "192.0.2.1"], timeout_s=60)
        log = Sandbox(c, c.get_sandbox(bravo.id)).egress.log()
        denied = [e for e in log if e.destination == "192.0.2.1"]
        assert denied and {e.verdict for e in denied} == {"deny"}, denied

        # Off the network, on a third worker: neither name resolves, neither answers.
        seen = probe(c, outsider.id, "alpha", "bravo", a_addr, b_addr)
        assert seen["alpha"]["ip"] == "" and seen["bravo"]["ip"] == "", seen
        assert seen[a_addr]["body"].startswith("ERR") and seen[b_addr]["body"].startswith("ERR")

        # The guest cannot see the tunnel: no such device, and a VXLAN frame it sends to
        # the tunnel ports on its host never reaches either device.
        before = {w.host_id: packets(w.tunnel)[0] for w in (w1, w2)}
        ports = [w.daemon_env["HUTCH_TUNNEL_PORT"] for w in cluster]
        done = c.exec(alpha.id, ["python3", "-c", INJECT, b_addr, *ports])
        assert done.exit_code == 0 and done.stdout.split() == ["eth0", "lo"], done
        time.sleep(1.0)
        assert {w.host_id: packets(w.tunnel)[0] for w in (w1, w2)} == before

        # The members go: with its last route each worker's device and rule go too.
        for sb in sandboxes:
            c.delete_sandbox(sb.id)
        assert wait_for(lambda: device(w1.tunnel) is None and device(w2.tunnel) is None, 20)
        assert ip_rules_of(w1) == 0 and ip_rules_of(w2) == 0
        c.networks.delete(net)
    assert wait_for(lambda: not {s.id for s in sandboxes} & set(_owners(cluster)), 20)
