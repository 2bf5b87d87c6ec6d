"""The red-team bypasses of issue 16, with a real VM against the fake internet.

Four bypasses the landed egress controls let through, and two tightenings:

1. private answers from the resolver (10/8, 172.16/12, 192.168/16, 100.64/10, 240/4,
   loopback; also behind a CNAME) must not be answered or learned;
2. an address the host gains after hutchd started is the host: refused by the proxy
   (decided at connect time) and put in the nft set of host addresses;
3. a request head with a bare LF/CR cannot smuggle a second request, and one proxied
   connection carries exactly the one request the proxy checked;
4. absolute-form targets are parsed per RFC 3986 (``http://evil#@good/`` is evil);
5. a rule change that removes access cuts connections opened before it (nft flows and
   connections the proxy relays), while flows the new rules still allow keep going;
6. UDP 443 (QUIC) to an address learned for a name is dropped (no SNI check there).

One daemon and one sandbox for the module (rules change live between tests). What
reached the fake internet (or the host's own listener) is read from the servers' side,
so a bypass that "failed" in the guest but leaked a request still fails the test.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hutch.errors import HutchError
from hutch.sdk import Client
from tests.e2e.conftest import Daemon
from tests.netfake import FakeInternet
from tests.vm.netlab import (
    NETWORK_VM_MARKS,
    Guest,
    http,
    https,
    make_guest,
    network_daemon,
    resolve,
    tcp,
    udp,
)

pytestmark = NETWORK_VM_MARKS


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def netd(fakenet: FakeInternet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with network_daemon(tmp_path_factory.mktemp("hutchd-redteam"), fakenet) as d:
        yield d


@pytest.fixture(scope="module")
def client(netd: Daemon) -> Iterator[Client]:
    with netd.client(timeout=300.0) as c:
        yield c


@pytest.fixture(scope="module")
def guest(client: Client, fakenet: FakeInternet) -> Iterator[Guest]:
    """The module's one sandbox; every test sets the rules it needs first."""
    g = make_guest(client, fakenet, "redteam")
    yield g
    with contextlib.suppress(HutchError):
        g.sb.kill()


def denials_since(guest: Guest, since: float) -> list[Any]:
    return [
        e
        for e in guest.sb.egress.log(limit=1000)
        if e.verdict == "deny" and e.time is not None and e.time.timestamp() >= since - 1
    ]


def wait_until(what: str, predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


# -- 1. private answers ----------------------------------------------------------------------


def test_resolver_never_answers_or_learns_private_addresses(
    guest: Guest, fakenet: FakeInternet
) -> None:
    guest.set_rules(["good.test", "*.good.test"])
    since = time.time()
    seen = guest.expect(
        {
            "10/8": (resolve("lan.good.test"), False),
            "172.16/12": (resolve("lan172.good.test"), False),
            "192.168/16": (resolve("lan192.good.test"), False),
            "100.64/10 (CGNAT)": (resolve("cgnat.good.test"), False),
            "240/4": (resolve("class-e.good.test"), False),
            "loopback": (resolve("loop.good.test"), False),
            "CNAME under the rule into 10/8": (resolve("alias.good.test"), False),
            "mixed answer keeps the public address": (resolve("mixed.good.test"), True),
            "public names still answered": (resolve("www.good.test"), True),
        }
    )
    assert seen["mixed answer keeps the public address"]["addrs"] == [fakenet.web]
    # Nothing of it was learned: the "LAN" host is reachable on no port, by no protocol.
    guest.expect(
        {
            "LAN tcp 2222": (tcp(fakenet.private, 2222), False),
            "LAN udp 7": (udp(fakenet.private), False),
            "LAN http via the proxy": (http("lan.good.test", addr=fakenet.private), False),
        }
    )
    reached = [e.fields for e in fakenet.events(since=since) if e.get("local") == fakenet.private]
    assert reached == [], "traffic reached the private address"
    refused = [e for e in denials_since(guest, since) if e.protocol == "dns"]
    for name in ("lan.good.test", "cgnat.good.test", "class-e.good.test", "alias.good.test"):
        assert any(e.name == name and "private" in e.reason for e in refused), (name, refused)
    assert any(e.name == "mixed.good.test" and fakenet.private in e.reason for e in refused)


def test_an_explicit_ip_rule_opens_a_private_answer(guest: Guest, fakenet: FakeInternet) -> None:
    """The documented way to reach a private address: an ip/cidr rule covering it. The
    name is then answered, but what the guest may reach there is exactly that rule."""
    guest.set_rules(["*.good.test", f"{fakenet.private}:2222"])
    seen = guest.expect(
        {
            "answered: an ip rule covers it": (resolve("lan.good.test"), True),
            "240/4 is not covered": (resolve("class-e.good.test"), False),
        }
    )
    assert seen["answered: an ip rule covers it"]["addrs"] == [fakenet.private]
    guest.expect(
        {
            "the ip rule's port": (tcp(fakenet.private, 2222), True),
            "not learned for the name's other ports": (udp(fakenet.private), False),
        }
    )


# -- 2. host addresses that appear later ------------------------------------------------------


@contextlib.contextmanager
def late_host_address(addr: str) -> Iterator[list[str]]:
    """``addr`` on a new veth of the host (after hutchd started) with TCP listeners on
    80, 443 and 8081 that record every connection (and answer HTTP on 80)."""
    name = f"hlt{secrets.token_hex(3)}"
    subprocess.run(
        ["ip", "link", "add", name, "type", "veth", "peer", "name", name + "p"], check=True
    )
    hits: list[str] = []
    stop = threading.Event()
    listeners: list[socket.socket] = []
    try:
        subprocess.run(["ip", "addr", "add", f"{addr}/32", "dev", name], check=True)
        subprocess.run(["ip", "link", "set", name, "up"], check=True)
        for port in (80, 443, 8081):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, port))
            s.listen()
            s.settimeout(0.3)
            listeners.append(s)

        def accept(s: socket.socket) -> None:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError, OSError):
                    conn, peer = s.accept()
                    hits.append(f"{peer[0]} -> {s.getsockname()}")
                    with conn:
                        conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 12\r\n\r\nHOST-SECRET\n")

        threads = [threading.Thread(target=accept, args=(s,), daemon=True) for s in listeners]
        for t in threads:
            t.start()
        yield hits
    finally:
        stop.set()
        for s in listeners:
            s.close()
        subprocess.run(["ip", "link", "del", name], check=False)


def host_addrs_set(netd: Daemon) -> list[Any]:
    table = f"hutch_{netd.settings.daemon_tag}"
    out = subprocess.run(
        ["nft", "-j", "list", "set", "inet", table, "host_addrs"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    for item in json.loads(out)["nftables"]:
        if "set" in item:
            elems: list[Any] = item["set"].get("elem", [])
            return elems
    return []


def test_host_address_added_after_start_is_the_host(
    guest: Guest, fakenet: FakeInternet, netd: Daemon
) -> None:
    guest.set_rules(["*.good.test"])
    late = fakenet.late_host
    assert late not in host_addrs_set(netd)
    with late_host_address(late) as hits:
        # Decided when the guest asks, without waiting for anything to catch up.
        guest.expect(
            {
                "a name resolving to it": (resolve("late.good.test"), False),
                "proxy path (Host header)": (http("late.good.test", addr=fakenet.web), False),
                "proxy path (SNI)": (https("late.good.test", addr=fakenet.web), False),
                "nft path (direct)": (tcp(late, 8081), False),
            }
        )
        assert hits == [], "the host's own listener was reached"
        wait_until("the new address in the nft host set", lambda: late in host_addrs_set(netd))
    wait_until("the address gone from the nft host set", lambda: late not in host_addrs_set(netd))
    reasons = [e.reason for e in guest.sb.egress.log(limit=200) if e.name == "late.good.test"]
    assert any("host" in r for r in reasons), reasons


# -- 3. request smuggling through the HTTP proxy ------------------------------------------------


def raw(addr: str, data: str) -> dict[str, Any]:
    return {"op": "raw", "addr": addr, "port": 80, "data": data}


def test_bare_lf_cannot_smuggle_a_second_request(guest: Guest, fakenet: FakeInternet) -> None:
    guest.set_rules(["good.test"])
    since = time.time()
    web = fakenet.web
    seen = guest.expect(
        {
            "bare LF in a header line": (
                raw(
                    web,
                    "GET /first HTTP/1.1\r\nHost: good.test\r\nX-A: 1\nConnection: keep-alive"
                    "\r\n\r\nGET /smuggled-1 HTTP/1.1\r\nHost: other.test\r\n"
                    "Connection: close\r\n\r\n",
                ),
                True,
            ),
            "request line ending in bare LF": (
                raw(
                    web,
                    "GET /first HTTP/1.1\n\r\nGET http://other.test/smuggled-2 HTTP/1.1\r\n"
                    "Host: good.test\r\nConnection: close\r\n\r\n",
                ),
                True,
            ),
            "bare CR in a header line": (
                raw(
                    web,
                    "GET /first HTTP/1.1\r\nHost: good.test\r\nX-A: 1\rConnection: keep-alive"
                    "\r\n\r\nGET /smuggled-3 HTTP/1.1\r\nHost: other.test\r\n\r\n",
                ),
                True,
            ),
            "plain pipeline: only the first request goes out": (
                raw(
                    web,
                    "GET /first HTTP/1.1\r\nHost: good.test\r\n\r\n"
                    "GET /smuggled-4 HTTP/1.1\r\nHost: other.test\r\n\r\n",
                ),
                True,
            ),
        }
    )
    statuses = {label: r["statuses"] for label, r in seen.items()}
    assert statuses == {
        "bare LF in a header line": [403],
        "request line ending in bare LF": [403],
        "bare CR in a header line": [403],
        "plain pipeline: only the first request goes out": [200],
    }, seen
    served = [e.fields for e in fakenet.events("http", since)]
    assert [e for e in served if "smuggled" in str(e.get("path"))] == [], served
    assert [e["path"] for e in served] == ["/first"], served
    reasons = [e.reason for e in denials_since(guest, since) if e.protocol == "http"]
    assert sum("bare" in r or "control" in r for r in reasons) >= 3, reasons


# -- 4. absolute-form targets -----------------------------------------------------------------


def test_absolute_form_authority_is_parsed_per_rfc_3986(
    guest: Guest, fakenet: FakeInternet
) -> None:
    guest.set_rules(["good.test"])
    since = time.time()
    web = fakenet.web

    def get(target: str) -> dict[str, Any]:
        return raw(web, f"GET {target} HTTP/1.1\r\nHost: good.test\r\nConnection: close\r\n\r\n")

    seen = guest.expect(
        {
            "fragment before @": (get("http://other.test#@good.test/"), True),
            "query before @": (get("http://other.test?@good.test/"), True),
            "userinfo": (get("http://good.test@other.test/"), True),
            "the allowed name in absolute form": (get("http://good.test/abs-ok"), True),
        }
    )
    assert {label: r["statuses"] for label, r in seen.items()} == {
        "fragment before @": [403],
        "query before @": [403],
        "userinfo": [403],
        "the allowed name in absolute form": [200],
    }, seen
    paths = [str(e.get("path")) for e in fakenet.events("http", since)]
    assert paths == ["http://good.test/abs-ok"], paths


# -- 5. tightening cuts what is open ----------------------------------------------------------


def hold(label: str, addr: str, port: int, sni: str | None = None) -> dict[str, Any]:
    check: dict[str, Any] = {"op": "hold", "label": label, "addr": addr, "port": port}
    if sni:
        check["sni"] = sni
    return {**check, "every": 0.2, "max_s": 100}


def test_tightening_cuts_connections_opened_before(guest: Guest, fakenet: FakeInternet) -> None:
    guest.set_rules(["good.test", fakenet.cdn])
    guest.expect({"learn good.test": (resolve("good.test"), True)})
    labels = ("by-name", "by-ip", "proxied-tls")
    guest.sb.exec(["sh", "-c", "rm -f /root/hold-*.log; echo 1 > /root/hold-phase"])
    checks = [
        hold("by-name", fakenet.web, 7),  # allowed through the address learned for good.test
        hold("by-ip", fakenet.cdn, 7),  # allowed by the ip rule
        hold("proxied-tls", fakenet.web, 443, sni="good.test"),  # relayed by the proxy
    ]
    outcome: list[list[dict[str, Any]]] = []
    runner = threading.Thread(target=lambda: outcome.append(guest.probe(checks)), daemon=True)
    runner.start()

    def entries(label: str, phase: str) -> list[str]:
        try:
            text = guest.sb.files.read(f"/root/hold-{label}.log").decode()
        except HutchError:
            return []
        return [line.split()[1] for line in text.splitlines() if line.split()[0] == phase]

    def phase(n: int, change: list[str]) -> None:
        """Pause the exchanges (none in flight), change the rules, run phase ``n``."""
        pause = f"pause-{n}"
        guest.sb.files.write("/root/hold-phase", f"{pause}\n".encode())
        wait_until(f"{pause}", lambda: all(entries(x, pause) == ["paused"] for x in labels))
        guest.set_rules(change)
        guest.sb.files.write("/root/hold-phase", f"{n}\n".encode())

        def done() -> bool:
            return all(len(entries(x, str(n))) >= 3 for x in labels)

        wait_until(f"phase {n} exchanges", done)

    try:
        wait_until("phase 1 exchanges", lambda: all(len(entries(x, "1")) >= 2 for x in labels))
        since = time.time()
        phase(2, ["good.test"])  # the ip rule goes; good.test stays
        phase(3, ["cdn2.test"])  # good.test goes too
    finally:
        guest.sb.files.write("/root/hold-phase", b"stop\n")
        runner.join(120)
    assert outcome, "the hold probe did not finish"
    got = {label: r["phases"] for label, r in zip(labels, outcome[0], strict=True)}
    summary = {
        label: {p: set(v) for p, v in phases.items() if not p.startswith("pause")}
        for label, phases in got.items()
    }
    assert summary == {
        "by-name": {"1": {True}, "2": {True}, "3": {False}},
        "by-ip": {"1": {True}, "2": {False}, "3": {False}},
        "proxied-tls": {"1": {True}, "2": {True}, "3": {False}},
    }, got
    denied = denials_since(guest, since)
    assert any(e.destination == fakenet.cdn and e.port == 7 for e in denied), denied
    assert any(e.protocol == "tls" and e.name == "good.test" for e in denied), denied


# -- 6. QUIC -------------------------------------------------------------------------------------


def test_udp_443_to_a_name_rules_address_is_blocked(guest: Guest, fakenet: FakeInternet) -> None:
    guest.set_rules(["good.test"])
    since = time.time()
    guest.expect({"learn good.test": (resolve("good.test"), True)})
    guest.expect(
        {
            "udp 443 (QUIC) to good.test's address": (udp(fakenet.web, 443), False),
            "https over TCP still works": (https("good.test"), True),
            "other udp ports of a name rule stay open": (udp(fakenet.web), True),
        }
    )
    guest.set_rules([fakenet.cdn])
    guest.expect({"an explicit ip rule opens udp 443": (udp(fakenet.cdn, 443), True)})
    quic = [e for e in denials_since(guest, since) if e.port == 443 and e.protocol == "udp"]
    assert any("QUIC" in e.reason for e in quic), quic
    echoed = [e.get("local") for e in fakenet.events("udp", since) if e.get("port") == 443]
    assert echoed == [fakenet.cdn], echoed
