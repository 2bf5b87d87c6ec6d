"""Egress inspection "full" with a real VM against the fake internet (issue 12).

One daemon told to trust the fake internet's test CA for upstream TLS
(``HUTCH_EGRESS_UPSTREAM_CA``), one guest created with an ordered policy whose
inspection is ``full``. The guest trusts nothing but its system store and the variables
hutch sets: hutch's proxy terminates its TLS with a leaf from the daemon's CA, decides
every request by method and path, and injects a secret into requests to one host. What
the fake upstream received is read from its own log.

Nothing but the fake internet's addresses is contacted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator

import pytest

from hutch.errors import HutchError
from hutch.sdk import Client, Sandbox
from tests.e2e.conftest import Daemon
from tests.netfake import FakeInternet
from tests.vm.netlab import network_daemon

pytestmark = [
    pytest.mark.vm,
    pytest.mark.privileged,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, taps, nftables)"),
]

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


def test_python_urllib_works_with_no_flags(guest: Sandbox) -> None:
    code = (
        "import urllib.request, json;"
        "r = urllib.request.urlopen('https://good.test/docs/py', timeout=60);"
        "print(r.status, json.loads(r.read())['sni'])"
    )
    out = guest.exec(["python3", "-c", code], timeout_s=120)
    assert out.stdout.split() == ["200", "good.test"], out


def test_an_injected_credential_reaches_the_upstream_and_never_the_guest(
    guest: Sandbox, fakenet: FakeInternet
) -> None:
    """The transform's {secret:upstream-key} is added on the host: the fake upstream
    received it; the guest's answer (the upstream echoes it) shows stars; the guest's
    env, every process environment and its files hold no trace of it."""
    body, status = curl(guest, "https://other.test/echo")
    assert status == "200", (status, body)
    got = [e for e in fakenet.events("https") if e.get("path") == "/echo"]
    assert got and got[-1].get("authorization") == f"Bearer {SECRET}", got
    assert SECRET not in body
    assert json.loads(body)["authorization"] == "Bearer " + "*" * len(SECRET)
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
