"""One checked plain-HTTP request through the egress proxy, and nothing after it.

Why one and not "parse and check each request of a keep-alive connection": the proxy
would then have to agree with every server, request after request, on where each one
ends. Relaying exactly one request (its head as :mod:`hutch.net.http_head` rewrote it,
then precisely the body its framing announces) and then no further byte from the guest
means a second request can never reach the server, whatever the server makes of the
first one: pipelined or smuggled bytes are read and dropped. The server is told
``Connection: close``; its answer is relayed until it closes. Clients open a new
connection for their next request (HTTP clients handle ``Connection: close`` always);
TLS connections are not affected (the proxy sees only their SNI, once).

The I/O is :class:`hutch.net.relay.Relay`'s: the proxy starts it with the checked head
as its first bytes, :class:`OneRequest` as its ``upload`` filter and ``answer_ends``
(the guest's EOF is passed on as a half-close, as a plain relay would, so a server that
ignores ``Connection: close`` still ends; the relay ends when the server's answer does).
"""

from __future__ import annotations

from hutch.net.http_head import BodyFramer, HeadError, RequestHead
from hutch.net.relay import RelayCut

__all__ = ["OneRequest"]


class OneRequest:
    """The upload filter of one request (sans-IO): called with each chunk the guest
    sends after the head, returns the part of it that belongs to the body as framed
    (``b""`` once the body is complete: whatever follows is dropped, never sent).
    A malformed chunked body raises :class:`RelayCut` ("request body: ...": the
    connection is closed at once, nothing more is sent)."""

    def __init__(self, request: RequestHead) -> None:
        self._framer = BodyFramer(request)

    def __call__(self, data: bytes) -> bytes:
        if self._framer.done:
            return b""
        try:
            take = self._framer.feed(data)
        except HeadError as exc:
            raise RelayCut(f"request body: {exc}") from exc
        return data[:take]
