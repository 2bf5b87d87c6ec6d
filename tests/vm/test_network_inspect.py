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
