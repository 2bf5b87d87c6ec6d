"""What a guest sends first on a proxied connection: a TLS ClientHello's server name
(SNI) or a strictly parsed HTTP/1.x request head (pure, sans-IO).

TLS records may arrive split over many reads; no SNI, several, or an encrypted
ClientHello (ECH) is refused. HTTP heads are parsed by :mod:`hutch.net.http_head`.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Literal

from hutch.net.http_head import HeadError, RequestHead, parse_request_head

__all__ = ["MAX_PEEK", "MAX_TLS_HELLO", "Sniffed", "sniff"]

MAX_TLS_HELLO = 64 * 1024
MAX_PEEK = MAX_TLS_HELLO + 1024
_EXT_SERVER_NAME = 0
_EXT_ECH = 0xFE0D
_METHOD_START = re.compile(rb"^[A-Z]{1,16}( |$)")


@dataclass(frozen=True)
class Sniffed:
    """What the first bytes say: the protocol, the name, or why there is none.
    ``head`` is what to send upstream instead of the bytes read (HTTP rewrites);
    ``request`` the checked HTTP request (its body follows ``request.consumed``)."""

    protocol: Literal["tls", "http", "unknown"]
    name: str | None
    error: str | None = None
    head: bytes | None = None
    request: RequestHead | None = None


def sniff(buf: bytes) -> Sniffed | None:
    """Parse the start of a connection; None means "read more bytes first"."""
    if not buf:
        return None
    if buf[0] == 0x16:
        return _sniff_tls(buf)
    if len(buf) > MAX_PEEK:  # e.g. endless empty TLS records: never buffer without bound
        return Sniffed("unknown", None, "no server name in the first 64 KiB")
    if _METHOD_START.match(buf[:17]):
        return _sniff_http(buf)
    return Sniffed("unknown", None, "neither a TLS ClientHello nor an HTTP/1.x request")


def _sniff_tls(buf: bytes) -> Sniffed | None:
    handshake = bytearray()
    off = 0
    while True:
        if len(buf) < off + 5:
            return None
        ctype = buf[off]
        (length,) = struct.unpack_from("!H", buf, off + 3)
        if ctype != 0x16:
            return Sniffed("tls", None, "TLS data before the ClientHello was complete")
        if len(buf) < off + 5 + length:
            return None
        handshake += buf[off + 5 : off + 5 + length]
        off += 5 + length
        if len(handshake) >= 4:
            if handshake[0] != 1:
                return Sniffed("tls", None, "the first TLS handshake message is not ClientHello")
            need = 4 + int.from_bytes(handshake[1:4], "big")
            if need > MAX_TLS_HELLO:
                return Sniffed("tls", None, "TLS ClientHello is too large")
            if len(handshake) >= need:
                return _client_hello(bytes(handshake[4:need]))


def _client_hello(body: bytes) -> Sniffed:
    try:
        pos = 2 + 32  # legacy_version, random
        pos += 1 + body[pos]  # session id
        pos += 2 + struct.unpack_from("!H", body, pos)[0]  # cipher suites
        pos += 1 + body[pos]  # compression methods
        if pos == len(body):
            return Sniffed("tls", None, "TLS ClientHello has no server name (SNI)")
        (ext_total,) = struct.unpack_from("!H", body, pos)
        pos += 2
        end = pos + ext_total
        if end > len(body):
            raise ValueError("extensions overrun")
        names: list[str] = []
        while pos + 4 <= end:
            ext_type, ext_len = struct.unpack_from("!HH", body, pos)
            pos += 4
            data = body[pos : pos + ext_len]
            pos += ext_len
            if ext_type == _EXT_ECH:
                return Sniffed("tls", None, "encrypted ClientHello (ECH) hides the server name")
            if ext_type == _EXT_SERVER_NAME:
                names.extend(_server_names(data))
    except (IndexError, struct.error, ValueError, UnicodeDecodeError):
        return Sniffed("tls", None, "malformed TLS ClientHello")
    if not names:
        return Sniffed("tls", None, "TLS ClientHello has no server name (SNI)")
    if len(names) > 1:
        return Sniffed("tls", None, "TLS ClientHello names more than one server")
    return Sniffed("tls", names[0])


def _server_names(data: bytes) -> list[str]:
    (total,) = struct.unpack_from("!H", data, 0)
    pos, end, out = 2, 2 + total, []
    if end > len(data):
        raise ValueError("server_name list overruns")
    while pos + 3 <= end:
        kind, length = data[pos], struct.unpack_from("!H", data, pos + 1)[0]
        pos += 3
        if kind == 0:  # host_name
            out.append(data[pos : pos + length].decode("ascii"))
        pos += length
    return out


def _sniff_http(buf: bytes) -> Sniffed | None:
    try:
        request = parse_request_head(buf)
    except HeadError as exc:
        return Sniffed("http", None, str(exc))
    if request is None:
        return None
    return Sniffed("http", request.host.host, None, request.head, request)
