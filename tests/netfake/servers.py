"""The fake internet's servers, run as one process inside the fake-internet netns:
``python -m tests.netfake.servers SPEC.json`` (``FakeInternet`` starts it).

- HTTP on 80 and HTTPS on 443 (IPv4 and IPv6, every address): ``GET /`` answers JSON
  naming the Host header and TLS SNI the server saw and the address it was reached on;
  ``GET /bytes/N`` sends N bytes of 0xa5 (throughput, streamed downloads); ``GET /ws``
  with ``Upgrade: websocket`` is a WebSocket echo (RFC 6455, every frame sent back
  unmasked until a close frame); ``/dns-query`` is a DoH endpoint (RFC 8484
  GET ``?dns=`` and POST) answering from the zone.
- DNS (UDP and TCP 53) on the resolver address: authoritative for ``*.test`` (A, AAAA,
  TXT, CNAME chased within the zone); NXDOMAIN for unknown ``.test`` names, REFUSED for
  the rest.
- A rogue resolver on another address that answers anything.
- HTTP answers in the request's own version: an HTTP/1.1 request keeps the connection
  alive (pipelined requests are served in turn) unless it says ``Connection: close``;
  like many real servers it also takes a bare LF as a line end.
- UDP echo on 7 and 443 (web addresses; 443 plays QUIC); line echo on TCP 7 (for
  connections held open across rule changes); banners on TCP 25 (SMTP-ish) and 2222
  (SSH-ish).

Every request or query that arrives is appended as one JSON line to the events file, so
a test can prove what reached the internet and, more important, what never did.
"""

from __future__ import annotations

import base64
import hashlib
import json
import signal
import socket
import socketserver
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import dns.rrset

__all__ = ["main"]

_CHUNK = b"\xa5" * (1 << 16)
_MAX_BYTES = 1 << 30


class EventLog:
    """Append-only JSON-lines file shared by every server thread."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("a", buffering=1)
        self._lock = threading.Lock()

    def write(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"time": time.time(), "kind": kind, **fields}, sort_keys=True)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()


def _plain(addr: str) -> str:
    """``::ffff:198.18.0.10`` -> ``198.18.0.10`` (dual-stack sockets report v4 that way)."""
    return addr.removeprefix("::ffff:")


class Zone:
    """The authoritative data: name -> A / AAAA / TXT records (names lower-case, no dot)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.a: dict[str, list[str]] = spec["a"]
        self.aaaa: dict[str, list[str]] = spec["aaaa"]
        self.txt: dict[str, list[str]] = spec["txt"]
        self.cname: dict[str, str] = spec.get("cname", {})

    def answer(self, query: dns.message.Message) -> dns.message.Message:
        reply = dns.message.make_response(query)
        reply.flags |= dns.flags.AA
        if not query.question:
            reply.set_rcode(dns.rcode.FORMERR)
            return reply
        q = query.question[0]
        name = q.name.to_text().rstrip(".").lower()
        owner = q.name
        for _ in range(8):  # CNAME chain (inside the zone), then the target's records
            target = self.cname.get(name)
            if target is None:
                break
            reply.answer.append(dns.rrset.from_text(owner, 30, "IN", "CNAME", target + "."))
            name, owner = target, dns.name.from_text(target)
        known = name in self.a or name in self.aaaa or name in self.txt
        if not known:
            reply.set_rcode(dns.rcode.NXDOMAIN if name.endswith(".test") else dns.rcode.REFUSED)
            return reply
        table = {dns.rdatatype.A: self.a, dns.rdatatype.AAAA: self.aaaa}
        if q.rdtype in table:
            values = table[q.rdtype].get(name, [])
        elif q.rdtype == dns.rdatatype.TXT:
            values = [f'"{t}"' for t in self.txt.get(name, [])]
        else:
            values = []
        if values:
            reply.answer.append(
                dns.rrset.from_text_list(owner, 30, "IN", dns.rdatatype.to_text(q.rdtype), values)
            )
        return reply


def rogue_answer(query: dns.message.Message, address: str) -> dns.message.Message:
    """What the rogue resolver says to anything: ``address`` for A, "rogue" for TXT."""
    reply = dns.message.make_response(query)
    if query.question:
        q = query.question[0]
        if q.rdtype == dns.rdatatype.A:
            reply.answer.append(dns.rrset.from_text(q.name, 30, "IN", "A", address))
        elif q.rdtype == dns.rdatatype.TXT:
            reply.answer.append(dns.rrset.from_text(q.name, 30, "IN", "TXT", '"rogue"'))
    return reply


def _describe(query: dns.message.Message) -> dict[str, Any]:
    if not query.question:
        return {"qname": None, "qtype": None}
    q = query.question[0]
    return {"qname": q.name.to_text().rstrip("."), "qtype": dns.rdatatype.to_text(q.rdtype)}


class Resolver:
    """One DNS endpoint (authoritative or rogue) shared by its UDP and TCP servers."""

    def __init__(self, kind: str, log: EventLog, zone: Zone | None, rogue_addr: str) -> None:
        self.kind = kind
        self.log = log
        self.zone = zone
        self.rogue_addr = rogue_addr

    def handle(self, wire: bytes, transport: str, peer: str) -> bytes | None:
        try:
            query = dns.message.from_wire(wire)
        except Exception as exc:  # a malformed packet is logged, not fatal
            self.log.write(self.kind, transport=transport, peer=peer, error=repr(exc))
            return None
        self.log.write(self.kind, transport=transport, peer=_plain(peer), **_describe(query))
        if self.zone is not None:
            reply = self.zone.answer(query)
        else:
            reply = rogue_answer(query, self.rogue_addr)
        return bytes(reply.to_wire())


class _UdpDns(socketserver.BaseRequestHandler):
    server: _DnsUdpServer

    def handle(self) -> None:
        data, sock = self.request
        out = self.server.resolver.handle(data, "udp", self.client_address[0])
        if out is not None:
            sock.sendto(out, self.client_address)


class _TcpDns(socketserver.BaseRequestHandler):
    server: _DnsTcpServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(10)
        with sock.makefile("rb") as f:
            while True:
                head = f.read(2)
                if len(head) < 2:
                    return
                wire = f.read(int.from_bytes(head, "big"))
                out = self.server.resolver.handle(wire, "tcp", self.client_address[0])
                if out is None:
                    return
                sock.sendall(len(out).to_bytes(2, "big") + out)


class _DnsUdpServer(socketserver.ThreadingUDPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], resolver: Resolver) -> None:
        self.resolver = resolver
        super().__init__(addr, _UdpDns)


class _DnsTcpServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], resolver: Resolver) -> None:
        self.resolver = resolver
        super().__init__(addr, _TcpDns)


class _DualStack:
    """Mixin: listen on ``::`` for IPv6 and IPv4 (mapped) at once."""

    address_family: int = socket.AF_INET6

    def server_bind(self) -> None:
        sock: socket.socket = self.socket  # type: ignore[attr-defined]
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()  # type: ignore[misc]


class _Web(BaseHTTPRequestHandler):
    server: _WebServer
    protocol_version = "HTTP/1.0"
    timeout = 30  # an idle kept-alive connection is closed after this many seconds

    def parse_request(self) -> bool:
        # Answer in the client's version: HTTP/1.1 gets keep-alive and pipelining, as
        # from a real server (the egress proxy must not rely on the server closing).
        line: bytes = self.raw_requestline  # type: ignore[attr-defined]  # set by the base
        version = line.rstrip(b"\r\n").rpartition(b" ")[2]
        self.protocol_version = "HTTP/1.1" if version == b"HTTP/1.1" else "HTTP/1.0"
        return super().parse_request()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the event log says everything that matters

    def _facts(self) -> dict[str, Any]:
        sni = getattr(self.connection, "hutch_sni", None)
        local = _plain(self.connection.getsockname()[0])
        return {
            "scheme": self.server.scheme,
            "host": self.headers.get("Host"),
            "sni": sni,
            "local": local,
            "peer": _plain(self.client_address[0]),
            "path": self.path,
            "method": self.command,
            # Echoed in the answer too: a server echoing an injected credential is what
            # the egress proxy's redaction is tested against.
            "authorization": self.headers.get("Authorization"),
        }

    def _send(self, status: int, ctype: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _doh(self, facts: dict[str, Any], wire: bytes | None) -> None:
        self.server.log.write("doh", **facts)
        if not wire:
            self._send(400, "text/plain", b"no dns message\n")
            return
        out = self.server.resolver.handle(wire, "doh", facts["peer"])
        if out is None:
            self._send(400, "text/plain", b"bad dns message\n")
            return
        self._send(200, "application/dns-message", out)

    def do_GET(self) -> None:
        facts = self._facts()
        url = urlsplit(self.path)
        if url.path == "/dns-query":
            param = parse_qs(url.query).get("dns", [""])[0]
            wire = base64.urlsafe_b64decode(param + "=" * (-len(param) % 4)) if param else None
            self._doh(facts, wire)
            return
        self.server.log.write(self.server.scheme, **facts)
        if url.path == "/ws" and (self.headers.get("Upgrade") or "").lower() == "websocket":
            self._websocket()
            return
        if url.path.startswith("/bytes/"):
            count = int(url.path.removeprefix("/bytes/") or 0)
            if not 0 <= count <= _MAX_BYTES:
                self._send(400, "text/plain", b"0 <= N <= 1 GiB\n")
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(count))
            self.end_headers()
            while count > 0:
                piece = _CHUNK[: min(count, len(_CHUNK))]
                self.wfile.write(piece)
                count -= len(piece)
            return
        body = json.dumps({"server": "fakenet", **facts}, sort_keys=True).encode() + b"\n"
        self._send(200, "application/json", body)

    def _websocket(self) -> None:
        key = (self.headers.get("Sec-WebSocket-Key") or "").encode()
        guid = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
        accept = base64.b64encode(hashlib.sha1(key + guid).digest()).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True
        while True:
            head = self.rfile.read(2)
            if len(head) < 2:
                return
            size = head[1] & 0x7F
            if size == 126:
                size = int.from_bytes(self.rfile.read(2), "big")
            elif size == 127:
                size = int.from_bytes(self.rfile.read(8), "big")
            mask = self.rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
            data = self.rfile.read(size)
            payload = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
            if size < 126:
                length = bytes([size])
            elif size < 65536:
                length = bytes([126]) + size.to_bytes(2, "big")
            else:
                length = bytes([127]) + size.to_bytes(8, "big")
            self.wfile.write(bytes([head[0]]) + length + payload)
            self.wfile.flush()
            if head[0] & 0x0F == 8:
                return

    def do_POST(self) -> None:
        facts = self._facts()
        length = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(length) if 0 < length <= 65535 else b""
        if urlsplit(self.path).path == "/dns-query":
            self._doh(facts, data)
            return
        self.server.log.write(self.server.scheme, **facts)
        self._send(404, "text/plain", b"only /dns-query takes POST\n")


class _WebServer(_DualStack, socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(
        self, port: int, log: EventLog, resolver: Resolver, tls: ssl.SSLContext | None
    ) -> None:
        self.log = log
        self.resolver = resolver
        self.tls = tls
        self.scheme = "https" if tls else "http"
        super().__init__(("::", port), _Web)

    def finish_request(self, request: Any, client_address: Any) -> None:
        # The TLS handshake runs here, in the request's own thread, so a client that
        # stalls mid-handshake never blocks accept().
        if self.tls is not None:
            request.settimeout(15)
            try:
                request = self.tls.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError) as exc:
                self.log.write("tls-error", peer=_plain(client_address[0]), error=repr(exc))
                return
        super().finish_request(request, client_address)


class _Banner(socketserver.BaseRequestHandler):
    server: _BannerServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        port = sock.getsockname()[1]
        self.server.log.write(
            "tcp", port=port, local=_plain(sock.getsockname()[0]),
            peer=_plain(self.client_address[0]),
        )  # fmt: skip
        sock.sendall(self.server.banner)
        sock.settimeout(5)
        try:
            line = sock.recv(1024)
        except OSError:
            return
        if line:
            sock.sendall(b"echo " + line)


class _BannerServer(_DualStack, socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, banner: bytes, log: EventLog) -> None:
        self.banner = banner
        self.log = log
        super().__init__(("::", port), _Banner)


class _LineEcho(socketserver.StreamRequestHandler):
    """TCP 7: every line comes back until the client closes (held connections)."""

    server: _LineEchoServer
    timeout = 120

    def handle(self) -> None:
        sock: socket.socket = self.request
        self.server.log.write(
            "tcp-echo", port=sock.getsockname()[1], local=_plain(sock.getsockname()[0]),
            peer=_plain(self.client_address[0]),
        )  # fmt: skip
        try:
            for line in self.rfile:
                self.wfile.write(line)
                self.wfile.flush()
        except OSError:
            return


class _LineEchoServer(_DualStack, socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, log: EventLog) -> None:
        self.log = log
        super().__init__(("::", port), _LineEcho)


class _Echo(socketserver.BaseRequestHandler):
    server: _EchoServer

    def handle(self) -> None:
        data, sock = self.request
        self.server.log.write(
            "udp", port=sock.getsockname()[1], local=_plain(sock.getsockname()[0]),
            peer=_plain(self.client_address[0]), size=len(data),
        )  # fmt: skip
        sock.sendto(data, self.client_address)


class _EchoServer(socketserver.ThreadingUDPServer):
    """Bound to one address (not ``::``) so the reply leaves from the address asked."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: str, port: int, log: EventLog) -> None:
        self.log = log
        if ":" in addr:
            self.address_family = socket.AF_INET6
        super().__init__((addr, port), _Echo)


def serve(spec: dict[str, Any]) -> list[socketserver.BaseServer]:
    """Bind every server of ``spec`` and start its thread; returns the servers."""
    log = EventLog(Path(spec["events"]))
    zone = Zone(spec["zone"])
    good = Resolver("dns", log, zone, "")
    rogue = Resolver("rogue-dns", log, None, spec["rogue_answer"])
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(spec["cert"], spec["key"])

    def remember_sni(sock: Any, name: str | None, ctx: ssl.SSLContext) -> None:
        sock.hutch_sni = name

    tls.sni_callback = remember_sni
    servers: list[socketserver.BaseServer] = [
        _DnsUdpServer((spec["dns"], 53), good),
        _DnsTcpServer((spec["dns"], 53), good),
        _DnsUdpServer((spec["rogue"], 53), rogue),
        _DnsTcpServer((spec["rogue"], 53), rogue),
        _WebServer(80, log, good, None),
        _WebServer(443, log, good, tls),
        _BannerServer(25, b"220 fakenet ESMTP ready\r\n", log),
        _BannerServer(2222, b"SSH-2.0-fakenet\r\n", log),
        _LineEchoServer(7, log),
        *(_EchoServer(addr, port, log) for addr in spec["udp_echo"] for port in (7, 443)),
    ]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    return servers


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.netfake.servers SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    serve(spec)
    # The parent waits for this file: everything is bound once it exists.
    Path(spec["ready"]).write_text("ready\n")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
