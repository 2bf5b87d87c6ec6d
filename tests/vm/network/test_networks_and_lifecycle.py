"""Sandboxes' networks with real VMs (the package's lab, ``conftest.py``): private
networks, rules across pause, resume and fork, network ``none``, exposed ports, and the
daemon's restart (last: it restarts the package's daemon)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time

import pytest

from hutch.errors import HutchError
from hutch.sdk import Client, Sandbox
from tests.e2e.conftest import Daemon
from tests.netfake import FakeInternet
from tests.vm.netlab import (
    NETWORK_VM_MARKS,
    PROBE,
    Guest,
    address_of,
    http,
    https,
    icmp,
    make_guest,
    resolve,
    tcp,
)

pytestmark = NETWORK_VM_MARKS


# -- private networks ------------------------------------------------------------------------


def test_private_network_by_name_and_not_across(
    alpha: Guest, client: Client, fakenet: FakeInternet, lab_net: str
) -> None:
    alpha.set_rules(["good.test"])  # peers are reachable whatever the egress rules
    other_net = client.networks.create("other-lab").id
    beta = make_guest(client, fakenet, "beta", networks=[lab_net])
    gamma = make_guest(client, fakenet, "gamma", networks=[other_net])
    try:
        beta.sb.exec("setsid -f python3 -m http.server 8000 --directory /tmp >/dev/null 2>&1")
        deadline = time.monotonic() + 30
        while not beta.probe([http("self", addr="127.0.0.1", port=8000)])[0]["ok"]:
            assert time.monotonic() < deadline, "http.server in beta did not start"
        beta_addr = address_of(beta.sb)
        seen = alpha.expect(
            {
                "peer by name": (resolve("beta"), True),
                "peer by fqdn": (resolve("beta.hutch.internal"), True),
                "peer by id": (resolve(beta.sb.id), True),
                "peer http by name": (http("beta", port=8000), True),
            }
        )
        assert seen["peer by name"]["addrs"] == [beta_addr]
        assert seen["peer by id"]["addrs"] == [beta_addr]
        gamma.expect(
            {
                "across networks by address": (http("beta", addr=beta_addr, port=8000), False),
                "across networks by name": (resolve("beta"), False),
                "to alpha": (icmp(address_of(alpha.sb)), False),
            }
        )
        assert client.networks.get(lab_net).members == sorted([alpha.sb.id, beta.sb.id]) or set(
            client.networks.get(lab_net).members
        ) == {alpha.sb.id, beta.sb.id}
        with pytest.raises(HutchError):
            client.networks.delete(other_net)  # in use by gamma
    finally:
        for g in (beta, gamma):
            with contextlib.suppress(HutchError):
                g.sb.kill()
    client.networks.delete(other_net)


# -- lifecycle -------------------------------------------------------------------------------


def test_rules_survive_pause_and_resume(alpha: Guest, fakenet: FakeInternet) -> None:
    alpha.set_rules(["good.test"])
    alpha.sb.pause()
    alpha.sb.resume()
    assert alpha.sb.egress.get().rules == ["good.test"]
    alpha.expect(
        {
            "good": (https("good.test"), True),
            "other": (resolve("other.test"), False),
            "raw ip": (tcp(fakenet.cdn, 2222), False),
        }
    )


def test_fork_keeps_rules_and_network(alpha: Guest, fakenet: FakeInternet, lab_net: str) -> None:
    alpha.set_rules(["good.test"])
    [child_sb] = alpha.sb.fork(1)
    child = Guest(child_sb)
    try:
        assert child.sb.egress.get().rules == ["good.test"]
        assert address_of(child.sb) != address_of(alpha.sb)
        macs = {g.exec("cat /sys/class/net/e*/address").stdout for g in (child.sb, alpha.sb)}
        assert len(macs) == 2 and all(m.startswith("02:") for m in macs), macs
        assert child.sb.info.network is not None and lab_net in child.sb.info.network.networks
        child.expect(
            {
                "good": (https("good.test"), True),
                "other": (resolve("other.test"), False),
                "raw ip": (tcp(fakenet.cdn, 2222), False),
                "sni mismatch": (https("other.test", addr=fakenet.web), False),
            }
        )
    finally:
        with contextlib.suppress(HutchError):
            child.sb.kill()


def test_network_none_has_no_network(client: Client, fakenet: FakeInternet) -> None:
    guest = make_guest(client, fakenet, "isolated", network="none")
    try:
        info = guest.sb.refresh()
        assert info.network is not None
        assert (info.network.mode, info.network.address) == ("none", None)
        addrs = guest.sb.exec(["ip", "-4", "-o", "addr", "show", "scope", "global"]).stdout
        assert addrs.strip() == ""
        guest.expect(
            {
                "name": (resolve("good.test"), False),
                "raw ip": (http("good.test", addr=fakenet.web), False),
                "icmp": (icmp(fakenet.web), False),
            }
        )
    finally:
        with contextlib.suppress(HutchError):
            guest.sb.kill()


# -- inbound ports and the daemon's restart ----------------------------------------------------


def test_exposed_port_reaches_a_server_in_the_guest(alpha: Guest) -> None:
    """Closed by default; ``ports.expose`` forwards a host port to the guest's server."""
    server = alpha.sb.processes.start(
        ["python3", "-m", "http.server", "8000", "--bind", "0.0.0.0", "--directory", "/root"]
    )
    try:
        guest_ip = address_of(alpha.sb)
        with pytest.raises(OSError):  # no route in: the guest is not reachable directly
            socket.create_connection((guest_ip, 8000), timeout=3).close()
        port = alpha.sb.ports.expose(8000)
        assert port.host == "127.0.0.1" and port.url.endswith(f":{port.host_port}")
        deadline = time.monotonic() + 60
        while True:  # the server may still be starting under TCG
            try:
                with socket.create_connection(("127.0.0.1", port.host_port), timeout=10) as s:
                    s.sendall(b"GET /probe.py HTTP/1.0\r\nHost: x\r\n\r\n")
                    answer = b""
                    while chunk := s.recv(65536):
                        answer += chunk
                if answer.startswith(b"HTTP/1.0 200"):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"no answer through {port.url}: {answer!r}"
            time.sleep(0.5)
        assert PROBE.read_bytes() in answer
        assert [p.port for p in alpha.sb.ports.list()] == [8000]
        alpha.sb.ports.close(8000)
        assert alpha.sb.ports.list() == []
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port.host_port), timeout=3).close()
    finally:
        with contextlib.suppress(HutchError):
            server.kill()


def test_rules_hold_across_a_daemon_restart_and_delete_reclaims(
    client: Client, fakenet: FakeInternet, netd: Daemon
) -> None:
    guest = make_guest(client, fakenet, "gamma", egress=["good.test"])
    tap = f"h{netd.settings.daemon_tag}{guest.sb.id[3:13]}"
    netd.stop()  # sandboxes keep running; their traffic fails closed meanwhile
    netd.start()
    with netd.client(timeout=300.0) as fresh:
        sb = Sandbox.connect(guest.sb.id, client=fresh)
        assert sb.egress.get().rules == ["good.test"]
        Guest(sb).expect(
            {
                "good": (https("good.test"), True),
                "other": (resolve("other.test"), False),
                "raw ip": (tcp(fakenet.cdn, 2222), False),
            }
        )
        links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
        assert tap in links
        sb.kill()
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert tap not in links, "the tap outlived its sandbox"
