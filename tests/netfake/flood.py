"""A flood run *inside* a sandbox (stdlib only, like probe.py), for the noisy-neighbour
tests and the ``dns_flood`` benchmark:

    python3 flood.py dns  <server> <seconds> [name-suffix]   # A queries, one socket
    python3 flood.py udp  <addr>   <seconds> [port]          # datagrams to addr:port
    python3 flood.py burn <addr>   <seconds>                 # the same loop, nothing sent

Sends as fast as the guest can from one non-blocking socket (one new name per DNS query:
``f<n>.<suffix>``, default ``flood.test``), reads what comes back as it goes and for one
second after, then prints one JSON line: ``sent``, ``seconds`` (of sending), ``replies``
and, for DNS, ``rcodes`` (rcode name -> count of answers). ``burn`` builds the packets
but sends none: the guest's CPU use of a flood without the network (a benchmark's
control). SIGTERM ends the sending early; the JSON line is still printed.
"""

from __future__ import annotations

import json
import signal
import socket
import struct
import sys
import time

RCODES = {0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED"}


def _query(n: int, suffix: str) -> bytes:
    labels = [f"f{n}", *suffix.split(".")]
    qname = b"".join(bytes([len(p)]) + p.encode() for p in labels) + b"\0"
    return struct.pack("!HHHHHH", n & 0xFFFF, 0x0100, 1, 0, 0, 0) + qname + b"\0\x01\0\x01"


def main(argv: list[str]) -> dict[str, object]:
    kind, target, seconds = argv[0], argv[1], float(argv[2])
    extra = argv[3] if len(argv) > 3 else None
    port = 53 if kind == "dns" else int(extra or 9)
    suffix = extra or "flood.test"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 21)
    s.setblocking(False)
    rcodes: dict[str, int] = {}
    replies = 0

    def drain() -> None:
        nonlocal replies
        while True:
            try:
                data = s.recv(4096)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. ICMP unreachable reported on the socket
                continue
            replies += 1
            if kind == "dns" and len(data) >= 4:
                name = RCODES.get(data[3] & 0x0F, str(data[3] & 0x0F))
                rcodes[name] = rcodes.get(name, 0) + 1

    stop = False

    def on_term(_signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    sent = 0
    payload = b"flood"
    started = time.monotonic()
    end = started + seconds
    while time.monotonic() < end and not stop:
        for _ in range(64):
            wire = _query(sent, suffix) if kind != "udp" else payload
            if kind == "burn":
                sent += 1
                continue
            try:
                s.sendto(wire, (target, port))
                sent += 1
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                pass
        drain()
    sending = time.monotonic() - started
    settle = time.monotonic() + 1.0
    while time.monotonic() < settle:
        drain()
        time.sleep(0.02)
    return {"sent": sent, "seconds": round(sending, 3), "replies": replies, "rcodes": rcodes}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
