"""The SNI/Host egress proxy over real loopback sockets (the fake internet:
:mod:`tests.component.proxy_env`), issue 16: one checked request per connection (no
smuggling past the check), RFC 3986 authorities, live revalidation of relayed connections.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl

import pytest

from hutch.net.rules import parse_policy
from tests.component.proxy_env import (
    RULES_SRC,
    Env,
    cert_fixture,  # noqa: F401 (the shared fixtures)
    env_fixture,  # noqa: F401
)

# The data path's code, on the data path's loop (tests/conftest.py).
pytestmark = pytest.mark.datapath_loop


async def test_bare_lf_or_cr_in_the_head_is_refused_before_anything_is_sent(env: Env) -> None:
    smuggles = [
        b"GET / HTTP/1.1\r\nHost: good.test\r\nX-A: 1\nConnection: keep-alive\r\n\r\n"
        b"GET /smuggled HTTP/1.1\r\nHost: other.test\r\n\r\n",
        b"GET / HTTP/1.1\n\r\nGET http://other.test/smuggled HTTP/1.1\r\nHost: good.test\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: good.test\r\nX-A: 1\rConnection: keep-alive\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: good.test\r\nX-A: \x00\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost : good.test\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: good.test\r\n folded\r\n\r\n",
    ]
    for request in smuggles:
        reply = await env.lenient_http(request)
        assert reply.startswith(b"HTTP/1.1 403"), (request, reply)
        assert reply.count(b"HTTP/1.1 ") == 1
    assert env.lenient.seen == []
    reasons = [e.reason for e in env.log.events("sb-rules")]
    assert sum("bare LF" in r for r in reasons) == 2 and any("bare CR" in r for r in reasons)
    assert env.resolver.asked == []  # refused before any lookup


async def test_a_connection_carries_exactly_the_one_checked_request(env: Env) -> None:
    """Even to a server that ignores ``Connection: close``: a pipelined request after the
    checked one is never sent (the client reads its answer, then closes)."""
    env.lenient.ignore_close = True
    env.dialled = env.lenient.port
    reader, writer = await asyncio.open_connection("127.0.0.1", env.port, local_addr=(RULES_SRC, 0))
    writer.write(
        b"GET /first HTTP/1.1\r\nHost: good.test\r\nConnection: keep-alive\r\n\r\n"
        b"GET /second HTTP/1.1\r\nHost: other.test\r\n\r\n"
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    assert (
        await reader.readexactly(length) == b"GET /first " + hashlib.sha256().hexdigest().encode()
    )
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 10) == b""  # no second answer
    writer.close()
    await asyncio.wait_for(env.lenient.finished.wait(), 10)  # the server saw the end
    assert [(m, t, h) for m, t, h, _ in env.lenient.seen] == [("GET", "/first", "good.test")]
    env.lenient.ignore_close = False
    # A body (by length or chunked) goes with its request; what follows it does not.
    payload = b"x" * 70000
    by_length = (
        b"POST /upload HTTP/1.1\r\nHost: good.test\r\nContent-Length: %d\r\n\r\n" % len(payload)
        + payload
        + b"GET /third HTTP/1.1\r\nHost: other.test\r\n\r\n"
    )
    reply = await env.lenient_http(by_length)
    assert reply.endswith(hashlib.sha256(payload).hexdigest().encode())
    chunked = (
        b"POST /chunks HTTP/1.1\r\nHost: good.test\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
        b"GET /fourth HTTP/1.1\r\nHost: other.test\r\n\r\n"
    )
    reply = await env.lenient_http(chunked)
    assert reply.endswith(hashlib.sha256(b"hello world").hexdigest().encode())
    assert [(t, b) for _, t, _, b in env.lenient.seen[1:]] == [
        ("/upload", payload),
        ("/chunks", b"hello world"),
    ]


async def test_ambiguous_framing_is_refused(env: Env) -> None:
    cases = {
        b"Content-Length: 5\r\nTransfer-Encoding: chunked": "both Content-Length",
        b"Content-Length: 5\r\nContent-Length: 6": "more than one Content-Length",
        b"Transfer-Encoding: gzip, chunked": "other than a single 'chunked'",
        b"Content-Length: +5": "not a number",
    }
    for fields, why in cases.items():
        request = b"POST / HTTP/1.1\r\nHost: good.test\r\n" + fields + b"\r\n\r\nhello"
        reply = await env.lenient_http(request)
        assert reply.startswith(b"HTTP/1.1 403") and why.encode() in reply, (fields, reply)
    bad_chunk = (
        b"POST / HTTP/1.1\r\nHost: good.test\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\n0\r\n\r\n"
    )
    await env.lenient_http(bad_chunk)
    assert "request body: chunked body" in env.log.events("sb-rules")[-1].reason
    assert env.lenient.seen == []  # the server never got a complete request


async def test_absolute_form_authority_follows_rfc_3986(env: Env) -> None:
    def get(target: bytes) -> bytes:
        return b"GET " + target + b" HTTP/1.1\r\nHost: good.test\r\n\r\n"

    refused = {
        b"http://other.test#@good.test/": "fragment",
        b"http://other.test?@good.test/": "different hosts",
        b"http://good.test@other.test/": "userinfo",
        b"http://other.test/": "different hosts",
        b"https://good.test/": "scheme",
        b"http://good.test:8080/": "different hosts",
        b"good.test/": "not origin-form",
    }
    for target, why in refused.items():
        reply = await env.lenient_http(get(target))
        assert reply.startswith(b"HTTP/1.1 403") and why.encode() in reply, (target, reply)
    assert env.lenient.seen == []
    for ok in (b"http://good.test/abs", b"HTTP://GOOD.TEST:80/abs?q=@other.test"):
        assert (await env.lenient_http(get(ok))).startswith(b"HTTP/1.1 200"), ok
    assert [t for _, t, _, _ in env.lenient.seen] == [
        "http://good.test/abs",
        "HTTP://GOOD.TEST:80/abs?q=@other.test",
    ]


async def test_revalidate_cuts_relayed_connections_the_new_rules_deny(env: Env) -> None:
    env.dialled = env.https_port
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", env.port, ssl=env.ca, server_hostname="good.test", local_addr=(RULES_SRC, 0)
    )
    assert await reader.readline() == b"hello good.test\n"

    async def echo(text: bytes) -> bytes:
        writer.write(text)
        await writer.drain()
        return await asyncio.wait_for(reader.read(100), 5)

    assert await echo(b"before") == b"before"
    # Another sandbox's rule change, or one that still allows good.test: nothing cut.
    assert env.proxy.revalidate("sb-open", parse_policy(["deny-all"])) == 0
    assert env.proxy.revalidate("sb-rules", parse_policy(["good.test", "x.test"])) == 0
    assert env.proxy.revalidate("sb-rules", parse_policy([f"good.test:{env.https_port}"])) == 0
    assert await echo(b"still") == b"still"
    # The name stays, but not on the port this connection uses: cut.
    assert env.proxy.revalidate("sb-rules", parse_policy(["good.test:1"])) == 1
    with pytest.raises((ConnectionError, ssl.SSLError, asyncio.IncompleteReadError)):
        data = await echo(b"after")
        if not data:
            raise ConnectionResetError("closed")
    writer.close()
    event = env.log.events("sb-rules")[-1]
    assert (event.verdict, event.name, event.protocol) == ("deny", "good.test", "tls")
    assert "rules changed" in event.reason and "no rule allows good.test on port" in event.reason
    assert env.proxy.revalidate("sb-rules", parse_policy(["other.test"])) == 0  # gone already
