"""Egress with real VMs (the package's lab, ``conftest.py``): open egress and what stays
denied even then, hostname, port, cidr and ordered rules, partial inspection, DNS
rebinding, live changes."""

from __future__ import annotations

import contextlib
import ipaddress
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable

import pytest

from hutch.errors import HutchError
from hutch.sdk import EgressEvent
from tests.e2e.conftest import Daemon
from tests.netfake import FakeInternet
from tests.vm.netlab import (
    NETWORK_VM_MARKS,
    Guest,
    dns,
    gateway_of,
    http,
    https,
    icmp,
    resolve,
    tcp,
    udp,
)

pytestmark = NETWORK_VM_MARKS


# -- open egress ----------------------------------------------------------------------------


def test_open_egress_without_rules(alpha: Guest, fakenet: FakeInternet) -> None:
    egress = alpha.sb.egress.get()
    assert (egress.mode, egress.rules) == ("open", [])
    since = time.time()
    seen = alpha.expect(
        {
            "https by name": (https("good.test"), True),
            "http other name": (http("other.test"), True),
            "http raw IP": (http("cdn2.test", addr=fakenet.cdn), True),
            "tcp 2222": (tcp(fakenet.web, 2222), True),
            "udp echo": (udp(fakenet.cdn), True),
            "icmp": (icmp(fakenet.cdn), True),
            "resolve": (resolve("www.good.test"), True),
        }
    )
    assert seen["https by name"]["seen"]["sni"] == "good.test"
    assert seen["resolve"]["addrs"] == [fakenet.web]
    # The fake internet saw them come through the host's NAT.
    assert {e.get("peer") for e in fakenet.events("https", since)} == {fakenet.gateway}


def test_a_failure_report_says_whether_the_guest_s_timers_run(alpha: Guest) -> None:
    """What a probe that never ends reports (``Guest.diagnostics``): the guest's clock
    read twice a second apart by the host's, its timer interrupts, its processes and
    clockevent; on a healthy guest the two readings are about a second apart."""
    report = alpha.diagnostics()
    nows = [int(n) for n in re.findall(r"now at (\d+) nsecs", report)]
    assert len(nows) >= 2, report
    assert 0.5e9 < max(nows) - min(nows) < 30e9, report  # the guest's clock moved on
    assert report.count("LOC:") == 2, report  # local timer interrupts, both readings
    assert "PID STAT WCHAN" in report and "agent.py" in report, report  # processes
    assert "no diagnostics" not in report, report


def test_always_denied_even_when_open(alpha: Guest, fakenet: FakeInternet, netd: Daemon) -> None:
    alpha.set_rules([])
    since = time.time()
    host_hits: list[str] = []
    # A listener on every host address: the guest must reach none of them.
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        stop = threading.Event()

        def accept() -> None:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    conn, peer = listener.accept()
                    host_hits.append(str(peer))
                    conn.close()

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        gw = gateway_of(alpha.sb)
        try:
            alpha.expect(
                {
                    "smtp 25": (tcp(fakenet.web, 25), False),
                    "metadata": (http("metadata", addr="169.254.169.254"), False),
                    "host via tap gateway": (tcp(gw, port), False),
                    "host via its uplink address": (tcp(fakenet.gateway, port), False),
                    "daemon API via gateway": (http("api", addr=gw, port=netd.port), False),
                    "still open otherwise": (tcp(fakenet.web, 2222), True),
                }
            )
        finally:
            stop.set()
            thread.join()
    assert host_hits == []
    assert [e for e in fakenet.events("tcp", since) if e.get("port") == 25] == []


# -- hostname rules --------------------------------------------------------------------------


def test_only_the_listed_name_works(alpha: Guest, fakenet: FakeInternet) -> None:
    alpha.set_rules(["good.test"])
    egress = alpha.sb.egress.get()
    assert (egress.mode, egress.rules) == ("rules", ["good.test"])
    seen = alpha.expect(
        {
            "https good.test": (https("good.test"), True),
            "http good.test": (http("good.test"), True),
            "GOOD.TEST. (case, dot)": (resolve("GOOD.TEST."), True),
            "other.test": (resolve("other.test"), False),
            "www.good.test": (resolve("www.good.test"), False),
            "cdn2.test": (resolve("cdn2.test"), False),
        }
    )
    assert seen["https good.test"]["seen"]["sni"] == "good.test"
    assert seen["http good.test"]["seen"]["host"] == "good.test"


def test_host_resolves_the_name_itself(alpha: Guest, fakenet: FakeInternet) -> None:
    """The guest dials cdn2's address with an allowed name: the proxy connects to what
    *it* resolved for good.test, not to the address the guest chose."""
    alpha.set_rules(["good.test"])
    seen = alpha.expect(
        {
            "https via wrong address": (https("good.test", addr=fakenet.cdn), True),
            "http via wrong address": (http("good.test", addr=fakenet.cdn), True),
        }
    )
    assert seen["https via wrong address"]["seen"]["local"] == fakenet.web
    assert seen["http via wrong address"]["seen"]["local"] == fakenet.web


def test_bypass_attempts_fail_and_are_logged(alpha: Guest, fakenet: FakeInternet) -> None:
    alpha.set_rules(["good.test"])
    before = alpha.sb.egress.get()
    since = time.time()
    secret = secrets.token_hex(20)
    long_label = (secret + "x" * 63)[:63]
    gw = gateway_of(alpha.sb)
    alpha.expect(
        {
            "SNI mismatch on shared address": (https("other.test", addr=fakenet.web), False),
            "Host mismatch on shared address": (http("other.test", addr=fakenet.web), False),
            "raw IP http": (http("cdn2.test", addr=fakenet.cdn), False),
            "raw IP https": (https("cdn2.test", addr=fakenet.cdn), False),
            "raw IP tcp": (tcp(fakenet.cdn, 2222), False),
            "rogue resolver udp": (dns(fakenet.rogue, "anything.evil.test"), False),
            "rogue resolver tcp": (dns(fakenet.rogue, "tcp.evil.test", tcp=True), False),
            "upstream directly": (dns(fakenet.dns, "other.test"), False),
            "TXT exfiltration": (dns(gw, f"{secret}.exfil.test", "TXT"), False),
            "long-label exfiltration": (dns(gw, f"{long_label}.{long_label}.test", "TXT"), False),
            "DoH by name": ({"op": "doh", "qname": "other.test"}, False),
            "DoH by address": ({"op": "doh", "qname": "other.test", "addr": fakenet.web}, False),
            "udp unlisted": (udp(fakenet.cdn), False),
            "icmp unlisted": (icmp(fakenet.cdn), False),
            "ipv6 tcp": ({"op": "tcp6", "addr": fakenet.web6, "port": 80}, False),
            "AAAA is empty": (dns(gw, "good.test", "AAAA"), False),
        }
    )
    assert alpha.probe([{"op": "ipv6"}])[0]["global"] == []
    # Nothing of it reached the fake internet.
    leaked = [q for q in fakenet.dns_queries(since) if q != "good.test"]
    assert leaked == [], "names reached the upstream DNS server"
    assert fakenet.rogue_queries(since) == []
    assert fakenet.events("doh", since) == []
    hits = fakenet.events("http", since) + fakenet.events("https", since)
    assert [
        e.fields for e in hits if e.get("host") != "good.test" or e.get("local") != fakenet.web
    ] == []
    assert [e.fields for e in fakenet.events("tcp", since)] == []
    assert [e.fields for e in fakenet.events("udp", since)] == []
    # Each denial is in the egress log and counted.
    events = alpha.sb.egress.log(limit=1000)
    denied = [
        e for e in events if e.verdict == "deny" and e.time and e.time.timestamp() >= since - 1
    ]
    expected: dict[str, Callable[[EgressEvent], bool]] = {
        "name lookup (dns)": lambda e: e.protocol == "dns" and e.name == "other.test",
        "SNI mismatch (tls)": lambda e: e.protocol == "tls" and e.name == "other.test",
        "Host mismatch (http)": lambda e: e.protocol == "http" and e.name == "other.test",
        "raw IP over the proxy": lambda e: e.name == "cdn2.test" and e.port in (80, 443),
        "raw IP tcp": lambda e: (e.protocol, e.destination, e.port) == ("tcp", fakenet.cdn, 2222),
        "udp": lambda e: (e.protocol, e.destination) == ("udp", fakenet.cdn),
        "icmp": lambda e: (e.protocol, e.destination) == ("icmp", fakenet.cdn),
        "rogue resolver": lambda e: e.protocol == "dns" and "evil.test" in str(e.name),
        "exfiltration": lambda e: e.protocol == "dns" and secret in str(e.name),
        "DoH": lambda e: e.name == "doh.test",
    }
    missing = [what for what, match in expected.items() if not any(match(e) for e in denied)]
    assert not missing, f"no egress-log denial for {missing}; denials: {denied}"
    after = alpha.sb.egress.get()
    assert after.denied >= before.denied + 8, (before, after)


def test_wildcard_matches_subdomains_not_the_apex(alpha: Guest) -> None:
    alpha.set_rules(["*.good.test"])
    web = alpha.probe([resolve("www.good.test")])[0]["addrs"][0]
    alpha.expect(
        {
            "www.good.test": (https("www.good.test"), True),
            "apex by name": (resolve("good.test"), False),
            "apex SNI via shared address": (https("good.test", addr=web), False),
        }
    )
    alpha.set_rules(["*.good.test", "good.test"])
    alpha.expect(
        {
            "www.good.test": (https("www.good.test"), True),
            "apex listed": (https("good.test"), True),
        }
    )


def test_host_port_allows_that_port_only(alpha: Guest, fakenet: FakeInternet) -> None:
    alpha.set_rules(["good.test:443"])
    alpha.expect(
        {
            "https 443": (https("good.test"), True),
            "http 80": (http("good.test", addr=fakenet.web), False),
            "tcp 2222": (tcp(fakenet.web, 2222), False),
        }
    )


def test_cidr_and_ip_port_rules(alpha: Guest, fakenet: FakeInternet) -> None:
    cdn_net = ipaddress.IPv4Network(f"{fakenet.cdn}/28", strict=False)
    assert ipaddress.IPv4Address(fakenet.web) not in cdn_net
    alpha.set_rules([str(cdn_net)])
    alpha.expect(
        {
            "http in cidr": (http("cdn2.test", addr=fakenet.cdn), True),
            "tcp in cidr": (tcp(fakenet.cdn, 2222), True),
            "udp in cidr": (udp(fakenet.cdn), True),
            "icmp in cidr": (icmp(fakenet.cdn), True),
            "outside cidr": (http("good.test", addr=fakenet.web), False),
            "names are not rules": (resolve("good.test"), False),
        }
    )
    alpha.set_rules([f"{fakenet.cdn}:2222"])
    alpha.expect(
        {
            "ip:port": (tcp(fakenet.cdn, 2222), True),
            "other port": (http("cdn2.test", addr=fakenet.cdn), False),
            "udp": (udp(fakenet.cdn), False),
        }
    )


def test_an_ordered_policy_first_match_wins(alpha: Guest, fakenet: FakeInternet) -> None:
    """An ordered policy on the same enforcement: a deny before a wildcard allow holds
    for DNS and for SNI/Host on a shared address; an ip deny is cut out of a cidr allow;
    the default denies the rest. Then the order reversed: the allow wins."""
    cdn_net = ipaddress.IPv4Network(f"{fakenet.cdn}/28", strict=False)
    assert ipaddress.IPv4Address(fakenet.web) not in cdn_net
    policy = {
        "default": "deny",
        "rules": [
            {"action": "deny", "host": "www.good.test"},
            {"action": "allow", "host": "*.good.test"},
            {"action": "allow", "host": "good.test:443"},
            {"action": "deny", "host": f"{fakenet.cdn}"},
            {"action": "allow", "host": str(cdn_net)},
        ],
    }
    info = alpha.sb.set_egress(policy=policy)
    assert info.mode == "rules" and info.policy is not None
    assert info.rules[0] == "rules[0] deny www.good.test" and info.rules[-1] == "default deny"
    seen = alpha.expect(
        {
            "good.test 443": (https("good.test"), True),
            "good.test 80 (default)": (http("good.test"), False),
            "www.good.test by name": (resolve("www.good.test"), False),
            "www.good.test SNI on good.test's address": (
                https("www.good.test", addr=fakenet.web),
                False,
            ),
            "denied ip inside the allowed cidr": (tcp(fakenet.cdn, 2222), False),
            "other.test (default)": (resolve("other.test"), False),
        }
    )
    assert seen["good.test 443"]["seen"]["sni"] == "good.test"
    denied = [
        e for e in alpha.sb.egress.log(200) if e.name == "www.good.test" and e.protocol == "tls"
    ]
    assert denied and denied[-1].rule == "rules[0] deny www.good.test", denied
    alpha.sb.set_egress(policy={**policy, "rules": [policy["rules"][1], policy["rules"][0]]})
    alpha.expect({"www.good.test (allow first)": (https("www.good.test"), True)})


def test_partial_inspection_decides_plain_http_by_method_and_path(
    alpha: Guest, fakenet: FakeInternet
) -> None:
    """inspection partial, plain HTTP from the guest: GET /docs allowed, POST /admin
    denied with a 403 naming the rule, the default for the rest; HTTPS to that host is
    terminated by hutch (tests/vm/test_network_inspect.py), so the probe, which trusts
    only the fake internet's CA, cannot complete it (nor can this daemon verify the fake
    upstream: it trusts the host's store only)."""
    alpha.sb.set_egress(
        policy={
            "default": "deny",
            "inspection": "partial",
            "rules": [
                {"action": "deny", "host": "good.test", "methods": ["POST"], "path": "/admin"},
                {"action": "allow", "host": "good.test", "methods": ["GET"], "path": "/docs"},
            ],
        }
    )
    seen = alpha.expect(
        {
            "GET /docs/a": (http("good.test", path="/docs/a?x=1"), True),
            "GET /admin (default)": (http("good.test", path="/admin"), False),
            "GET /docsearch (segments)": (http("good.test", path="/docsearch"), False),
            "https good.test": (https("good.test", path="/docs"), False),
            # Request rules open the web ports only: another port of the same (learned)
            # address would carry HTTP past the path check.
            "tcp 2222 of good.test": (tcp(fakenet.web, 2222), False),
        }
    )
    assert seen["GET /admin (default)"]["status"] == 403
    post = alpha.sb.exec(
        "curl -s -w ' %{http_code}' -X POST --data x http://good.test/admin", timeout_s=60
    )
    assert post.stdout.endswith(" 403"), post
    assert "rules[0] deny POST good.test/admin denies POST /admin on good.test:80" in post.stdout
    events = [e for e in alpha.sb.egress.log(50) if e.method is not None]
    assert ("GET", "/docs/a", 1, "allow") in [
        (e.method, e.path, e.rule_index, e.verdict) for e in events
    ], events
    assert not any("x=1" in (e.path or "") for e in events)


def test_dns_rebinding_is_refused(alpha: Guest, fakenet: FakeInternet) -> None:
    """Allowed names that resolve into loopback, private or metadata ranges: the proxy
    resolves them itself and refuses (the guest dials a public address)."""
    alpha.set_rules(["rebind.test", "private.test", "meta.test"])
    alpha.expect(
        {
            "loopback": (http("rebind.test", addr=fakenet.web), False),
            "rfc1918": (https("private.test", addr=fakenet.web), False),
            "metadata": (http("meta.test", addr=fakenet.web), False),
        }
    )


def test_live_change_without_restart(alpha: Guest, fakenet: FakeInternet, netd: Daemon) -> None:
    pid = netd.qemu_pid_of(alpha.sb.id)
    boot_id = alpha.sb.exec(["cat", "/proc/sys/kernel/random/boot_id"]).stdout
    alpha.set_rules(["good.test"])
    alpha.expect({"good": (https("good.test"), True), "other": (resolve("other.test"), False)})
    alpha.set_rules(["other.test"])
    alpha.expect(
        {
            "other now": (https("other.test"), True),
            "good no more (name)": (resolve("good.test"), False),
            "good no more (SNI)": (https("good.test", addr=fakenet.web), False),
        }
    )
    alpha.set_rules(["deny-all"])
    assert alpha.sb.egress.get().mode == "deny-all"
    alpha.expect(
        {
            "deny-all name": (resolve("other.test"), False),
            "deny-all https": (https("other.test", addr=fakenet.web), False),
            "deny-all ip": (tcp(fakenet.cdn, 2222), False),
        }
    )
    # A bad rule set is refused as a whole, naming the rule; the old rules stay.
    alpha.set_rules(["good.test"])
    with pytest.raises(HutchError, match=r"bad\.\.name"):
        alpha.sb.egress.set(["other.test", "bad..name"])
    assert alpha.sb.egress.get().rules == ["good.test"]
    alpha.expect({"good": (https("good.test"), True), "other": (resolve("other.test"), False)})
    assert netd.qemu_pid_of(alpha.sb.id) == pid
    assert alpha.sb.exec(["cat", "/proc/sys/kernel/random/boot_id"]).stdout == boot_id
