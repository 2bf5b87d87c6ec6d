"""The fake internet the network tests use, proven from the host: every server answers
as the VM tests expect, records what reached it, and nothing of it outlives the test."""

from __future__ import annotations

import base64
import json
import os
import socket
import ssl
import struct
import time
from collections.abc import Iterator
from typing import Any

import dns.message
import dns.query
import dns.rcode
import pytest

from tests.netfake import FakeInternet, FakeInternetError

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (ip netns)"),
]


@pytest.fixture(scope="module")
def net() -> Iterator[FakeInternet]:
    with FakeInternet() as fi:
        yield fi


def http_get(addr: str, host: str, port: int = 80, path: str = "/", v6: bool = False) -> bytes:
    family = socket.AF_INET6 if v6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect((addr, port))
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        return _read_all(s)


def _read_all(s: socket.socket | ssl.SSLSocket) -> bytes:
    chunks = []
    while chunk := s.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def https_get(net: FakeInternet, addr: str, sni: str, host: str | None = None) -> dict[str, str]:
    ctx = ssl.create_default_context(cafile=str(net.ca_cert))
    with (
        socket.create_connection((addr, 443), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname=sni) as s,
    ):
        s.sendall(f"GET / HTTP/1.0\r\nHost: {host or sni}\r\n\r\n".encode())
        reply = _read_all(s)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200"), head
    answer: dict[str, str] = json.loads(body)
    return answer


def test_https_answers_with_the_sni_and_host_it_saw(net: FakeInternet) -> None:
    for name in ("good.test", "www.good.test", "other.test", "doh.test"):
        seen = https_get(net, net.web, name)
        assert (seen["sni"], seen["host"], seen["local"]) == (name, name, net.web)
    # A client lying about the name: the server reports exactly what it was told.
    seen = https_get(net, net.web, "other.test", host="good.test")
    assert (seen["sni"], seen["host"]) == ("other.test", "good.test")
    assert https_get(net, net.cdn, "cdn2.test")["local"] == net.cdn
    assert {e.get("sni") for e in net.events("https")} >= {"good.test", "other.test", "cdn2.test"}


def test_http_answers_with_the_host_header(net: FakeInternet) -> None:
    for name, addr in net.names.items():
        body = http_get(addr, name).partition(b"\r\n\r\n")[2]
        seen = json.loads(body)
        assert (seen["host"], seen["local"], seen["scheme"]) == (name, addr, "http")


def test_download_sends_the_bytes_asked_for(net: FakeInternet) -> None:
    reply = http_get(net.web, "good.test", path=f"/bytes/{3 << 20}")
    assert len(reply.partition(b"\r\n\r\n")[2]) == 3 << 20


def test_ipv6_web_server(net: FakeInternet) -> None:
    body = http_get(net.web6, "good.test", v6=True).partition(b"\r\n\r\n")[2]
    assert json.loads(body)["local"] == net.web6


def test_dns_is_authoritative_for_test_and_records_every_query(net: FakeInternet) -> None:
    since = time.time()

    def ask(name: str, rdtype: str, tcp: bool = False) -> dns.message.Message:
        q = dns.message.make_query(name, rdtype)
        send = dns.query.tcp if tcp else dns.query.udp
        return send(q, net.dns, timeout=5)

    assert [r.to_text() for r in ask("good.test", "A").answer[0]] == [net.web]
    assert [r.to_text() for r in ask("CDN2.test.", "A", tcp=True).answer[0]] == [net.cdn]
    assert [r.to_text() for r in ask("good.test", "AAAA").answer[0]] == [net.web6]
    assert [r.to_text() for r in ask("good.test", "TXT").answer[0]] == ['"fakenet good"']
    assert [r.to_text() for r in ask("rebind.test", "A").answer[0]] == ["127.0.0.1"]
    label = "a" * 63
    assert ask(f"{label}.exfil.test", "TXT").rcode() == dns.rcode.NXDOMAIN
    assert ask("example.com", "A").rcode() == dns.rcode.REFUSED
    asked = net.dns_queries(since)
    assert asked == [
        "good.test", "cdn2.test", "good.test", "good.test", "rebind.test",
        f"{label}.exfil.test", "example.com",
    ]  # fmt: skip
    assert net.rogue_queries(since) == []


def test_rogue_resolver_answers_anything(net: FakeInternet) -> None:
    since = time.time()
    reply = dns.query.udp(dns.message.make_query("anything.example", "A"), net.rogue, timeout=5)
    assert [r.to_text() for r in reply.answer[0]] == [net.web]
    assert net.rogue_queries(since) == ["anything.example"]
    assert net.dns_queries(since) == []


def test_doh_get_and_post(net: FakeInternet) -> None:
    since = time.time()
    wire = dns.message.make_query("other.test", "A").to_wire()
    ctx = ssl.create_default_context(cafile=str(net.ca_cert))
    param = base64.urlsafe_b64encode(wire).rstrip(b"=").decode()
    requests = [
        f"GET /dns-query?dns={param} HTTP/1.0\r\nHost: doh.test\r\n\r\n".encode(),
        b"POST /dns-query HTTP/1.0\r\nHost: doh.test\r\nContent-Type: application/dns-message"
        + f"\r\nContent-Length: {len(wire)}\r\n\r\n".encode()
        + wire,
    ]
    for request in requests:
        with (
            socket.create_connection((net.web, 443), timeout=5) as raw,
            ctx.wrap_socket(raw, server_hostname="doh.test") as s,
        ):
            s.sendall(request)
            reply = _read_all(s).partition(b"\r\n\r\n")[2]
        assert [r.to_text() for r in dns.message.from_wire(reply).answer[0]] == [net.web]
    assert net.dns_queries(since) == ["other.test", "other.test"]
    assert len(net.events("doh", since)) == 2


def test_udp_echo(net: FakeInternet) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5)
        s.sendto(b"ping-udp", (net.cdn, 7))
        assert s.recvfrom(100)[0] == b"ping-udp"
    assert net.events("udp")[-1].get("local") == net.cdn


def test_icmp_echo(net: FakeInternet) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as s:
        s.settimeout(5)
        payload = b"hutch"
        header = struct.pack("!BBHHH", 8, 0, 0, 0x4855, 1)
        csum = _checksum(header + payload)
        s.sendto(struct.pack("!BBHHH", 8, 0, csum, 0x4855, 1) + payload, (net.web, 0))
        while True:
            packet, (src, _) = s.recvfrom(1024)
            icmp = packet[(packet[0] & 0x0F) * 4 :]
            if src == net.web and icmp[0] == 0:
                break


def _checksum(data: bytes) -> int:
    padded = data + b"\0" * (len(data) % 2)
    total: int = sum(struct.unpack(f"!{len(padded) // 2}H", padded))
    total = (total >> 16) + (total & 0xFFFF)
    return ~(total + (total >> 16)) & 0xFFFF


@pytest.mark.parametrize(("port", "banner"), [(25, b"220 "), (2222, b"SSH-2.0-")])
def test_tcp_banners(net: FakeInternet, port: int, banner: bytes) -> None:
    with socket.create_connection((net.web, port), timeout=5) as s:
        assert s.recv(100).startswith(banner)
    assert net.events("tcp")[-1].get("port") == port


def test_two_instances_side_by_side_and_nothing_left() -> None:
    with FakeInternet() as a, FakeInternet() as b:
        assert a.prefix != b.prefix and a.ns != b.ns
        assert json.loads(http_get(b.web, "good.test").partition(b"\r\n\r\n")[2])["local"] == b.web
        objects = [*a.host_objects(), *b.host_objects()]
        assert len(objects) == 6
    assert [*a.host_objects(), *b.host_objects()] == []
    assert not a.work_dir.exists()


def test_cleanup_after_a_failure_in_the_body() -> None:
    made: list[FakeInternet] = []
    with pytest.raises(ZeroDivisionError), FakeInternet() as fi:
        made.append(fi)
        _ = 1 / 0
    assert list(made[0].host_objects()) == []
    made[0].close()  # twice is fine


def test_stale_namespace_of_a_dead_run_is_reaped() -> None:
    from tests.netfake.internet import _run, reap_stale_namespaces

    # A pid far above pid_max (4194304 at most) is never alive.
    stale = "hfn-99999999-abcdef"
    _run("ip", "netns", "add", stale)
    try:
        assert stale in reap_stale_namespaces()
        assert stale not in _run("ip", "netns", "list").stdout.split()
    finally:
        _run("ip", "netns", "del", stale, check=False)


def test_servers_failing_to_start_are_reported_and_cleaned() -> None:
    fi = FakeInternet(python="/bin/false")
    with pytest.raises(FakeInternetError, match="did not start"):
        fi.__enter__()
    assert list(fi.host_objects()) == []


def test_guest_probe_works_from_the_host(net: FakeInternet) -> None:
    """The probe the VM tests run in guests, run on the host: every op can succeed, so a
    failure inside a sandbox means the network said no, not that the probe is broken."""
    from tests.netfake.probe import run_checks

    ca = str(net.ca_cert)
    checks: list[dict[str, Any]] = [
        {"op": "http", "host": "good.test", "addr": net.web},
        {"op": "https", "sni": "other.test", "addr": net.web, "ca": ca},
        {"op": "tcp", "addr": net.web, "port": 2222},
        {"op": "tcp6", "addr": net.web6, "port": 80},
        {"op": "udp", "addr": net.cdn},
        {"op": "icmp", "addr": net.cdn},
        {"op": "dns", "server": net.dns, "name": "good.test", "qtype": "TXT"},
        {"op": "dns", "server": net.dns, "name": "cdn2.test", "tcp": True},
        {"op": "dns", "server": net.rogue, "name": "whatever.example"},
        {"op": "doh", "qname": "good.test", "addr": net.web, "ca": ca},
        {"op": "get", "addr": net.web, "host": "good.test", "size": 1 << 20},
        {"op": "ipv6"},
        {"op": "latency", "addr": net.web, "host": "good.test", "count": 3},
        {
            "op": "latency",
            "addr": net.web,
            "host": "good.test",
            "count": 2,
            "sni": "good.test",
            "ca": ca,
        },
    ]
    results = run_checks(checks)
    assert [(c, r) for c, r in zip(checks, results, strict=True) if not r["ok"]] == []
    assert results[1]["seen"]["sni"] == "other.test"
    assert results[6]["answers"] == ["fakenet good"]
    assert results[7]["answers"] == [net.cdn]
    assert results[9]["answers"] == [net.web]
    assert results[10]["bytes"] > 1 << 20
    assert [len(r["samples"]) for r in results[12:]] == [3, 2]
    failed = run_checks([{"op": "dns", "server": net.dns, "name": "nope.test"}])[0]
    assert (failed["ok"], failed["rcode"]) == (False, "NXDOMAIN")
    # A network "no" is an OSError; a broken check is flagged so tests never count it as one.
    refused, broken = run_checks([tcp_check(net.web, 9), {"op": "tcp", "addr": net.web}])
    assert refused["ok"] is False and "probe_bug" not in refused
    assert broken.get("probe_bug") is True


def tcp_check(addr: str, port: int) -> dict[str, Any]:
    return {"op": "tcp", "addr": addr, "port": port}


def test_free_net_pool_avoids_other_daemons_pools() -> None:
    import ipaddress

    from tests.netfake import free_net_pool

    pool = ipaddress.IPv4Network(free_net_pool())
    assert pool.prefixlen == 24 and pool.subnet_of(ipaddress.IPv4Network("10.199.0.0/16"))
