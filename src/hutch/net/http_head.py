"""The HTTP/1.x request the egress proxy checks, parsed strictly (pure, sans-IO).

The proxy allows a plain-HTTP request by its Host header and then hands it to a server
it does not control. That is safe only if every server reads the request exactly as the
proxy did, so whatever a lenient server could read differently is refused, never
"repaired" (RFC 9112 lets a server accept a bare LF as a line end; many do):

- the head is lines ending in CRLF up to an empty line, at most :data:`MAX_HEAD` bytes
  and :data:`MAX_FIELDS` fields; a CR or LF anywhere else, NUL, any other control byte
  (HTAB only inside field values) or DEL is refused;
- request line ``METHOD SP target SP HTTP/1.0|HTTP/1.1``; the target is visible ASCII
  and one of: origin-form (``/path?query``), absolute-form (``http://authority/...``,
  see :func:`parse_absolute_target`) or ``*`` for OPTIONS. CONNECT (a tunnel to any
  port) and fragments (``#``, never part of a request target) are refused;
- fields are ``name ":" OWS value OWS``; a name is a token (no space before the colon),
  a line starting with SP/HTAB (obs-fold) is refused;
- exactly one Host, a hostname or IPv4 address with an optional port (no userinfo); an
  absolute-form target must name the same host and port (default 80);
- the body is framed by one Content-Length, or by ``Transfer-Encoding: chunked`` alone
  (HTTP/1.1 only), never both (:class:`BodyFramer` follows it to the end);
- hop-by-hop fields (Connection, the fields it names, Keep-Alive, Proxy-Connection,
  Upgrade) are dropped and ``Connection: close`` is appended: the proxy relays one
  request per connection and the server is told so (under TLS inspection
  :mod:`hutch.net.inspected_http` turns that into keep-alive or a WebSocket upgrade,
  :attr:`RequestHead.upgrade`, where that is safe).

:func:`parse_request_head` returns the checked :class:`RequestHead` (None: read more
bytes) or raises :class:`HeadError` whose message says what was wrong.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from hutch.net.rules import normalize_name

__all__ = [
    "MAX_FIELDS",
    "MAX_HEAD",
    "Authority",
    "BodyFramer",
    "HeadError",
    "RequestHead",
    "parse_absolute_target",
    "parse_host",
    "parse_request_head",
    "rewrite_fields",
]

MAX_HEAD = 16 * 1024
MAX_FIELDS = 100
MAX_TARGET = 8 * 1024
_MAX_CHUNK_LINE = 1024
_MAX_TRAILERS = 8 * 1024

_METHOD = re.compile(rb"[A-Z]{1,16}")
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TARGET = re.compile(rb"[\x21-\x7e]+")
# Field values: visible ASCII, obs-text, SP and HTAB; nothing else (no CR, LF, NUL, DEL).
_VALUE = re.compile(rb"[\x20-\x7e\x80-\xff\t]*")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+\-.]*")
_PORT = re.compile(r"[0-9]{1,5}")
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"upgrade"})
# A CR not followed by LF, or an LF not preceded by CR.
_BARE_BREAK = re.compile(rb"(?<!\r)\n|\r(?!\n)")


class HeadError(ValueError):
    """The request is refused; the message says why (it goes into the 403 and the log)."""


@dataclass(frozen=True)
class Authority:
    """A host (as written, lower-cased by :func:`parse_host`) and an optional port."""

    host: str
    port: int | None

    def same_as(self, other: Authority, default_port: int = 80) -> bool:
        return normalize_name(self.host) == normalize_name(other.host) and (
            self.port or default_port
        ) == (other.port or default_port)


BodyKind = Literal["none", "length", "chunked"]


@dataclass(frozen=True)
class RequestHead:
    """A checked request head. ``head`` is what goes upstream (ends with CRLF CRLF);
    ``consumed`` is how many input bytes the head took (the body follows)."""

    method: str
    target: str
    version: str
    host: Authority
    head: bytes
    consumed: int
    body: BodyKind
    length: int = 0  # body == "length": its size in bytes
    #: The protocol asked for by ``Upgrade`` when ``Connection`` names ``upgrade``
    #: (lower-cased, e.g. "websocket"); dropped from ``head`` like every hop-by-hop
    #: field. Only the inspected relay acts on it (WebSockets, :mod:`inspected_http`).
    upgrade: str | None = None


def parse_host(value: str, what: str = "Host header") -> Authority:
    """``host[:port]`` as in a Host header or an authority without userinfo. Raises
    HeadError naming ``what`` when it is not a hostname or IPv4 address."""
    if "@" in value:
        raise HeadError(f"{what} {value!r} carries userinfo")
    if value.startswith("["):
        raise HeadError(f"{what} {value!r} is an IPv6 literal (sandboxes are IPv4 only)")
    host, sep, port_text = value.partition(":")
    port: int | None = None
    if sep:
        if not _PORT.fullmatch(port_text) or not 0 < int(port_text) < 65536:
            raise HeadError(f"{what} {value!r} has a bad port")
        port = int(port_text)
    if not host or normalize_name(host) is None or "%" in host:
        raise HeadError(f"{what} {value!r} is not a hostname")
    return Authority(host.lower(), port)


def parse_absolute_target(target: str) -> Authority:
    """The authority of an absolute-form request target, per RFC 3986 section 3: the
    scheme ends at the first ``:``, the authority follows ``//`` and ends at the first
    ``/``, ``?`` or ``#`` (so ``http://evil#@good/`` names ``evil``). Only ``http`` is
    accepted (this is the plain-HTTP port); userinfo is refused."""
    scheme, sep, rest = target.partition(":")
    if not sep or not _SCHEME.fullmatch(scheme):
        raise HeadError(f"request target {target!r} is not origin-form or an absolute URL")
    if scheme.lower() != "http":
        raise HeadError(f"request URL scheme {scheme!r} is not http")
    if not rest.startswith("//"):
        raise HeadError(f"request URL {target!r} has no authority")
    authority = re.split(r"[/?#]", rest[2:], maxsplit=1)[0]
    return parse_host(authority, "request URL authority")


def _check_target(method: str, target: str) -> Authority | None:
    if len(target) > MAX_TARGET:
        raise HeadError("request target is too long")
    if "#" in target:
        raise HeadError("request target has a fragment ('#')")
    if target.startswith("/"):
        return None
    if target == "*":
        if method != "OPTIONS":
            raise HeadError("'*' is a request target for OPTIONS only")
        return None
    return parse_absolute_target(target)


def _check_breaks(data: bytes) -> None:
    """Refuse any CR or LF in ``data`` that is not part of a CRLF pair."""
    bare = _BARE_BREAK.search(data)
    if bare is not None:
        which = "LF" if bare.group() == b"\n" else "CR"
        raise HeadError(f"bare {which} in the request head (lines must end in CRLF)")


def _lines(head: bytes) -> list[bytes]:
    """Split a head (without its final CRLF CRLF) into lines, refusing bare CR/LF."""
    _check_breaks(head)
    return head.split(b"\r\n")


def _field(line: bytes) -> tuple[bytes, bytes]:
    if line[:1] in (b" ", b"\t"):
        raise HeadError("folded header line (obs-fold) in the request head")
    name, colon, value = line.partition(b":")
    if not colon or not _TOKEN.fullmatch(name):
        raise HeadError(f"malformed header line {line[:60]!r}")
    if not _VALUE.fullmatch(value):
        raise HeadError(f"control byte in the {name.decode()} header")
    return name, value.strip(b" \t")


def parse_request_head(buf: bytes) -> RequestHead | None:
    """See the module docstring. None: the head is not complete yet (read more)."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if len(buf) > MAX_HEAD:
            raise HeadError("HTTP request headers are too large")
        # A bare LF is refused as soon as it arrives, not at the size limit (a CR at the
        # very end may still get its LF with the next read).
        _check_breaks(buf.removesuffix(b"\r"))
        return None
    if end + 4 > MAX_HEAD:
        raise HeadError("HTTP request headers are too large")
    lines = _lines(buf[:end])
    method, target, version = _request_line(lines[0])
    fields = [_field(line) for line in lines[1:]]
    if len(fields) > MAX_FIELDS:
        raise HeadError(f"more than {MAX_FIELDS} header fields")
    absolute = _check_target(method, target)
    hosts = [v for k, v in fields if k.lower() == b"host"]
    if not hosts:
        raise HeadError("HTTP request has no Host header")
    if len(hosts) > 1:
        raise HeadError("HTTP request has more than one Host header")
    if not hosts[0].isascii():
        raise HeadError("Host header is not ASCII (IDNA names are sent as xn--)")
    host = parse_host(hosts[0].decode("ascii"))
    if absolute is not None and not absolute.same_as(host):
        raise HeadError("request URL and Host header name different hosts")
    body, length = _framing(fields, version)
    options: set[bytes] = set()
    for key, value in fields:
        if key.lower() == b"connection":
            options |= {opt.strip().lower() for opt in value.split(b",") if opt.strip()}
    named = _HOP_BY_HOP | options
    upgrades = [v for k, v in fields if k.lower() == b"upgrade"]
    upgrade = None
    if b"upgrade" in options and len(upgrades) == 1 and upgrades[0].isascii():
        upgrade = upgrades[0].decode("ascii").strip().lower()
    kept = [lines[0]] + [
        line for line, (key, _) in zip(lines[1:], fields, strict=True) if key.lower() not in named
    ]
    kept.append(b"Connection: close")
    return RequestHead(
        method=method,
        target=target,
        version=version,
        host=host,
        head=b"\r\n".join(kept) + b"\r\n\r\n",
        consumed=end + 4,
        body=body,
        length=length,
        upgrade=upgrade,
    )


def rewrite_fields(
    head: bytes, set_fields: Sequence[tuple[str, str]], remove: Sequence[str]
) -> bytes:
    """``head`` (a checked head, as :func:`parse_request_head` returned it) with every
    field named in ``remove`` or ``set_fields`` dropped (names ignore case) and the
    ``set_fields`` added before ``Connection: close``. Values must hold no CR, LF or
    other control byte but HTAB (HeadError otherwise: a value must never split the
    head)."""
    lines = head[:-4].split(b"\r\n")  # without the final CRLF CRLF
    drop = {n.lower().encode("ascii") for n in remove} | {
        n.lower().encode("ascii") for n, _ in set_fields
    }
    kept = [lines[0]]
    for line in lines[1:]:
        key = line.split(b":", 1)[0].lower()
        if key == b"connection" or key not in drop:
            kept.append(line)
    close = kept.pop()  # Connection: close stays last
    for name, value in set_fields:
        raw = value.encode("latin-1", "strict") if value.isascii() else value.encode("utf-8")
        if not _VALUE.fullmatch(raw):
            raise HeadError(f"the value set for {name} holds a control character")
        kept.append(name.encode("ascii") + b": " + raw)
    kept.append(close)
    return b"\r\n".join(kept) + b"\r\n\r\n"


def _request_line(line: bytes) -> tuple[str, str, str]:
    parts = line.split(b" ")
    if len(parts) != 3:
        raise HeadError("malformed HTTP request line (METHOD SP target SP version)")
    method, target, version = parts
    if not _METHOD.fullmatch(method):
        raise HeadError("malformed HTTP request method")
    if not _TARGET.fullmatch(target):
        raise HeadError("request target has bytes outside visible ASCII")
    if version not in (b"HTTP/1.0", b"HTTP/1.1"):
        raise HeadError(f"HTTP version {version[:20]!r} is not HTTP/1.0 or HTTP/1.1")
    if method == b"CONNECT":
        raise HeadError("CONNECT (a tunnel to any port) is not relayed; use a host:port rule")
    return method.decode(), target.decode("ascii"), version.decode()


def _framing(fields: list[tuple[bytes, bytes]], version: str) -> tuple[BodyKind, int]:
    lengths = [v for k, v in fields if k.lower() == b"content-length"]
    codings = [v for k, v in fields if k.lower() == b"transfer-encoding"]
    if codings:
        if version != "HTTP/1.1":
            raise HeadError("Transfer-Encoding in an HTTP/1.0 request")
        if lengths:
            raise HeadError("both Content-Length and Transfer-Encoding")
        if len(codings) > 1 or codings[0].lower() != b"chunked":
            raise HeadError("Transfer-Encoding other than a single 'chunked'")
        return "chunked", 0
    if len(lengths) > 1:
        raise HeadError("more than one Content-Length")
    if lengths:
        if not re.fullmatch(rb"[0-9]{1,18}", lengths[0]):
            raise HeadError(f"Content-Length {lengths[0][:20]!r} is not a number")
        size = int(lengths[0])
        return ("length", size) if size else ("none", 0)
    return "none", 0


class BodyFramer:
    """Follows one request body to its end, as the server will (sans-IO).

    ``feed(data)`` returns how many leading bytes of ``data`` belong to the body (the
    caller forwards exactly those); once :attr:`done`, the rest of the stream is not
    part of this request. A malformed chunked body raises :class:`HeadError`."""

    _payload: list[bytes] | None

    def __init__(self, request: RequestHead) -> None:
        self._start(request.body, request.length)

    @classmethod
    def framing(cls, kind: BodyKind, length: int = 0) -> BodyFramer:
        """A framer for a body framed as ``kind`` (a response's, for the inspected relay:
        the same strict chunked grammar as requests)."""
        framer = cls.__new__(cls)
        framer._start(kind, length)
        return framer

    def keep_payload(self) -> None:
        """From now on :meth:`feed` also keeps the body's payload (chunked framing
        removed), for :meth:`take_payload`: HTTP/2 DATA carries bodies unchunked."""
        self._payload = []

    def take_payload(self) -> bytes:
        out = b"".join(self._payload or ())
        if self._payload is not None:
            self._payload.clear()
        return out

    def _start(self, kind: BodyKind, length: int) -> None:
        self._payload = None
        self._kind = kind
        self._left = length  # "length": bytes to go; "chunked": of this chunk
        self._state = "size" if self._kind == "chunked" else "data"
        self._line = b""
        self._trailer_bytes = 0
        self.done = self._kind == "none" or (self._kind == "length" and self._left == 0)

    def feed(self, data: bytes) -> int:
        if self.done:
            return 0
        if self._kind == "length":
            take = min(self._left, len(data))
            self._left -= take
            self.done = self._left == 0
            if self._payload is not None:
                self._payload.append(data[:take])
            return take
        pos = 0
        while pos < len(data) and not self.done:
            if self._state == "data":
                take = min(self._left, len(data) - pos)
                if self._payload is not None:
                    self._payload.append(data[pos : pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = "data-crlf"
                continue
            newline = data.find(b"\n", pos)
            piece = data[pos : newline + 1] if newline >= 0 else data[pos:]
            pos += len(piece)
            self._line += piece
            if len(self._line) > _MAX_CHUNK_LINE:
                raise HeadError("chunked body: line too long")
            if newline >= 0:
                self._end_of_line(self._line)
                self._line = b""
        return pos

    def _end_of_line(self, line: bytes) -> None:
        if not line.endswith(b"\r\n") or b"\r" in line[:-2]:
            raise HeadError("chunked body: bare CR or LF")
        text = line[:-2]
        if self._state == "data-crlf":
            if text:
                raise HeadError("chunked body: chunk data longer than its size")
            self._state = "size"
        elif self._state == "size":
            size, _, ext = text.partition(b";")
            if not re.fullmatch(rb"[0-9A-Fa-f]{1,16}", size):
                raise HeadError("chunked body: bad chunk size")
            if ext and not _VALUE.fullmatch(ext):
                raise HeadError("chunked body: control byte in a chunk extension")
            self._left = int(size, 16)
            self._state = "data" if self._left else "trailer"
        else:  # trailer fields, then an empty line
            if not text:
                self.done = True
                return
            self._trailer_bytes += len(line)
            if self._trailer_bytes > _MAX_TRAILERS:
                raise HeadError("chunked body: trailer too large")
            _field(text)
