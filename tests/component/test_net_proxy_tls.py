"""TLS inspection ("full") in the egress proxy over real loopback sockets and real
certificates: hutch's CA (``hutch.net.tls_ca``) mints the leaf the client sees, the
upstream is an HTTPS keep-alive server whose certificate comes from a test CA that the
proxy is told to trust (as ``HUTCH_EGRESS_UPSTREAM_CA`` does), and the client trusts only
hutch's CA. There is no nft here, so the dialled port comes from ``original_port``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from ipaddress import IPv4Address
from pathlib import Path

import pytest

from hutch.errors import NetworkError, NotFound
from hutch.net.dns import SandboxNetInfo
from hutch.net.egress_log import EgressLog
from hutch.net.inspected_http import Redactor
from hutch.net.proxy import EgressProxy
from hutch.net.tls_ca import EgressCA, ProjectCAs, upstream_context
from tests.component.proxy_env import Directory, FakeResolver, forbidden
from tests.netfake.certs import make_certs

# The data path's code, on the data path's loop (tests/conftest.py).
pytestmark = pytest.mark.datapath_loop

SERVER = "127.0.0.20"
SRC = "127.0.0.7"
LEARN_SRC, DRY_SRC = "127.0.0.8", "127.0.0.10"
PARTIAL_SRC, OPEN_B_SRC = "127.0.0.11", "127.0.0.12"
#: inspection partial: TLS terminated only where a request rule needs it.
PARTIAL = {
    "inspection": "partial",
    "rules": [
        {"action": "transform", "host": "other.test", "path": "/echo",
         "set_headers": {"Authorization": "Bearer {secret:openai}"}},
        {"action": "allow", "host": "good.test"},
    ],
}  # fmt: skip
#: Another project's sandbox: default allow, a name and a request denied, full.
OPEN_B = {
    "default": "allow",
    "inspection": "full",
    "rules": [
        {"action": "deny", "host": "other.test"},
        {"action": "deny", "host": "api.test", "methods": ["POST"]},
    ],
}
SECRET = "sk-live-0123456789abcdef"
DOCS_ONLY = [{"action": "allow", "host": "api.test", "methods": ["GET"], "path": "/docs"}]
POLICY = {
    "default": "deny",
    "inspection": "full",
    "rules": [
        {"action": "deny", "host": "api.test", "methods": ["POST"], "path": "/admin"},
        {"action": "allow", "host": "api.test", "methods": ["GET"], "path": "/docs"},
        {
            "action": "transform",
            "host": "other.test",
            "path": "/echo",
            "set_headers": {"Authorization": "Bearer {secret:openai}"},
        },
        {
            "action": "transform",
            "host": "other.test",
            "path": "/missing",
            "set_headers": {"Authorization": "Bearer {secret:nope}"},
        },
        {"action": "allow", "host": "good.test"},
    ],
}


@dataclass
class Secrets:
    asked: list[tuple[str, str]] = field(default_factory=list)

    def reveal(self, name: str, project: str) -> str:
        self.asked.append((name, project))
        if name == "openai" and project == "proj-a":
            return SECRET
        raise NotFound(f"no secret named {name!r} in project {project!r}")


@dataclass
class Upstream:
    """An HTTPS keep-alive server: ``/echo`` answers the Authorization it got, anything
    else ``METHOD target``; records (method, target, headers, sni) per request."""

    seen: list[tuple[str, str, dict[str, str], str | None]] = field(default_factory=list)
    connections: int = 0
    received: int = 0  # bytes of requests (heads and bodies)
    sni: list[str | None] = field(default_factory=list)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            while line := await reader.readline():
                self.received += len(line)
                method, target, _ = line.decode().rstrip("\r\n").split(" ")
                headers: dict[str, str] = {}
                while True:
                    raw = await reader.readline()
                    self.received += len(raw)
                    if not (field_line := raw.rstrip(b"\r\n")):
                        break
                    key, _, value = field_line.decode("latin-1").partition(":")
                    headers[key.strip().lower()] = value.strip()
                if "content-length" in headers:
                    body_in = await reader.readexactly(int(headers["content-length"]))
                    self.received += len(body_in)
                self.seen.append((method, target, headers, self.sni[-1] if self.sni else None))
                if target.startswith("/echo"):
                    body = f"you sent: {headers.get('authorization')}".encode()
                else:
                    body = f"{method} {target}".encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    break
        writer.close()


@dataclass
class Env:
    proxy: EgressProxy
    port: int
    https_port: int
    log: EgressLog
    ca: EgressCA
    client: ssl.SSLContext
    upstream: Upstream
    secrets: Secrets
    cas: ProjectCAs
    upstream_ca: Path

    async def connect(
        self, name: str, src: str = SRC, client: ssl.SSLContext | None = None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(
            "127.0.0.1", self.port, ssl=client or self.client, server_hostname=name,
            local_addr=(src, 0),
        )  # fmt: skip

    async def request(
        self, name: str, raw: bytes, src: str = SRC, client: ssl.SSLContext | None = None
    ) -> bytes:
        reader, writer = await self.connect(name, src, client)
        try:
            writer.write(raw)
            await writer.drain()
            return await asyncio.wait_for(read_response(reader), 10)
        finally:
            writer.close()


async def read_response(reader: asyncio.StreamReader) -> bytes:
    """One response framed by Content-Length (what the proxy relays with keep-alive)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


def get(host: str, path: str, method: str = "GET", extra: str = "") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Content-Length: 0\r\n\r\n".encode()


@pytest.fixture(scope="module")
def upstream_certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    files = make_certs(tmp_path_factory.mktemp("up"), ["api.test", "other.test", "good.test"])
    return files.ca_cert, files.server_cert, files.server_key


@pytest.fixture
async def env(upstream_certs: tuple[Path, Path, Path], tmp_path: Path) -> AsyncIterator[Env]:
    ca_file, crt, key = upstream_certs
    upstream = Upstream()
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(crt, key)
    server_ctx.sni_callback = lambda _o, name, _c: upstream.sni.append(name)
    https = await asyncio.start_server(upstream.serve, SERVER, 0, ssl=server_ctx)
    https_port = https.sockets[0].getsockname()[1]
    from hutch.net.rules import policy_from_stored

    info = SandboxNetInfo("sb-full", policy_from_stored(POLICY), {}, "proj-a")
    learn = policy_from_stored({"inspection": "learn", "rules": DOCS_ONLY})
    dry = policy_from_stored({"inspection": "full", "dry_run": True, "rules": DOCS_ONLY})
    directory = {
        IPv4Address(SRC): info,
        IPv4Address(LEARN_SRC): SandboxNetInfo("sb-learn", learn, {}, "proj-a"),
        IPv4Address(DRY_SRC): SandboxNetInfo("sb-dry", dry, {}, "proj-a"),
        IPv4Address(PARTIAL_SRC): SandboxNetInfo(
            "sb-partial", policy_from_stored(PARTIAL), {}, "proj-a"
        ),
        IPv4Address(OPEN_B_SRC): SandboxNetInfo(
            "sb-open-b", policy_from_stored(OPEN_B), {}, "proj-b"
        ),
    }
    log, secrets = EgressLog(), Secrets()
    cas = ProjectCAs(tmp_path / "egress-ca")
    ca = cas.for_project("proj-a")
    proxy = EgressProxy(
        Directory(directory), FakeResolver(), log, forbidden,
        connect_timeout_s=2, peek_timeout_s=2, original_port=lambda _s: https_port,
        ca=cas, upstream_tls=upstream_context(ca_file), secrets=secrets,
    )  # fmt: skip
    port = await proxy.start("127.0.0.1", 0)
    client = ssl.create_default_context(cadata=ca.cert_pem.decode())
    yield Env(proxy, port, https_port, log, ca, client, upstream, secrets, cas, ca_file)
    await proxy.close()
    https.close()
    await https.wait_closed()


async def test_https_requests_are_decided_by_method_and_path(env: Env) -> None:
    """An allowed path works; a denied one gets a 403 naming the rule; the client saw a
    leaf from hutch's CA for exactly the name, the server the same SNI; the bytes sent
    upstream reach the meter's tally."""
    ok = await env.request("api.test", get("api.test", "/docs/a?token=x"))
    assert ok.startswith(b"HTTP/1.1 200") and ok.endswith(b"GET /docs/a?token=x"), ok
    assert env.upstream.seen[-1][3] == "api.test"
    event = env.log.events("sb-full")[-1]
    assert (event.verdict, event.protocol, event.method, event.path, event.rule_index) == (
        "allow", "https", "GET", "/docs/a", 1,
    )  # fmt: skip
    denied = await env.request("api.test", get("api.test", "/admin", "POST"))
    assert denied.startswith(b"HTTP/1.1 403"), denied
    assert b"rules[0] deny POST api.test/admin denies POST /admin on api.test:" in denied
    event = env.log.events("sb-full")[-1]
    assert (event.verdict, event.rule, event.method, event.path) == (
        "deny", "rules[0] deny POST api.test/admin", "POST", "/admin",
    )  # fmt: skip
    assert [s[:2] for s in env.upstream.seen] == [("GET", "/docs/a?token=x")]
    # The meter's egress: the head written upstream for the allowed request; nothing for
    # the denied one (refused before any upstream connection).
    assert env.log.take_bytes() == {"sb-full": (env.upstream.received, 0)}
    _reader, writer = await env.connect("api.test")
    leaf = writer.get_extra_info("ssl_object").getpeercert()
    writer.close()
    assert ("commonName", "hutch egress inspection CA") in [x[0] for x in leaf["issuer"]]
    assert leaf["subjectAltName"] == (("DNS", "api.test"),)


async def test_every_request_on_a_keep_alive_connection_is_checked(env: Env) -> None:
    """Two allowed requests share the guest's connection (and one kept-alive upstream
    connection); a third, pipelined behind an allowed one, is denied, never sent."""
    reader, writer = await env.connect("api.test")
    try:
        writer.write(get("api.test", "/docs/1"))
        first = await asyncio.wait_for(read_response(reader), 10)
        writer.write(get("api.test", "/docs/2") + get("api.test", "/private"))
        second = await asyncio.wait_for(read_response(reader), 10)
        third = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert first.endswith(b"GET /docs/1") and second.endswith(b"GET /docs/2")
    assert third.startswith(b"HTTP/1.1 403") and b"GET /private" in third, third
    assert [s[1] for s in env.upstream.seen] == ["/docs/1", "/docs/2"]
    assert all("connection" not in s[2] for s in env.upstream.seen)
    assert env.upstream.connections == 1


async def test_domain_fronting_http2_and_connect_are_refused_and_logged(env: Env) -> None:
    fronted = await env.request("good.test", get("api.test", "/docs/x"))
    assert fronted.startswith(b"HTTP/1.1 403") and b"domain fronting" in fronted, fronted
    assert "is not the TLS server name" in env.log.events("sb-full")[-1].reason
    reader, writer = await env.connect("good.test")
    writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    h2 = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert h2.startswith(b"HTTP/1.1 403"), h2  # HTTP/2 is inspected when ALPN says so
    assert "HTTP/2 with prior knowledge" in env.log.events("sb-full")[-1].reason
    tunnel = await env.request(
        "good.test", b"CONNECT evil.test:443 HTTP/1.1\r\nHost: evil.test:443\r\n\r\n"
    )
    assert tunnel.startswith(b"HTTP/1.1 403"), tunnel
    assert env.log.events("sb-full")[-1].verdict == "deny"
    assert env.upstream.seen == []


async def test_a_secret_is_injected_on_the_host_and_redacted_from_the_answer(env: Env) -> None:
    """The transform's {secret:openai} is read from the sandbox's project at request
    time; the upstream gets the header; its echo reaches the client as stars; neither the
    log nor the client ever holds the value."""
    echoed = await env.request("other.test", get("other.test", "/echo"))
    assert env.upstream.seen[-1][2]["authorization"] == f"Bearer {SECRET}"
    assert echoed.startswith(b"HTTP/1.1 200"), echoed
    assert SECRET.encode() not in echoed
    assert b"you sent: Bearer " + b"*" * len(SECRET) in echoed
    assert env.secrets.asked == [("openai", "proj-a")]
    missing = await env.request("other.test", get("other.test", "/missing"))
    assert missing.startswith(b"HTTP/1.1 403") and b"secret 'nope' is not available" in missing
    assert len(env.upstream.seen) == 1  # the missing secret opened nothing upstream
    sneaky = await env.request(
        "other.test", get("other.test", "/echo", extra="X-A: {secret:openai}\r\n")
    )
    assert sneaky.startswith(b"HTTP/1.1 403") and b"placeholder" in sneaky
    assert all(SECRET not in (e.reason + (e.path or "")) for e in env.log.events("sb-full"))


async def test_an_upstream_the_trust_store_rejects_is_a_denial(env: Env) -> None:
    env.proxy.upstream_tls = upstream_context(None)  # the host's store: no test CA in it
    reply = await env.request("good.test", get("good.test", "/"))
    assert reply.startswith(b"HTTP/1.1 403") and b"failed TLS verification" in reply, reply
    assert env.upstream.seen == []


async def test_a_client_that_does_not_trust_the_ca_is_logged(env: Env) -> None:
    with pytest.raises(ssl.SSLError):
        await asyncio.open_connection(
            "127.0.0.1", env.port, ssl=ssl.create_default_context(), server_hostname="good.test",
            local_addr=(SRC, 0),
        )  # fmt: skip
    for _ in range(50):
        events = env.log.events("sb-full")
        if events and "TLS handshake with the guest failed" in events[-1].reason:
            break
        await asyncio.sleep(0.05)
    assert "TLS handshake with the guest failed" in env.log.events("sb-full")[-1].reason


def test_the_ca_key_is_private_and_kept_across_starts(tmp_path: Path) -> None:
    cas = ProjectCAs(tmp_path / "egress-ca")
    a, b = cas.for_project("proj-a"), cas.for_project("proj-b")
    assert a.cert_pem != b.cert_pem and cas.for_project("proj-a") is a  # one per project
    assert a.directory == tmp_path / "egress-ca" / "projects" / "proj-a"
    for d in (tmp_path / "egress-ca", tmp_path / "egress-ca" / "projects", a.directory):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    assert ProjectCAs(tmp_path / "egress-ca").cert_pem("proj-a") == a.cert_pem  # kept
    with pytest.raises(NetworkError, match="not a project name"):
        cas.for_project("../proj-a")
    ca = EgressCA(tmp_path / "ca")
    assert stat.S_IMODE(os.stat(ca.key_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "ca").st_mode) == 0o700
    again = EgressCA(tmp_path / "ca")
    assert again.cert_pem == ca.cert_pem
    assert b"PRIVATE KEY" not in ca.cert_pem
    assert ca.server_context("a.test") is ca.server_context("a.test")  # cached


def test_the_redactor_finds_a_secret_split_across_pieces() -> None:
    r = Redactor([b"secret"])
    out = r.feed(b"xx sec") + r.feed(b"ret yy") + r.flush()
    assert out == b"xx ****** yy"


async def test_learn_and_dry_run_record_what_would_be_denied_without_denying(env: Env) -> None:
    """inspection learn terminates TLS and lets every request out, logging each with its
    method and path (a would-be denial says so); dry_run does the same for its policy.
    The suggestion from the learned log allows exactly what was used."""
    from hutch.contract.egress_suggest import suggest_policy

    for src, sid, what in ((LEARN_SRC, "sb-learn", "learn"), (DRY_SRC, "sb-dry", "dry run")):
        docs = await env.request("api.test", get("api.test", "/docs/x"), src=src)
        admin = await env.request("api.test", get("api.test", "/admin", "POST"), src=src)
        assert docs.startswith(b"HTTP/1.1 200") and admin.startswith(b"HTTP/1.1 200"), admin
        events = env.log.events(sid)
        assert (events[-2].verdict, events[-2].rule_index, events[-2].path) == (
            "allow", 0, "/docs/x",
        )  # fmt: skip
        last = events[-1]
        assert (last.verdict, last.method, last.path, last.rule_index) == (
            "allow", "POST", "/admin", None,
        )  # fmt: skip
        assert last.reason.startswith(f"{what}: would be denied: no rule allows POST /admin")
        assert env.upstream.seen[-1][:2] == ("POST", "/admin")  # it did go out
    # Here the "web port" is the test server's: the suggestion can only name it (path
    # rules are for 80/443; tests/unit/test_egress_suggest.py covers those).
    suggested = suggest_policy(env.log.events("sb-learn"))
    assert suggested["rules"] == [{"action": "allow", "host": f"api.test:{env.https_port}"}]


def _trusting(*pems: bytes | Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    for p in pems:
        if isinstance(p, Path):
            ctx.load_verify_locations(cafile=str(p))
        else:
            ctx.load_verify_locations(cadata=p.decode())
    return ctx


async def test_partial_terminates_tls_only_for_the_names_a_request_rule_needs(env: Env) -> None:
    """inspection partial: TLS to other.test (a transform rule) is terminated with the
    project's CA and the secret injected; TLS to good.test (a plain allow) passes
    untouched, the client seeing the upstream's own certificate; a name no rule allows is
    closed by its SNI."""
    echoed = await env.request("other.test", get("other.test", "/echo"), src=PARTIAL_SRC)
    assert echoed.startswith(b"HTTP/1.1 200"), echoed
    assert env.upstream.seen[-1][2]["authorization"] == f"Bearer {SECRET}"
    assert SECRET.encode() not in echoed
    # good.test is not inspected: a client trusting only hutch's CA fails (the upstream's
    # certificate is not hutch's), one trusting the upstream's CA gets through end to end.
    with pytest.raises(ssl.SSLCertVerificationError):
        await env.request("good.test", get("good.test", "/x"), src=PARTIAL_SRC)
    passed = await env.request(
        "good.test", get("good.test", "/x"), src=PARTIAL_SRC, client=_trusting(env.upstream_ca)
    )
    assert passed.startswith(b"HTTP/1.1 200") and passed.endswith(b"GET /x"), passed
    event = env.log.events("sb-partial")[-1]
    assert (event.verdict, event.protocol, event.rule_index) == ("allow", "tls", 1), event
    with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
        await env.request(
            "api.test", get("api.test", "/docs"), src=PARTIAL_SRC, client=_trusting(env.upstream_ca)
        )
    assert "default is deny" in env.log.events("sb-partial")[-1].reason


async def test_each_project_has_its_own_ca_and_default_allow_keeps_its_denies(env: Env) -> None:
    """A proj-b sandbox's TLS is terminated with proj-b's CA: a client trusting proj-a's
    fails. Under its default-allow policy an unnamed host passes, a denied name is closed
    by SNI, a denied method gets a 403 naming the rule."""
    b_ca = env.cas.for_project("proj-b").cert_pem
    with pytest.raises(ssl.SSLCertVerificationError):
        await env.request("good.test", get("good.test", "/x"), src=OPEN_B_SRC)  # proj-a's CA
    trust_b = _trusting(b_ca)
    ok = await env.request("good.test", get("good.test", "/x"), src=OPEN_B_SRC, client=trust_b)
    assert ok.startswith(b"HTTP/1.1 200"), ok
    assert env.log.events("sb-open-b")[-1].reason == "open egress"
    with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
        await env.request("other.test", get("other.test", "/x"), src=OPEN_B_SRC, client=trust_b)
    assert "rules[0] deny other.test denies other.test" in env.log.events("sb-open-b")[-1].reason
    post = await env.request(
        "api.test", get("api.test", "/docs", "POST"), src=OPEN_B_SRC, client=trust_b
    )
    assert post.startswith(b"HTTP/1.1 403") and b"rules[1] deny POST api.test" in post, post
    got = await env.request("api.test", get("api.test", "/docs"), src=OPEN_B_SRC, client=trust_b)
    assert got.startswith(b"HTTP/1.1 200"), got
