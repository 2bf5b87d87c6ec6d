"""The SNI/Host egress proxy over real loopback sockets (the fake internet:
:mod:`tests.component.proxy_env`): decisions by SNI and Host, name normalization, DNS
rebinding, unknown sources and modes, intact transfers both ways, the ClientHello sniffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ssl

import pytest

from hutch.net.proxy import sniff
from tests.component.proxy_env import (
    BIG,
    DENY_SRC,
    OPEN_SRC,
    RULES_SRC,
    SERVER,
    UNKNOWN_SRC,
    Env,
    cert_fixture,  # noqa: F401 (the shared fixtures)
    env_fixture,  # noqa: F401
)

# The data path's code, on the data path's loop (tests/conftest.py).
pytestmark = pytest.mark.datapath_loop


async def test_allowed_sni_is_proxied_to_the_address_the_host_resolved(env: Env) -> None:
    assert await env.tls("good.test") == b"hello good.test\n"
    assert env.sni_seen == ["good.test"]
    assert env.resolver.asked == ["good.test"]
    event = env.log.events("sb-rules")[-1]
    assert (event.verdict, event.name, event.rule, event.protocol) == (
        "allow", "good.test", "good.test", "tls",
    )  # fmt: skip
    assert event.destination == SERVER and event.port == env.https_port


async def test_sni_of_another_name_on_the_same_address_is_refused(env: Env) -> None:
    with pytest.raises((ConnectionError, ssl.SSLError, asyncio.IncompleteReadError)):
        await env.tls("other.test")
    assert env.sni_seen == []  # the server never saw the handshake
    event = env.log.events("sb-rules")[-1]
    assert (event.verdict, event.name, event.rule) == ("deny", "other.test", None)
    assert "no rule allows other.test" in event.reason


async def test_no_sni_is_refused(env: Env) -> None:
    with pytest.raises((ConnectionError, ssl.SSLError, asyncio.IncompleteReadError)):
        await env.tls(None)
    assert env.sni_seen == []
    assert "no server name" in env.log.events("sb-rules")[-1].reason


async def test_host_port_rule_holds_only_on_its_port(env: Env) -> None:
    assert await env.tls("api.test") == b"hello api.test\n"
    reply = await env.get("api.test")  # the HTTP port is not api.test's port
    assert reply.startswith(b"HTTP/1.1 403")


async def test_allowed_host_header_passes_and_gets_connection_close(env: Env) -> None:
    reply = await env.get("good.test:80")
    assert reply.startswith(b"HTTP/1.1 200")
    assert reply.endswith(b"host=good.test:80 connection=close")


async def test_host_mismatch_gets_a_403_that_says_why(env: Env) -> None:
    reply = await env.get("other.test")
    assert reply.startswith(b"HTTP/1.1 403 Forbidden")
    assert b"hutch egress denied other.test" in reply and b"no rule allows" in reply
    assert env.resolver.asked == []  # denied before any lookup
    assert env.log.counters("sb-rules") == (0, 1)


async def test_absolute_url_for_another_host_is_refused(env: Env) -> None:
    reply = await env.http(b"GET http://other.test/ HTTP/1.1\r\nHost: good.test\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 403")
    assert b"different hosts" in reply
    # CONNECT would open a tunnel to any port of the named server: never relayed.
    connect = await env.http(b"CONNECT good.test:443 HTTP/1.1\r\nHost: good.test\r\n\r\n")
    assert connect.startswith(b"HTTP/1.1 403") and b"CONNECT" in connect
    # A URL in the query string of an origin-form target is not an absolute-form target.
    assert (await env.get("good.test", "/r?next=http://other.test/")).startswith(b"HTTP/1.1 200")


async def test_missing_or_repeated_host_is_refused(env: Env) -> None:
    assert (await env.http(b"GET / HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.1 403")
    double = b"GET / HTTP/1.1\r\nHost: good.test\r\nHost: other.test\r\n\r\n"
    assert b"more than one Host" in await env.http(double)


async def test_wildcard_case_trailing_dot_and_punycode(env: Env) -> None:
    assert (await env.get("a.wild.test")).startswith(b"HTTP/1.1 200")
    assert (await env.get("wild.test")).startswith(b"HTTP/1.1 403")  # apex not covered
    assert (await env.get("GOOD.Test.")).startswith(b"HTTP/1.1 200")
    assert (await env.get("xn--bcher-kva.test")).startswith(b"HTTP/1.1 200")
    assert (await env.get("b\u00fccher.test")).startswith(b"HTTP/1.1 403")  # raw UTF-8 in Host
    assert await env.tls("A.Wild.Test") == b"hello A.Wild.Test\n"  # sent as written
    assert env.log.events("sb-rules")[-1].rule == "*.wild.test"


async def test_dns_rebinding_to_forbidden_addresses_is_refused(env: Env) -> None:
    reply = await env.get("rebind.test")
    assert reply.startswith(b"HTTP/1.1 403")
    assert b"forbidden addresses (127.0.0.1, 10.1.2.3)" in reply
    event = env.log.events("sb-rules")[-1]
    assert (event.verdict, event.rule) == ("deny", "rebind.test")
    # A name with one good and one forbidden address uses the good one only.
    assert (await env.get("mixed.test")).startswith(b"HTTP/1.1 200")


async def test_resolution_failure_is_a_denial(env: Env) -> None:
    reply = await env.get("down.test")
    assert reply.startswith(b"HTTP/1.1 403") and b"cannot resolve down.test" in reply


async def test_big_transfers_are_intact_both_ways(env: Env) -> None:
    reply = await env.get("good.test", "/big")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert hashlib.sha256(body).hexdigest() == hashlib.sha256(BIG).hexdigest()
    upload = b"POST /upload HTTP/1.1\r\nHost: good.test\r\nContent-Length: %d\r\n\r\n" % len(BIG)
    reply = await env.http(upload + BIG)
    assert reply.endswith(hashlib.sha256(BIG).hexdigest().encode())


async def test_tls_echo_of_megabytes(env: Env) -> None:
    env.dialled = env.https_port
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", env.port, ssl=env.ca, server_hostname="good.test", local_addr=(RULES_SRC, 0)
    )
    await reader.readline()
    payload = BIG[: 4 * 1024 * 1024]

    async def send() -> None:
        writer.write(payload)
        await writer.drain()

    sender = asyncio.create_task(send())
    got = await asyncio.wait_for(reader.readexactly(len(payload)), 30)
    await sender
    writer.close()
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()


async def test_unknown_source_is_closed_without_a_word(env: Env) -> None:
    assert await env.get("good.test", src=UNKNOWN_SRC) == b""
    assert env.resolver.asked == []


async def test_open_and_deny_all_modes(env: Env) -> None:
    assert (await env.get("other.test", src=OPEN_SRC)).startswith(b"HTTP/1.1 200")
    assert (await env.get("rebind.test", src=OPEN_SRC)).startswith(b"HTTP/1.1 403")
    reply = await env.get("good.test", src=DENY_SRC)
    assert reply.startswith(b"HTTP/1.1 403") and b"deny-all" in reply


async def test_silent_or_garbage_clients_are_cut(env: Env) -> None:
    env.dialled = env.http_port
    reader, writer = await asyncio.open_connection("127.0.0.1", env.port, local_addr=(RULES_SRC, 0))
    assert await asyncio.wait_for(reader.read(), 5) == b""  # peek timeout 0.5 s
    writer.close()
    assert "within" in env.log.events("sb-rules")[-1].reason
    assert await env.http(b"\x00\x01SSH-2.0-x\r\n") == b""
    assert "neither" in env.log.events("sb-rules")[-1].reason


def client_hello(name: str | None) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=name)
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def refragment(hello: bytes, size: int) -> bytes:
    """The same handshake split into TLS records of ``size`` bytes each."""
    body = hello[5:]
    return b"".join(
        hello[:3] + len(chunk).to_bytes(2, "big") + chunk
        for chunk in (body[i : i + size] for i in range(0, len(body), size))
    )


def test_sniff_waits_for_the_whole_client_hello_across_reads_and_records() -> None:
    for hello in (client_hello("good.test"), refragment(client_hello("good.test"), 50)):
        for cut in range(len(hello)):
            assert sniff(hello[:cut]) is None, cut
        seen = sniff(hello)
        assert seen is not None and (seen.protocol, seen.name) == ("tls", "good.test")
    no_sni = sniff(client_hello(None))
    assert no_sni is not None and no_sni.name is None and "no server name" in str(no_sni.error)
    for junk in (
        b"\x16\x03\x01\x00\x05\x01\x00\x00\x01\x00",
        b"\x16\x03\x01\x00\x04\x02\x00\x00\x00",
    ):
        bad = sniff(junk)
        assert bad is not None and bad.name is None


async def test_client_hello_dribbled_byte_by_byte_still_works(env: Env) -> None:
    env.dialled = env.https_port
    hello = refragment(client_hello("good.test"), 100)
    reader, writer = await asyncio.open_connection("127.0.0.1", env.port, local_addr=(RULES_SRC, 0))
    for i in range(0, len(hello), 7):
        writer.write(hello[i : i + 7])
        await writer.drain()
        await asyncio.sleep(0.001)
    first = await asyncio.wait_for(reader.read(5), 5)
    writer.close()
    assert first[:1] == b"\x16"  # the real server's ServerHello came back
    assert env.sni_seen == ["good.test"]
