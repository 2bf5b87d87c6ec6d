"""Egress inspection with a real VM against the fake internet (issue 12).

One daemon told to trust the fake internet's test CA for upstream TLS
(``HUTCH_EGRESS_UPSTREAM_CA``), one guest created with an ordered policy whose
inspection is ``full``; later tests change its policy live (partial, default allow
with denies, learn, dry run), so the module boots one VM. The guest trusts nothing but
its system store and the variables hutch sets: hutch's proxy terminates its TLS with a
leaf from the guest's project's CA, decides every request by method and path, and
injects a secret into requests to one host. What the fake upstream received is read
from its own log; the probe (``tests/netfake/probe.py``, trusting only the fake
internet's CA) checks raw TCP, UDP and TLS passed through untouched.

Nothing but the fake internet's addresses is contacted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hutch.errors import HutchError
from hutch.sdk import Client, Sandbox
from tests.e2e.conftest import Daemon
from tests.netfake import FakeInternet
from tests.vm.netlab import NETWORK_VM_MARKS, PROBE, Guest, https, network_daemon, resolve, tcp, udp

pytestmark = NETWORK_VM_MARKS

SECRET = "sk-inspect-4f1c9a7e2b8d"
POLICY = {
    "default": "deny",
    "inspection": "full",
    "rules": [
        {"action": "deny", "host": "good.test", "methods": ["POST"], "path": "/admin"},
        {"action": "allow", "host": "good.test", "methods": ["GET"], "path": "/docs"},
        {
            "action": "transform",
            "host": "other.test",
            "path": "/echo",
            "set_headers": {"Authorization": "Bearer {secret:upstream-key}"},
        },
    ],
}


@pytest.fixture(scope="module")
def netd(fakenet: FakeInternet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    env = {"HUTCH_EGRESS_UPSTREAM_CA": str(fakenet.ca_cert)}
    with network_daemon(tmp_path_factory.mktemp("hutchd-inspect"), fakenet, env) as d:
        yield d


@pytest.fixture(scope="module")
def client(netd: Daemon) -> Iterator[Client]:
    with netd.client(timeout=300.0) as c:
        yield c


@pytest.fixture(scope="module")
def guest(client: Client) -> Iterator[Sandbox]:
    client.secrets.set("upstream-key", SECRET)
    sb = Sandbox.create("base", memory_mib=256, name="inspect", egress=POLICY, client=client)
    sb.files.write("/root/probe.py", PROBE.read_bytes())
    yield sb
    with contextlib.suppress(HutchError):
        sb.kill()


def curl(sb: Sandbox, *args: str) -> tuple[str, str]:
    """(body, status) of ``curl`` in the guest: no -k, no --cacert (the guest's store)."""
    out = sb.exec(["curl", "-sS", "-o", "/tmp/body", "-w", "%{http_code}", *args], timeout_s=90)
    body = sb.exec(["cat", "/tmp/body"], timeout_s=30).stdout
    return body, out.stdout.strip() or out.stderr


def test_https_paths_are_decided_through_the_terminating_proxy(
    guest: Sandbox, fakenet: FakeInternet
) -> None:
    """curl to an allowed path works (the guest trusts hutch's CA from its system store),
    a denied path gets a 403 naming the rule and the egress log names it too; the fake
    upstream saw only the allowed request, with the guest's SNI."""
    body, status = curl(guest, "https://good.test/docs/intro?x=1")
    assert status == "200", (status, body)
    seen = json.loads(body)
    assert (seen["scheme"], seen["sni"], seen["path"]) == ("https", "good.test", "/docs/intro?x=1")
    body, status = curl(guest, "-X", "POST", "--data", "x", "https://good.test/admin")
    assert status == "403", (status, body)
    assert "rules[0] deny POST good.test/admin denies POST /admin on good.test:443" in body
    events = guest.egress.log(50)
    assert ("POST", "/admin", 0, "deny") in [
        (e.method, e.path, e.rule_index, e.verdict) for e in events
    ], events
    assert ("GET", "/docs/intro", 1, "allow") in [
        (e.method, e.path, e.rule_index, e.verdict) for e in events
    ], events
    https = [e for e in fakenet.events("https") if (e.get("path") or "").startswith("/admin")]
    assert https == [], "the denied request reached the upstream"
    body, status = curl(guest, "https://other.test/elsewhere")
    assert status == "403" and "default is deny" in body, (status, body)
    # Not HTTP(S): under full only 80/443 of allowed names are open (nothing uninspected).
    code = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('{fakenet.web}', 2222), timeout=5).recv(64)\n"
        "    print('open')\n"
        "except OSError as exc:\n"
        "    print('blocked', exc)\n"
    )
    out = guest.exec(["python3", "-c", code], timeout_s=60)
    assert out.stdout.startswith("blocked"), out
    # UDP too (the fake's echo on the allowed names' address), and QUIC.
    probe(guest, fakenet).expect(
        {"udp 7": (udp(fakenet.web), False), "udp 443": (udp(fakenet.web, 443), False)}
    )


def probe(sb: Sandbox, fakenet: FakeInternet) -> Guest:
    """The probe, trusting only the fake internet's CA (TLS hutch terminates fails it)."""
    sb.files.write("/root/fakenet-ca.pem", fakenet.ca_cert.read_bytes())
    return Guest(sb)


def test_python_urllib_works_with_no_flags(guest: Sandbox) -> None:
    code = (
        "import urllib.request, json;"
        "r = urllib.request.urlopen('https://good.test/docs/py', timeout=60);"
        "print(r.status, json.loads(r.read())['sni'])"
    )
    out = guest.exec(["python3", "-c", code], timeout_s=120)
    assert out.stdout.split() == ["200", "good.test"], out


def test_an_injected_credential_reaches_the_upstream_and_never_the_guest(
    guest: Sandbox, fakenet: FakeInternet, netd: Daemon
) -> None:
    """The transform's {secret:upstream-key} is added on the host: the fake upstream
    received it; the guest's answer (the upstream echoes it) shows stars; the guest's
    env, every process environment, its files and its memory (dumped by a memory-mode
    pause; a marker written in the guest is found there, the secret is not) hold no
    trace of it."""
    body, status = curl(guest, "https://other.test/echo")
    assert status == "200", (status, body)
    got = [e for e in fakenet.events("https") if e.get("path") == "/echo"]
    assert got and got[-1].get("authorization") == f"Bearer {SECRET}", got
    assert SECRET not in body
    assert json.loads(body)["authorization"] == "Bearer " + "*" * len(SECRET)
    # The guest's memory first (the scans below carry the secret into the guest as their
    # own pattern): a memory-mode pause writes its RAM to a file on the host.
    marker = "hutch-memory-marker-" + os.urandom(6).hex()
    keep = guest.exec(f"echo {marker} > /tmp/marker && cat /tmp/marker /tmp/body", timeout_s=30)
    assert keep.exit_code == 0, keep
    guest.pause(mode="memory")
    try:
        dumps = [
            p
            for p in netd.state_dir.rglob("*")
            if p.is_file() and guest.id in str(p) and "pause" in p.parts
        ]  # fmt: skip
        assert dumps, f"no memory dump under {netd.state_dir} for {guest.id}"
        found = {needle: any(_contains(p, needle.encode()) for p in dumps)
                 for needle in (marker, SECRET)}  # fmt: skip
    finally:
        guest.resume()
    assert found == {marker: True, SECRET: False}, (found, dumps)
    env = guest.exec(["env"], timeout_s=30).stdout
    assert SECRET not in env
    assert "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt" in env
    scan = guest.exec(
        "cat /proc/[0-9]*/environ 2>/dev/null | grep -c " + SECRET + "; "
        "grep -rl " + SECRET + " /etc /root /tmp /var /home /usr/local /run 2>/dev/null; true",
        timeout_s=240,
    )
    assert scan.stdout.split() == ["0"], scan
    assert all(SECRET not in (e.reason or "") for e in guest.egress.log(200))


def _contains(path: Path, needle: bytes, chunk: int = 16 << 20) -> bool:
    """Does the file hold ``needle`` (read in chunks that overlap by its length)?"""
    with path.open("rb") as f:
        tail = b""
        while piece := f.read(chunk):
            if needle in tail + piece:
                return True
            tail = piece[-len(needle) :]
    return False


def test_learn_then_suggest_then_apply(guest: Sandbox, fakenet: FakeInternet) -> None:
    """inspection learn lets everything out and logs it (HTTPS requests included, since
    TLS is terminated); the suggestion made from the log lets the same run pass, and a
    destination or path the run did not use fails."""
    guest.set_egress(policy={"inspection": "learn"})
    body, status = curl(guest, "https://good.test/docs/learned")
    assert status == "200", (status, body)
    body, status = curl(guest, "http://other.test/plain")
    assert status == "200", (status, body)
    learned = [e for e in guest.egress.log(200) if e.path in ("/docs/learned", "/plain")]
    assert {e.verdict for e in learned} == {"allow"}, learned
    assert all(e.reason.startswith("learn: would be denied") for e in learned), learned
    policy = guest.egress.suggest()
    assert policy["inspection"] == "full"
    assert {"action": "allow", "host": "good.test:443", "methods": ["GET"],
            "path": "/docs/learned"} in policy["rules"], policy  # fmt: skip
    assert {"action": "allow", "host": "other.test:80", "methods": ["GET"],
            "path": "/plain"} in policy["rules"], policy  # fmt: skip
    guest.set_egress(policy=policy)
    assert curl(guest, "https://good.test/docs/learned")[1] == "200"
    assert curl(guest, "http://other.test/plain")[1] == "200"
    body, status = curl(guest, "https://good.test/docs/new")
    assert status == "403" and "default is deny" in body, (status, body)
    reached = [e for e in fakenet.events("https") if e.get("path") == "/docs/new"]
    assert reached == []


def test_partial_terminates_only_where_a_rule_needs_it_and_lets_non_http_out(
    guest: Sandbox, fakenet: FakeInternet
) -> None:
    """inspection partial: TLS to the transform's host is terminated (the secret is
    injected, the guest sees stars), TLS to a plainly allowed name passes untouched (the
    probe, trusting only the fake's CA, completes its handshake), and non-HTTP TCP and
    UDP reach the allowed name's address; other addresses stay closed."""
    guest.set_egress(
        policy={
            "inspection": "partial",
            "rules": [
                {"action": "transform", "host": "other.test", "path": "/echo",
                 "set_headers": {"Authorization": "Bearer {secret:upstream-key}"}},
                {"action": "allow", "host": "good.test"},
            ],
        }
    )  # fmt: skip
    body, status = curl(guest, "https://other.test/echo")
    assert status == "200", (status, body)
    assert json.loads(body)["authorization"] == "Bearer " + "*" * len(SECRET)
    got = [e for e in fakenet.events("https") if e.get("path") == "/echo"]
    assert got[-1].get("authorization") == f"Bearer {SECRET}", got
    probe(guest, fakenet).expect(
        {
            "resolve good.test": (resolve("good.test"), True),
            "tls good.test passes untouched": (https("good.test", path="/docs"), True),
            "tcp 2222 of good.test's address": (tcp(fakenet.web, 2222), True),
            "udp 7 of good.test's address": (udp(fakenet.web), True),
            "udp 7 elsewhere": (udp(fakenet.cdn), False),
            "tcp 2222 elsewhere": (tcp(fakenet.cdn, 2222), False),
        }
    )


def test_default_allow_with_denies_by_name_address_and_request(
    guest: Sandbox, fakenet: FakeInternet
) -> None:
    """default allow with deny rules: a denied name is refused in DNS, by SNI and by
    Host (also behind an allowed SNI: fronting), an ip deny holds for the guest's own
    packets and for the proxy's connection to a name resolving there, and POST /admin
    of an otherwise open host gets a 403 naming the rule; everything else is open.
    Then inspection full under default allow: non-HTTP TCP and UDP are blocked."""
    since = time.time()
    guest.set_egress(
        policy={
            "default": "allow",
            "inspection": "partial",
            "rules": [
                {"action": "deny", "host": "other.test"},
                {"action": "deny", "host": fakenet.cdn},
                {"action": "deny", "host": "good.test", "methods": ["POST"], "path": "/admin"},
            ],
        }
    )
    body, status = curl(guest, "https://good.test/docs/open")
    assert status == "200", (status, body)
    body, status = curl(guest, "-X", "POST", "--data", "x", "https://good.test/admin")
    assert status == "403" and "rules[2] deny POST good.test/admin" in body, (status, body)
    body, status = curl(guest, "-H", "Host: other.test", "https://good.test/docs")
    assert status == "403" and "domain fronting" in body, (status, body)
    g = probe(guest, fakenet)
    g.expect(
        {
            "DNS other.test": (resolve("other.test"), False),
            "SNI other.test on the shared address": (
                https("other.test", addr=fakenet.web), False),
            "Host other.test on the shared address": (
                {"op": "http", "host": "other.test", "addr": fakenet.web}, False),
            "SNI cdn2.test (resolves to the denied ip)": (https("cdn2.test"), False),
            "tcp to the denied ip": (tcp(fakenet.cdn, 2222), False),
            "udp to the denied ip": (udp(fakenet.cdn), False),
            "QUIC to the shared address": (udp(fakenet.web, 443), False),
            "tcp elsewhere (open)": (tcp(fakenet.web, 2222), True),
            "udp elsewhere (open)": (udp(fakenet.web), True),
        }
    )  # fmt: skip
    reached = [
        e.fields for e in fakenet.events(since=since)
        if e.get("local") == fakenet.cdn or "other.test" in (e.get("host"), e.get("sni"))
        or (e.get("path") == "/admin")
    ]  # fmt: skip
    assert reached == [], reached
    guest.set_egress(policy={"default": "allow", "inspection": "full"})
    assert curl(guest, "https://good.test/docs/full")[1] == "200"
    g.expect({"tcp 2222": (tcp(fakenet.web, 2222), False), "udp 7": (udp(fakenet.web), False)})


def test_dry_run_logs_what_it_would_deny_without_denying(
    guest: Sandbox, fakenet: FakeInternet
) -> None:
    guest.set_egress(
        policy={"dry_run": True, "inspection": "full",
                "rules": [{"action": "allow", "host": "good.test", "path": "/docs"}]}
    )  # fmt: skip
    body, status = curl(guest, "https://good.test/elsewhere-dry")
    assert status == "200", (status, body)
    assert [e for e in fakenet.events("https") if e.get("path") == "/elsewhere-dry"]
    logged = [e for e in guest.egress.log(100) if e.path == "/elsewhere-dry"]
    assert logged and logged[-1].verdict == "allow", logged
    assert logged[-1].reason.startswith("dry run: would be denied"), logged


# ---- protocols and clients through "full" (issue 12 item 2): one devbox guest ---------

DEVBOX_POLICY = {
    "default": "deny",
    "inspection": "full",
    "rules": [
        {"action": "deny", "host": "good.test", "path": "/admin"},
        {"action": "allow", "host": "good.test"},
    ],
}
BIG = 100 << 20  # the fake internet's /bytes/N sends N bytes of 0xa5
WS_CLIENT = r"""
import base64, hashlib, os, socket, ssl
ctx = ssl.create_default_context()  # the system store (hutch's CA is in it), no flags
s = ctx.wrap_socket(socket.create_connection(("good.test", 443), timeout=60),
                    server_hostname="good.test")
key = base64.b64encode(os.urandom(16)).decode()
s.sendall(("GET /ws HTTP/1.1\r\nHost: good.test\r\nUpgrade: websocket\r\n"
           "Connection: Upgrade\r\nSec-WebSocket-Key: " + key + "\r\n"
           "Sec-WebSocket-Version: 13\r\n\r\n").encode())
f = s.makefile("rb")
status = f.readline().split()[1].decode()
fields = {}
while line := f.readline().strip():
    k, _, v = line.decode().partition(":")
    fields[k.strip().lower()] = v.strip()
want = base64.b64encode(hashlib.sha1(
    key.encode() + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest()).decode()
def frame(op, data):
    mask, n = os.urandom(4), len(data)
    size = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big")
    return bytes([0x80 | op]) + size + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))
def read():
    head = f.read(2)
    n = head[1] & 0x7F
    if n == 126:
        n = int.from_bytes(f.read(2), "big")
    return head[0] & 0x0F, f.read(n)
echoed = []
for msg in (b"hello hutch", os.urandom(3000)):
    s.sendall(frame(2, msg))
    echoed.append(read() == (2, msg))
s.sendall(frame(8, b""))
print(status, fields.get("sec-websocket-accept") == want, all(echoed), read()[0])
"""


@pytest.fixture(scope="module")
def devbox(client: Client) -> Iterator[Sandbox]:
    from tests.conftest import ensure_image

    ensure_image("devbox")
    sb = Sandbox.create(
        "devbox", memory_mib=1024, disk_gib=6, name="inspect-devbox", egress=DEVBOX_POLICY,
        client=client,
    )  # fmt: skip
    yield sb
    with contextlib.suppress(HutchError):
        sb.kill()


def test_clients_and_protocols_through_full_with_no_flags(
    devbox: Sandbox, fakenet: FakeInternet
) -> None:
    """The devbox guest's own clients, with no flags and no CA options, through TLS
    inspection: curl over HTTP/2 (negotiated h2; a denied path a 403 on its stream),
    Python requests (the copy pip ships: the image has no other), Node's fetch, a
    WebSocket echo, and a 100 MiB download over HTTP/2 whose sha256 matches."""
    out = devbox.exec(
        ["curl", "-sS", "--http2", "-o", "/dev/null", "-w", "%{http_version} %{http_code}",
         "https://good.test/docs/h2"], timeout_s=120,
    )  # fmt: skip
    assert out.stdout.split() == ["2", "200"], out
    out = devbox.exec(
        ["curl", "-sS", "--http2", "-w", " %{http_version} %{http_code}",
         "https://good.test/admin/x"], timeout_s=120,
    )  # fmt: skip
    assert out.stdout.endswith(" 2 403") and "rules[0] deny good.test/admin" in out.stdout, out
    code = (
        "from pip._vendor import requests\n"
        "r = requests.get('https://good.test/docs/requests', timeout=60)\n"
        "print(r.status_code, r.json()['sni'])\n"
    )
    out = devbox.exec(["python3", "-c", code], timeout_s=180)
    assert out.stdout.split() == ["200", "good.test"], out
    js = (
        "fetch('https://good.test/docs/node').then(async r => "
        "console.log(r.status, (await r.json()).sni))"
    )
    out = devbox.exec(["node", "-e", js], timeout_s=180)
    assert out.stdout.split() == ["200", "good.test"], out
    out = devbox.exec(["python3", "-c", WS_CLIENT], timeout_s=120)
    assert out.stdout.split() == ["101", "True", "True", "8"], out
    out = devbox.exec(f"curl -sS --http2 https://good.test/bytes/{BIG} | sha256sum", timeout_s=600)
    assert out.stdout.split()[0] == hashlib.sha256(b"\xa5" * BIG).hexdigest(), out
    paths = {(e.method, e.path, e.verdict) for e in devbox.egress.log(200)}
    for path in ("/docs/h2", "/docs/requests", "/docs/node", "/ws", f"/bytes/{BIG}"):
        assert ("GET", path, "allow") in paths, paths
    assert ("GET", "/admin/x", "deny") in paths, paths
    seen = {e.get("path") for e in fakenet.events("https")}
    assert "/admin/x" not in seen and {"/docs/h2", "/ws"} <= seen, seen
