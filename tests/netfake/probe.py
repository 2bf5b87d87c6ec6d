"""Network checks run *inside* a sandbox (stdlib only: the guest has python3, no dnspython):
``python3 probe.py '[{"op": "https", "sni": "good.test"}, ...]'`` prints one JSON result
per check, in order. Checks run concurrently so that a batch of denied connections
(which time out) costs one timeout, not one per check.

Every result has ``ok`` (the thing worked end to end) and ``error`` or what was seen.
Ops and their fields (``timeout`` defaults to 4 s everywhere):

- ``resolve`` name -> addrs (IPv4, the system resolver: hutch's)
- ``http`` host, [addr] (default: resolve host), [port=80], [path=/] -> status, seen
- ``https`` sni, [host=sni], [addr], [port=443], [path=/] -> status, seen (CA: ``ca``)
- ``tcp`` addr, port -> banner (ok when the server sent its banner)
- ``tcp6`` addr, port -> connect over IPv6
- ``udp`` addr, [port=7] -> echo
- ``icmp`` addr -> echo reply
- ``dns`` server, name, [qtype=A], [tcp=false] -> rcode, answers (a hand-built query)
- ``doh`` qname, [sni=doh.test], [addr] -> rcode, answers (RFC 8484 POST)
- ``ipv6`` -> global IPv6 addresses of the guest (from /proc/net/if_inet6)
- ``get`` addr, host, size -> bytes, seconds (``GET /bytes/size``: throughput)
- ``latency`` addr, host, count, [sni] -> samples (seconds per connect + GET, timed here)
- ``raw`` addr, [port=80], data (latin-1 text sent as is) -> statuses (every HTTP status
  code in the reply, in order), reply (its start); ok when any response came back
- ``hold`` label, addr, port, [sni] -> phases: one connection held open (a TCP line echo,
  or TLS with ``sni`` carrying keep-alive HTTP/1.1 GETs) doing one exchange every
  ``every`` s. Each exchange is tagged with the phase read from /root/hold-phase (the
  test writes 1, 2, ... and "stop") and appended to /root/hold-<label>.log as
  "<phase> ok|fail"; once an exchange fails the connection is not used again. A phase
  starting with "pause" stops the exchanges (logged once as "<phase> paused"), so the
  test can change something with no exchange in flight
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import ssl
import struct
import sys
import threading
import time
from typing import Any

CA = "/root/fakenet-ca.pem"
QTYPES = {"A": 1, "TXT": 16, "AAAA": 28}
RCODES = {0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED"}


def _resolve(name: str) -> list[str]:
    infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    return sorted({str(i[4][0]) for i in infos})


def _read_all(s: socket.socket) -> bytes:
    chunks: list[bytes] = []
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _http_exchange(s: socket.socket, host: str, path: str) -> dict[str, Any]:
    s.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}\r\nUser-Agent: probe\r\n\r\n".encode())
    reply = _read_all(s)
    if not reply:
        return {"ok": False, "error": "connection closed without a response"}
    head, _, body = reply.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    out: dict[str, Any] = {"ok": status == 200, "status": status}
    try:
        out["seen"] = json.loads(body)
    except ValueError:
        out["body"] = body[:200].decode(errors="replace")
    return out


def op_resolve(c: dict[str, Any]) -> dict[str, Any]:
    return {"ok": True, "addrs": _resolve(c["name"])}


def op_http(c: dict[str, Any]) -> dict[str, Any]:
    addr = c.get("addr") or _resolve(c["host"])[0]
    with socket.create_connection((addr, c.get("port", 80)), timeout=c["timeout"]) as s:
        return _http_exchange(s, c["host"], c.get("path", "/"))


def op_https(c: dict[str, Any]) -> dict[str, Any]:
    host = c.get("host") or c["sni"]
    addr = c.get("addr") or _resolve(c["sni"])[0]
    ctx = ssl.create_default_context(cafile=c.get("ca", CA))
    with (
        socket.create_connection((addr, c.get("port", 443)), timeout=c["timeout"]) as raw,
        ctx.wrap_socket(raw, server_hostname=c["sni"]) as s,
    ):
        return _http_exchange(s, host, c.get("path", "/"))


def op_tcp(c: dict[str, Any]) -> dict[str, Any]:
    with socket.create_connection((c["addr"], c["port"]), timeout=c["timeout"]) as s:
        banner = s.recv(200)
    return {"ok": bool(banner), "banner": banner.decode(errors="replace")}


def op_tcp6(c: dict[str, Any]) -> dict[str, Any]:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        s.settimeout(c["timeout"])
        s.connect((c["addr"], c["port"]))
    return {"ok": True}


def op_udp(c: dict[str, Any]) -> dict[str, Any]:
    token = os.urandom(8).hex().encode()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(c["timeout"])
        s.sendto(token, (c["addr"], c.get("port", 7)))
        data = s.recvfrom(100)[0]
    return {"ok": data == token}


def _checksum(data: bytes) -> int:
    padded = data + b"\0" * (len(data) % 2)
    total: int = sum(struct.unpack(f"!{len(padded) // 2}H", padded))
    total = (total >> 16) + (total & 0xFFFF)
    return ~(total + (total >> 16)) & 0xFFFF


def op_icmp(c: dict[str, Any]) -> dict[str, Any]:
    ident = random.randrange(1, 0xFFFF)
    payload = b"hutch-probe"
    csum = _checksum(struct.pack("!BBHHH", 8, 0, 0, ident, 1) + payload)
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as s:
        s.settimeout(c["timeout"])
        s.sendto(struct.pack("!BBHHH", 8, 0, csum, ident, 1) + payload, (c["addr"], 0))
        deadline = time.monotonic() + c["timeout"]
        while time.monotonic() < deadline:
            packet, (src, _) = s.recvfrom(1024)
            icmp = packet[(packet[0] & 0x0F) * 4 :]
            if src == c["addr"] and icmp[0] == 0 and struct.unpack("!H", icmp[4:6])[0] == ident:
                return {"ok": True}
    return {"ok": False, "error": "no echo reply"}


def _dns_query(name: str, qtype: str) -> tuple[int, bytes]:
    qid = random.randrange(0, 0xFFFF)
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.rstrip(".").split(".") if p)
    wire = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + labels + b"\0"
    return qid, wire + struct.pack("!HH", QTYPES[qtype], 1)


def _skip_name(data: bytes, pos: int) -> int:
    while True:
        length = data[pos]
        if length == 0:
            return pos + 1
        if length & 0xC0 == 0xC0:
            return pos + 2
        pos += 1 + length


def _dns_parse(data: bytes) -> dict[str, Any]:
    _, flags, qd, an, _, _ = struct.unpack("!HHHHHH", data[:12])
    pos = 12
    for _ in range(qd):
        pos = _skip_name(data, pos) + 4
    answers = []
    for _ in range(an):
        pos = _skip_name(data, pos)
        rtype, _, _, rdlen = struct.unpack("!HHIH", data[pos : pos + 10])
        rdata = data[pos + 10 : pos + 10 + rdlen]
        pos += 10 + rdlen
        if rtype == 1:
            answers.append(socket.inet_ntop(socket.AF_INET, rdata))
        elif rtype == 28:
            answers.append(socket.inet_ntop(socket.AF_INET6, rdata))
        elif rtype == 16:
            answers.append(rdata[1 : 1 + rdata[0]].decode(errors="replace"))
    rcode = RCODES.get(flags & 0xF, str(flags & 0xF))
    return {"ok": rcode == "NOERROR" and bool(answers), "rcode": rcode, "answers": answers}


def op_dns(c: dict[str, Any]) -> dict[str, Any]:
    qid, wire = _dns_query(c["name"], c.get("qtype", "A"))
    if c.get("tcp"):
        with socket.create_connection((c["server"], 53), timeout=c["timeout"]) as s:
            s.sendall(len(wire).to_bytes(2, "big") + wire)
            # The server keeps the connection open for more queries: read one message.
            buf = b""
            while len(buf) < 2 or len(buf) < 2 + int.from_bytes(buf[:2], "big"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                buf += chunk
            reply = buf[2:]
    else:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(c["timeout"])
            s.sendto(wire, (c["server"], 53))
            reply = s.recvfrom(4096)[0]
    if len(reply) < 12 or struct.unpack("!H", reply[:2])[0] != qid:
        return {"ok": False, "error": "no matching DNS reply"}
    return _dns_parse(reply)


def op_doh(c: dict[str, Any]) -> dict[str, Any]:
    sni = c.get("sni", "doh.test")
    addr = c.get("addr") or _resolve(sni)[0]
    _, wire = _dns_query(c["qname"], c.get("qtype", "A"))
    ctx = ssl.create_default_context(cafile=c.get("ca", CA))
    head = (
        f"POST /dns-query HTTP/1.0\r\nHost: {sni}\r\nContent-Type: application/dns-message\r\n"
        f"Accept: application/dns-message\r\nContent-Length: {len(wire)}\r\n\r\n"
    )
    with (
        socket.create_connection((addr, 443), timeout=c["timeout"]) as raw,
        ctx.wrap_socket(raw, server_hostname=sni) as s,
    ):
        s.sendall(head.encode() + wire)
        reply = _read_all(s)
    status_line, _, rest = reply.partition(b"\r\n")
    body = rest.partition(b"\r\n\r\n")[2]
    if b" 200 " not in status_line + b" ":
        return {"ok": False, "error": status_line.decode(errors="replace")}
    return _dns_parse(body)


def op_ipv6(c: dict[str, Any]) -> dict[str, Any]:
    found = []
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                hexaddr, _, _, scope = line.split()[:4]
                if scope == "00":  # global scope
                    found.append(socket.inet_ntop(socket.AF_INET6, bytes.fromhex(hexaddr)))
    except FileNotFoundError:
        pass
    return {"ok": True, "global": found}


def op_get(c: dict[str, Any]) -> dict[str, Any]:
    """GET /bytes/``size`` read to close (HTTP/1.0); over TLS when ``sni`` is given
    (trusting ``ca``), so HTTPS throughput can be timed too."""
    ctx = ssl.create_default_context(cafile=c.get("ca", CA)) if c.get("sni") else None
    port = c.get("port", 443 if ctx else 80)
    t0 = time.perf_counter()
    with socket.create_connection((c["addr"], port), timeout=c["timeout"]) as raw:
        s = ctx.wrap_socket(raw, server_hostname=c["sni"]) if ctx is not None else raw
        s.sendall(f"GET /bytes/{c['size']} HTTP/1.0\r\nHost: {c['host']}\r\n\r\n".encode())
        total = 0
        while True:
            try:
                chunk = s.recv(1 << 18)
            except ssl.SSLEOFError:  # a server that closes without close_notify
                break
            if not chunk:
                break
            total += len(chunk)
    return {"ok": total > c["size"], "bytes": total, "seconds": time.perf_counter() - t0}


def op_latency(c: dict[str, Any]) -> dict[str, Any]:
    """``count`` sequential (TCP connect [+ TLS with ``sni``] + GET / + read to close),
    each timed here, so the samples exclude the exec round trip that started the probe."""
    ctx = ssl.create_default_context(cafile=c.get("ca", CA)) if c.get("sni") else None
    port = c.get("port", 443 if ctx else 80)
    samples: list[float] = []
    for _ in range(c["count"]):
        t0 = time.perf_counter()
        with socket.create_connection((c["addr"], port), timeout=c["timeout"]) as raw:
            if ctx is not None:
                with ctx.wrap_socket(raw, server_hostname=c["sni"]) as s:
                    result = _http_exchange(s, c["host"], "/")
            else:
                result = _http_exchange(raw, c["host"], "/")
        if not result["ok"]:
            return {"ok": False, "error": f"request failed: {result}", "samples": samples}
        samples.append(time.perf_counter() - t0)
    return {"ok": True, "samples": samples}


_STATUS = re.compile(rb"HTTP/1\.[01] (\d{3}) ")
HOLD_DIR = "/root"


def op_raw(c: dict[str, Any]) -> dict[str, Any]:
    reply = b""
    timed_out = False
    with socket.create_connection((c["addr"], c.get("port", 80)), timeout=c["timeout"]) as s:
        s.sendall(c["data"].encode("latin-1"))
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except TimeoutError:
            timed_out = True  # a server holding the connection open: keep what came
        except ConnectionResetError:
            pass
    statuses = [int(m) for m in _STATUS.findall(reply)]
    return {
        "ok": bool(statuses),
        "statuses": statuses,
        "timed_out": timed_out,
        "reply": reply[:600].decode("latin-1"),
    }


def _hold_exchange(s: Any, c: dict[str, Any], n: int) -> bool:
    if c.get("sni"):
        s.sendall(f"GET /?n={n} HTTP/1.1\r\nHost: {c['sni']}\r\n\r\n".encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(4096)
            if not chunk:
                return False
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        match = re.search(rb"(?i)content-length: *(\d+)", head)
        want = int(match.group(1)) if match else 0
        while len(body) < want:
            chunk = s.recv(4096)
            if not chunk:
                return False
            body += chunk
        return head.startswith(b"HTTP/1.1 200")
    line = f"tick {n}\n".encode()
    s.sendall(line)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(100)
        if not chunk:
            return False
        buf += chunk
    return buf == line


def op_hold(c: dict[str, Any]) -> dict[str, Any]:
    phase_file = os.path.join(HOLD_DIR, "hold-phase")
    log_path = os.path.join(HOLD_DIR, f"hold-{c['label']}.log")
    raw = socket.create_connection((c["addr"], c["port"]), timeout=c["timeout"])
    s: Any = raw
    if c.get("sni"):
        ctx = ssl.create_default_context(cafile=c.get("ca", CA))
        s = ctx.wrap_socket(raw, server_hostname=c["sni"])
    phases: dict[str, list[bool]] = {}
    alive, n = True, 0
    deadline = time.monotonic() + c.get("max_s", 300)
    with s, open(log_path, "a", buffering=1) as log:
        while time.monotonic() < deadline:
            with open(phase_file) as f:
                phase = f.read().strip()
            if phase == "stop":
                break
            if phase.startswith("pause"):
                if phase not in phases:
                    phases[phase] = []
                    log.write(f"{phase} paused\n")
                time.sleep(0.05)
                continue
            ok = False
            if alive:
                try:
                    ok = _hold_exchange(s, c, n)
                except OSError:
                    ok = False
                alive = ok
            phases.setdefault(phase, []).append(ok)
            log.write(f"{phase} {'ok' if ok else 'fail'}\n")
            n += 1
            time.sleep(c.get("every", 0.2))
    return {"ok": True, "phases": phases}


OPS = {name[3:]: fn for name, fn in globals().items() if name.startswith("op_")}


def run_check(check: dict[str, Any]) -> dict[str, Any]:
    check = {"timeout": 4.0, **check}
    t0 = time.monotonic()
    result: dict[str, Any]
    try:
        result = OPS[check["op"]](check)
    except OSError as exc:  # refused, reset, timed out, unresolvable, TLS: a network "no"
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    except Exception as exc:  # anything else is a bug in the check, never a "no"
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "probe_bug": True}
    result["elapsed"] = round(time.monotonic() - t0, 3)
    return result


def run_checks(checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = [{} for _ in checks]

    def one(i: int) -> None:
        results[i] = run_check(checks[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(checks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


if __name__ == "__main__":
    print(json.dumps(run_checks(json.loads(sys.argv[1]))))
