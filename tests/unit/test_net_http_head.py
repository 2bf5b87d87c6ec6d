"""The strict HTTP/1.x request-head parser the egress proxy checks requests with
(hutch.net.http_head): what a lenient server could read differently is refused."""

from __future__ import annotations

import pytest

from hutch.net.http_head import (
    MAX_HEAD,
    Authority,
    BodyFramer,
    HeadError,
    RequestHead,
    parse_absolute_target,
    parse_host,
    parse_request_head,
)


def parse(raw: bytes) -> RequestHead:
    head = parse_request_head(raw)
    assert head is not None, raw
    return head


def refused(raw: bytes) -> str:
    with pytest.raises(HeadError) as info:
        parse_request_head(raw)
    return str(info.value)


def test_a_plain_request_is_rewritten_with_connection_close() -> None:
    raw = (
        b"GET /a?b=c HTTP/1.1\r\nHost: Good.Test:80\r\nUser-Agent: x\ty\r\n"
        b"Connection: keep-alive, X-Private\r\nX-Private: 1\r\nKeep-Alive: 5\r\n"
        b"Proxy-Connection: keep-alive\r\nUpgrade: h2c\r\n\r\nBODY"
    )
    head = parse(raw)
    assert (head.method, head.target, head.version) == ("GET", "/a?b=c", "HTTP/1.1")
    assert head.host == Authority("good.test", 80)
    assert head.head == (
        b"GET /a?b=c HTTP/1.1\r\nHost: Good.Test:80\r\nUser-Agent: x\ty\r\n"
        b"Connection: close\r\n\r\n"
    )
    assert raw[head.consumed :] == b"BODY" and head.body == "none"


def test_incomplete_heads_wait_but_bare_line_ends_are_refused_at_once() -> None:
    assert parse_request_head(b"GET / HTTP/1.1\r\nHost: good.test\r") is None
    assert parse_request_head(b"GET / HTTP/1.1\r\nHo") is None
    assert "bare LF" in refused(b"GET / HTTP/1.1\nHost: good.test")
    assert "too large" in refused(b"GET / HTTP/1.1\r\nX: " + b"a" * MAX_HEAD)


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"GET / HTTP/1.1\r\nHost: good.test\r\nX-A: 1\nConnection: keep-alive\r\n\r\n", "bare LF"),
        (b"GET / HTTP/1.1\n\r\nGET http://o.test/ HTTP/1.1\r\nHost: good.test\r\n\r\n", "bare LF"),
        (b"GET / HTTP/1.1\r\nHost: good.test\r\nX-A: 1\rConnection: x\r\n\r\n", "bare CR"),
        (b"GET / HTTP/1.1\r\nHost: good.test\r\nX-A: a\x00b\r\n\r\n", "control byte"),
        (b"GET / HTTP/1.1\r\nHost: good.test\r\nX-A: a\x7fb\r\n\r\n", "control byte"),
        (b"GET / HTTP/1.1\r\nHost: good.test\r\nX-A: a\x1bb\r\n\r\n", "control byte"),
        (b"GET / HTTP/1.1\r\nHost : good.test\r\n\r\n", "malformed header line"),
        (b"GET / HTTP/1.1\r\nHost: good.test\r\n  folded\r\n\r\n", "obs-fold"),
        (b"GET / HTTP/1.1\r\n\tHost: good.test\r\n\r\n", "obs-fold"),
        (b"GET / HTTP/1.1\r\nNoColon\r\n\r\n", "malformed header line"),
        (b"GET  / HTTP/1.1\r\nHost: good.test\r\n\r\n", "request line"),
        (b"GET /\t HTTP/1.1\r\nHost: good.test\r\n\r\n", "visible ASCII"),
        (b"GET /\xc3\xa9 HTTP/1.1\r\nHost: good.test\r\n\r\n", "visible ASCII"),
        (b"GET / HTTP/2.0\r\nHost: good.test\r\n\r\n", "HTTP version"),
        (b"get / HTTP/1.1\r\nHost: good.test\r\n\r\n", "method"),
        (b"GET /#frag HTTP/1.1\r\nHost: good.test\r\n\r\n", "fragment"),
        (b"GET * HTTP/1.1\r\nHost: good.test\r\n\r\n", "OPTIONS only"),
        (b"CONNECT good.test:443 HTTP/1.1\r\nHost: good.test\r\n\r\n", "CONNECT"),
        (b"GET / HTTP/1.0\r\n\r\n", "no Host"),
        (b"GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n", "more than one Host"),
        (b"GET / HTTP/1.1\r\nHost: u@good.test\r\n\r\n", "userinfo"),
        (b"GET / HTTP/1.1\r\nHost: good.test:99999\r\n\r\n", "bad port"),
        (b"GET / HTTP/1.1\r\nHost: [::1]\r\n\r\n", "IPv6"),
        (b"GET / HTTP/1.1\r\nHost: b\xc3\xbccher.test\r\n\r\n", "not ASCII"),
        (b"GET / HTTP/1.1\r\nHost: %65vil.test\r\n\r\n", "not a hostname"),
    ],
)
def test_anything_a_server_could_read_differently_is_refused(raw: bytes, why: str) -> None:
    assert why in refused(raw)


def test_options_star_is_accepted() -> None:
    assert parse(b"OPTIONS * HTTP/1.1\r\nHost: good.test\r\n\r\n").target == "*"


@pytest.mark.parametrize(
    ("target", "host"),
    [
        ("http://evil.test#@good.test/", "evil.test"),
        ("http://evil.test?@good.test/", "evil.test"),
        ("http://evil.test/@good.test/", "evil.test"),
        ("http://evil.test", "evil.test"),
        ("HTTP://Evil.Test:8080/x", "evil.test"),
    ],
)
def test_absolute_target_authority_per_rfc_3986(target: str, host: str) -> None:
    assert parse_absolute_target(target).host == host


@pytest.mark.parametrize(
    ("target", "why"),
    [
        ("http://good.test@evil.test/", "userinfo"),
        ("http://:x@evil.test/", "userinfo"),
        ("https://good.test/", "scheme"),
        ("ftp://good.test/", "scheme"),
        ("http:good.test/", "no authority"),
        ("http:///path", "not a hostname"),
        ("good.test/x", "not origin-form"),
        ("1http://good.test/", "not origin-form"),
    ],
)
def test_bad_absolute_targets(target: str, why: str) -> None:
    with pytest.raises(HeadError, match=why):
        parse_absolute_target(target)


def test_absolute_target_must_agree_with_host_on_host_and_port() -> None:
    def req(target: bytes, host: bytes = b"good.test") -> bytes:
        return b"GET " + target + b" HTTP/1.1\r\nHost: " + host + b"\r\n\r\n"

    assert parse(req(b"http://good.test/x")).host.host == "good.test"
    assert parse(req(b"http://GOOD.test:80/x", b"good.test:80")).target == "http://GOOD.test:80/x"
    assert "different hosts" in refused(req(b"http://evil.test?@good.test/"))
    assert "fragment" in refused(req(b"http://evil.test#@good.test/"))
    assert "different hosts" in refused(req(b"http://good.test:8080/"))
    assert "different hosts" in refused(req(b"http://good.test/", b"good.test:8080"))


def test_parse_host() -> None:
    assert parse_host("Good.Test") == Authority("good.test", None)
    assert parse_host("198.18.0.7:80") == Authority("198.18.0.7", 80)
    for bad in ("", ":80", "good.test:", "good..test", "good.test:0", "a b"):
        with pytest.raises(HeadError):
            parse_host(bad)


# ---- body framing --------------------------------------------------------------------


def framer(fields: bytes, version: bytes = b"HTTP/1.1") -> BodyFramer:
    raw = b"POST / " + version + b"\r\nHost: good.test\r\n" + fields + b"\r\n"
    return BodyFramer(parse(raw))


def test_content_length_frames_exactly_that_many_bytes() -> None:
    f = framer(b"Content-Length: 5\r\n")
    assert not f.done
    assert f.feed(b"abc") == 3 and not f.done
    assert f.feed(b"deGET /next") == 2 and f.done
    assert f.feed(b"more") == 0
    assert framer(b"Content-Length: 0\r\n").done
    assert framer(b"").done  # no framing field: no body


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        (b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", "both"),
        (b"Content-Length: 5\r\nContent-Length: 5\r\n", "more than one Content-Length"),
        (b"Content-Length: 5, 5\r\n", "not a number"),
        (b"Content-Length: -1\r\n", "not a number"),
        (b"Transfer-Encoding: chunked, chunked\r\n", "single 'chunked'"),
        (b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n", "single"),
        (b"Transfer-Encoding: identity\r\n", "single 'chunked'"),
    ],
)
def test_ambiguous_framing_is_refused(fields: bytes, why: str) -> None:
    raw = b"POST / HTTP/1.1\r\nHost: good.test\r\n" + fields + b"\r\n"
    assert why in refused(raw)


def test_transfer_encoding_in_http_1_0_is_refused() -> None:
    assert "HTTP/1.0" in refused(
        b"POST / HTTP/1.0\r\nHost: good.test\r\nTransfer-Encoding: chunked\r\n\r\n"
    )


CHUNKED = b"5;name=v\r\nhello\r\n1a\r\n" + b"z" * 26 + b"\r\n0\r\nX-T: 1\r\n\r\n"


def test_chunked_body_ends_where_the_server_ends_it_whatever_the_reads() -> None:
    tail = b"GET /smuggled HTTP/1.1\r\n\r\n"
    for size in (1, 2, 3, 7, 64, len(CHUNKED) + len(tail)):
        f = framer(b"Transfer-Encoding: chunked\r\n")
        stream, taken = CHUNKED + tail, 0
        for i in range(0, len(stream), size):
            piece = stream[i : i + size]
            n = f.feed(piece)
            taken += n
            if f.done:
                break
            assert n == len(piece)
        assert f.done and taken == len(CHUNKED), size


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"5\nhello\r\n0\r\n\r\n", "bare CR or LF"),
        (b"5\r\nhello\n0\r\n\r\n", "bare CR or LF"),
        (b"5\r\nhelloXY\r\n0\r\n\r\n", "longer than its size"),
        (b"x5\r\nhello\r\n0\r\n\r\n", "bad chunk size"),
        (b"+5\r\nhello\r\n0\r\n\r\n", "bad chunk size"),
        (b"5 \r\nhello\r\n0\r\n\r\n", "bad chunk size"),
        (b"11111111111111111\r\n", "bad chunk size"),
        (b"5;a\x00\r\nhello\r\n0\r\n\r\n", "control byte"),
        (b"0\r\nBad Trailer\r\n\r\n", "malformed header line"),
        (b"5\r\nhello\r\r\n0\r\n\r\n", "bare CR or LF"),
        (b"1" * 2000, "line too long"),
    ],
)
def test_malformed_chunked_bodies_are_refused(body: bytes, why: str) -> None:
    f = framer(b"Transfer-Encoding: chunked\r\n")
    with pytest.raises(HeadError, match=why):
        f.feed(body)


def test_the_upstream_head_keeps_alive_only_bodiless_requests_and_websockets() -> None:
    """Under inspection: a bodiless HTTP/1.1 request goes up kept alive, a WebSocket
    upgrade with its Upgrade, anything with a body or in HTTP/1.0 with Connection: close;
    the upstream is reused only after an exactly framed answer with nothing after it."""
    from hutch.net.inspected_http import parse_response_head, reusable, upstream_head

    def up(raw: bytes) -> bytes:
        request = parse_request_head(raw)
        assert request is not None
        return upstream_head(request.head, request)

    plain = up(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: keep-alive\r\n\r\n")
    assert plain == b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
    ws = up(b"GET /ws HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: WebSocket\r\n\r\n")
    assert ws.endswith(b"Host: a\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
    h2c = up(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n")
    assert b"h2c" not in h2c and b"Upgrade" not in h2c
    body = up(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi")
    assert body.endswith(b"Connection: close\r\n\r\n")
    old = up(b"GET / HTTP/1.0\r\nHost: a\r\n\r\n")
    assert old.endswith(b"Connection: close\r\n\r\n")
    ok = parse_response_head(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", "GET")
    closing = parse_response_head(
        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", "GET"
    )
    unframed = parse_response_head(b"HTTP/1.1 200 OK\r\n\r\n", "GET")
    assert ok is not None and closing is not None and unframed is not None
    assert reusable(plain, ok, b"")
    assert not reusable(plain, ok, b"HTTP/1.1 200 OK\r\n")  # more than was framed
    assert not reusable(plain, closing, b"") and not reusable(plain, unframed, b"")
    assert not reusable(body, ok, b"")


async def test_a_response_head_is_read_across_reads_and_leaves_what_follows() -> None:
    """The one reader both inspected relays (HTTP/1.1 and HTTP/2) take answers with: a
    head split over reads, a 1xx then the final head from the same bytes, what follows
    the head handed back; a server that closes mid-head is an error, not a hang."""
    import asyncio

    from hutch.net.inspected_http import read_response_head

    reader = asyncio.StreamReader()
    reader.feed_data(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Le")
    reader.feed_data(b"ngth: 5\r\n\r\nhello")
    reader.feed_eof()
    head, rest = await read_response_head(reader, b"", "POST")
    assert head.status == 100
    head, rest = await read_response_head(reader, rest, "POST")
    assert (head.status, head.framing, head.length) == (200, "length", 5)
    assert head.lines == [b"HTTP/1.1 200 OK", b"Content-Length: 5"]
    assert rest == b"hello"

    cut = asyncio.StreamReader()
    cut.feed_data(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n")
    cut.feed_eof()
    with pytest.raises(HeadError, match="closed before a complete response head"):
        await read_response_head(cut, b"", "GET")
    bad = asyncio.StreamReader()
    bad.feed_eof()
    with pytest.raises(HeadError, match="malformed HTTP response status line"):
        await read_response_head(bad, b"SSH-2.0-OpenSSH\r\n\r\n", "GET")
