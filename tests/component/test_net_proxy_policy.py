"""The SNI/Host egress proxy over real loopback sockets (the fake internet:
:mod:`tests.component.proxy_env`) under ordered policies: first match decides and is
named, partial inspection by method and path, transforms, private answers under IP rules.
"""

from __future__ import annotations

import asyncio
import ssl
from ipaddress import IPv4Address

import pytest

from hutch.net.destinations import Forbidden
from hutch.net.dns import SandboxNetInfo
from hutch.net.proxy import EgressProxy
from hutch.net.rules import parse_policy
from tests.component.proxy_env import (
    OPEN_SRC,
    ORDERED_SRC,
    PARTIAL_SRC,
    RULES_SRC,
    SERVER,
    Directory,
    Env,
    cert_fixture,  # noqa: F401 (the shared fixtures)
    env_fixture,  # noqa: F401
    ordered_policy,
)

# The data path's code, on the data path's loop (tests/conftest.py).
pytestmark = pytest.mark.datapath_loop


async def test_an_ordered_policy_first_match_decides_and_names_the_rule(env: Env) -> None:
    """Deny before allow: other.test shares the address and certificate of good.test and
    matches the later ``*.test`` allow, yet the earlier deny wins, by SNI and by Host."""
    assert await env.tls("good.test", src=ORDERED_SRC) == b"hello good.test\n"
    allowed = env.log.events("sb-ordered")[-1]
    assert (allowed.verdict, allowed.rule) == ("allow", "rules[1] allow *.test")
    with pytest.raises((ConnectionError, ssl.SSLError, asyncio.IncompleteReadError)):
        await env.tls("other.test", src=ORDERED_SRC)
    denied = env.log.events("sb-ordered")[-1]
    assert (denied.verdict, denied.name, denied.rule) == (
        "deny",
        "other.test",
        "rules[0] deny other.test",
    )
    reply = await env.get("other.test", src=ORDERED_SRC)
    assert reply.startswith(b"HTTP/1.1 403 Forbidden")
    assert b"rules[0] deny other.test denies other.test on port" in reply
    reply = await env.get("good.test", "/docs/a?token=s3cret", src=ORDERED_SRC)
    assert reply.startswith(b"HTTP/1.1 200")
    assert env.resolver.asked == ["good.test", "good.test"]  # denied before any lookup
    # The log keeps the method and the path, never the query; each event its rule.
    http = env.log.events("sb-ordered")[-1]
    assert (http.protocol, http.method, http.path, http.rule_index) == ("http", "GET", "/docs/a", 1)
    assert not any("s3cret" in repr(e) for e in env.log.events("sb-ordered"))
    counts = [(c.index, c.allowed, c.denied) for c in env.log.rule_counts("sb-ordered")]
    assert counts == [(0, 0, 2), (1, 2, 0)]
    reply = await env.get("good.example", src=ORDERED_SRC)
    assert b"no rule allows good.example on port" in reply and b"the default is deny" in reply
    # A live change: a deny put first cuts the open connection it now denies.
    env.dialled = env.https_port
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", env.port, ssl=env.ca, server_hostname="good.test",
        local_addr=(ORDERED_SRC, 0),
    )  # fmt: skip
    assert await reader.readline() == b"hello good.test\n"
    keep = ordered_policy({"action": "deny", "host": "api.test"})
    assert env.proxy.revalidate("sb-ordered", keep) == 0
    cut = ordered_policy({"action": "deny", "host": "good.test"})
    assert env.proxy.revalidate("sb-ordered", cut) == 1
    writer.close()
    assert "rules changed" in env.log.events("sb-ordered")[-1].reason


async def test_partial_inspection_decides_plain_http_by_method_and_path(env: Env) -> None:
    """GET /docs allowed, POST /admin denied with a 403 naming the rule, the default for
    the rest; TLS to a host whose rules need the request is refused (no TLS termination
    yet: fail closed), other allowed TLS passes as before."""
    docs = await env.get("api.test", "/docs/intro?q=1", src=PARTIAL_SRC)
    assert docs.startswith(b"HTTP/1.1 200"), docs
    event = env.log.events("sb-partial")[-1]
    assert (event.verdict, event.method, event.path, event.rule_index) == (
        "allow", "GET", "/docs/intro", 1,
    )  # fmt: skip
    post = b"POST /admin HTTP/1.1\r\nHost: api.test\r\nContent-Length: 2\r\n\r\nhi"
    reply = await env.http(post, src=PARTIAL_SRC)
    assert reply.startswith(b"HTTP/1.1 403 Forbidden"), reply
    assert b"rules[0] deny POST api.test/admin denies POST /admin on api.test:" in reply
    event = env.log.events("sb-partial")[-1]
    assert (event.verdict, event.rule, event.method, event.path) == (
        "deny", "rules[0] deny POST api.test/admin", "POST", "/admin",
    )  # fmt: skip
    reply = await env.get("api.test", "/admin", src=PARTIAL_SRC)  # GET: no rule matches
    assert b"no rule allows GET /admin on api.test:" in reply and b"default is deny" in reply
    reply = await env.get("api.test", "/docs/../admin", src=PARTIAL_SRC)  # ambiguous path
    assert reply.startswith(b"HTTP/1.1 403")
    assert env.resolver.asked == ["api.test"]  # only the allowed request looked it up
    with pytest.raises((ConnectionError, ssl.SSLError, asyncio.IncompleteReadError)):
        await env.tls("api.test", src=PARTIAL_SRC)
    # TLS to a host a request rule needs is terminated under partial (with the project's
    # CA: this proxy has none, so it is refused, never passed uninspected).
    assert "TLS inspection needs the egress CAs" in env.log.events("sb-partial")[-1].reason
    assert await env.tls("good.test", src=PARTIAL_SRC) == b"hello good.test\n"


async def test_a_transform_rewrites_headers_and_placeholders_are_refused(env: Env) -> None:
    """A transform (literal values: the secrets store is not wired yet) sets and removes
    headers of a plain-HTTP request; a request carrying a {secret:...} placeholder is
    refused before any upstream connection opens."""
    head = (
        b"GET /x HTTP/1.1\r\nHost: other.test\r\nCookie: session=1\r\n"
        b"x-api-key: the-guests-own\r\n\r\n"
    )
    reply = await env.lenient_http(head, src=PARTIAL_SRC)
    assert reply.startswith(b"HTTP/1.1 200"), reply
    got = env.lenient.headers[-1]
    assert got["x-api-key"] == "k-123" and "cookie" not in got
    assert got["connection"] == "close"
    event = env.log.events("sb-partial")[-1]
    assert (event.verdict, event.rule_index) == ("allow", 3)
    served = len(env.lenient.seen)
    asked = list(env.resolver.asked)
    sneaky = b"GET /x HTTP/1.1\r\nHost: other.test\r\nAuthorization: Bearer {SECRET:openai}\r\n\r\n"
    reply = await env.lenient_http(sneaky, src=PARTIAL_SRC)
    assert reply.startswith(b"HTTP/1.1 403") and b"placeholder" in reply
    assert len(env.lenient.seen) == served and env.resolver.asked == asked  # nothing opened


async def test_a_private_answer_is_used_only_under_an_ip_rule_covering_it(env: Env) -> None:
    def private_server(addr: IPv4Address) -> Forbidden | None:
        return Forbidden("private", "private range (here)") if addr == IPv4Address(SERVER) else None

    directory = Directory(
        {
            IPv4Address(RULES_SRC): SandboxNetInfo("sb-a", parse_policy(["good.test"])),
            IPv4Address(OPEN_SRC): SandboxNetInfo(
                "sb-b", parse_policy(["good.test", f"{SERVER}/32:{env.http_port}"])
            ),
        }
    )
    proxy = EgressProxy(
        directory, env.resolver, env.log, private_server,
        original_port=lambda _sock: env.http_port,
    )  # fmt: skip
    port = await proxy.start("127.0.0.1", 0)
    try:
        request = b"GET / HTTP/1.1\r\nHost: good.test\r\n\r\n"
        results = {}
        for src in (RULES_SRC, OPEN_SRC):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(src, 0))
            writer.write(request)
            results[src] = await asyncio.wait_for(reader.read(), 10)
            writer.close()
    finally:
        await proxy.close()
    assert results[RULES_SRC].startswith(b"HTTP/1.1 403")
    assert b"private range (here)" in results[RULES_SRC]
    assert results[OPEN_SRC].startswith(b"HTTP/1.1 200")
