"""A scratch network lab for the dataplane tests: network namespaces joined by veth pairs.

    guest netns (one per sandbox)   host netns (hutch's table)          internet netns
    eth0 10.213.0.<4i+2>/30 ═veth═ h<tag><sid10> 10.213.0.<4i+1>
                                   up0 198.18.0.1/24, fd01::1 ═veth═ eth0 198.18.0.2, fd01::2
                                                                     lo: 198.18.1.1, 198.18.2.1,
                                                                     198.18.3.1, 169.254.169.254

A veth end named like a sandbox tap stands in for the tap QEMU would open: nftables
sees the same interface name either way. Nothing here touches the real host's network
namespace; every namespace and process is removed in a finalizer, even on failure.
Servers answer one line saying who they are, which address the client reached, the
client's address as seen, and (for redirected connections) SO_ORIGINAL_DST.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

SERVER = r"""
import socket, struct, sys, threading
label = sys.argv[1]
IP_PKTINFO = 8  # linux/in.h; the socket module lacks the name

def tcp(family, port):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
    s.listen(128)
    def loop():
        while True:
            c, peer = s.accept()
            try:
                orig = "-"
                if family == socket.AF_INET:
                    try:
                        raw = c.getsockopt(socket.SOL_IP, 80, 16)  # SO_ORIGINAL_DST
                        oport, oip = struct.unpack("!2xH4s8x", raw)
                        orig = f"{socket.inet_ntoa(oip)}:{oport}"
                    except OSError:
                        pass
                local = c.getsockname()[0]
                c.sendall(f"{label} tcp {local}:{port} from {peer[0]} orig {orig}\n".encode())
            finally:
                c.close()
    threading.Thread(target=loop, daemon=True).start()

def udp(port):
    # Bound to 0.0.0.0, a reply would leave from the route's primary address and miss
    # the client's conntrack entry; IP_PKTINFO answers from the address asked.
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_IP, IP_PKTINFO, 1)
    s.bind(("0.0.0.0", port))
    def loop():
        while True:
            data, anc, _flags, peer = s.recvmsg(2048, 256)
            local = b"\0" * 4
            for level, kind, value in anc:
                if level == socket.SOL_IP and kind == IP_PKTINFO:
                    local = struct.unpack("=I4s4s", value[:12])[2]
            reply = f"{label} udp {socket.inet_ntoa(local)}:{port} from {peer[0]}\n".encode()
            info = struct.pack("=I4s4s", 0, local, b"\0" * 4)
            s.sendmsg([reply], [(socket.SOL_IP, IP_PKTINFO, info)], 0, peer)
    threading.Thread(target=loop, daemon=True).start()

def echo(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(16)
    def serve(c):
        with c, c.makefile("rwb", buffering=0) as f:
            for line in f:
                f.write(line)
    def loop():
        while True:
            c, _ = s.accept()
            threading.Thread(target=serve, args=(c,), daemon=True).start()
    threading.Thread(target=loop, daemon=True).start()

for spec in sys.argv[2:]:
    proto, port = spec.split(":")
    if proto == "echo":
        echo(int(port))
    elif proto == "tcp":
        tcp(socket.AF_INET, int(port))
        try:
            tcp(socket.AF_INET6, int(port))
        except OSError:
            pass
    else:
        udp(int(port))
print("ready", flush=True)
threading.Event().wait()
"""

PROBE = r"""
import concurrent.futures, errno, json, socket, sys
probes = json.loads(sys.argv[1])
timeout = float(sys.argv[2])

def one(p):
    family = socket.AF_INET6 if ":" in p["host"] else socket.AF_INET
    kind = socket.SOCK_STREAM if p["proto"] == "tcp" else socket.SOCK_DGRAM
    s = socket.socket(family, kind)
    s.settimeout(timeout)
    try:
        if p.get("src"):
            s.bind((p["src"], 0))
        if p["proto"] == "tcp":
            s.connect((p["host"], p["port"]))
            data = s.recv(4096)
        else:
            s.sendto(b"probe", (p["host"], p["port"]))
            data, _ = s.recvfrom(4096)
        return data.decode().strip() or "FAIL:empty"
    except socket.timeout:
        return "FAIL:timeout"
    except OSError as exc:
        return "FAIL:" + errno.errorcode.get(exc.errno or 0, str(exc))
    finally:
        s.close()

with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(probes))) as pool:
    print(json.dumps(list(pool.map(one, probes))))
"""

# A client that holds one TCP connection open: each line on stdin is sent, the echo printed.
HOLDER = r"""
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
f = s.makefile("rwb", buffering=0)
print("connected", flush=True)
for line in sys.stdin:
    try:
        f.write(line.encode())
        print(f.readline().decode().strip() or "closed", flush=True)
    except OSError as exc:
        print("FAIL:" + type(exc).__name__, flush=True)
"""

INTERNET_TCP = (80, 443, 25, 2222, 8080)
ECHO_PORT = 7777
INTERNET_UDP = (53, 443, 9999)
HOST_PORTS = {"dns": 5353, "proxy": 8443, "api": 7070}


def require_tools() -> None:
    """Skip (loudly: the reason names what is missing) without root, nft or ip."""
    missing = [tool for tool in ("nft", "ip", "sysctl") if shutil.which(tool) is None]
    if os.geteuid() != 0:
        pytest.skip("PRIVILEGED TESTS SKIPPED: they need root (netns, nftables, taps)")
    if missing:
        pytest.skip(f"PRIVILEGED TESTS SKIPPED: missing tools {missing} (apt: nftables iproute2)")


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr}")
    return result


@dataclass
class Guest:
    name: str
    netns: str
    sandbox_id: str
    tap: str
    gateway: IPv4Address
    address: IPv4Address


@dataclass
class Lab:
    prefix: str
    tag: str
    host: str = ""
    internet: str = ""
    namespaces: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    guests: dict[str, Guest] = field(default_factory=dict)

    # -- building ---------------------------------------------------------------
    def netns(self, suffix: str) -> str:
        name = f"{self.prefix}{suffix}"
        sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def build(self) -> None:
        self.host = self.netns("h")
        self.internet = self.netns("i")
        h, i = self.host, self.internet
        sh("ip", "-n", h, "link", "add", "up0", "type", "veth", "peer", "name", "eth0", "netns", i)
        sh("ip", "-n", h, "addr", "add", "198.18.0.1/24", "dev", "up0")
        sh("ip", "-n", h, "addr", "add", "fd01::1/64", "dev", "up0", "nodad")
        sh("ip", "-n", h, "link", "set", "up0", "up")
        sh("ip", "-n", i, "addr", "add", "198.18.0.2/24", "dev", "eth0")
        sh("ip", "-n", i, "addr", "add", "fd01::2/64", "dev", "eth0", "nodad")
        sh("ip", "-n", i, "link", "set", "eth0", "up")
        for addr in ("198.18.1.1", "198.18.2.1", "198.18.3.1", "169.254.169.254"):
            sh("ip", "-n", i, "addr", "add", f"{addr}/32", "dev", "lo")
        sh("ip", "-n", i, "route", "add", "fd00::/64", "via", "fd01::1")
        # Only for the control test (no table, so no masquerade): replies find the guests.
        sh("ip", "-n", i, "route", "add", "10.213.0.0/16", "via", "198.18.0.1")
        sh("ip", "-n", h, "route", "add", "default", "via", "198.18.0.2")
        sh("ip", "netns", "exec", h, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        sh("ip", "netns", "exec", h, "sysctl", "-q", "-w", "net.ipv6.conf.all.forwarding=1")
        specs = [f"tcp:{p}" for p in INTERNET_TCP] + [f"udp:{p}" for p in INTERNET_UDP]
        specs.append(f"echo:{ECHO_PORT}")
        self.serve(i, "internet", specs)
        host_specs = [f"tcp:{p}" for p in HOST_PORTS.values()] + [f"udp:{HOST_PORTS['dns']}"]
        self.serve(h, "host", host_specs)

    def add_guest(self, name: str, index: int, *, register_name: bool = True) -> Guest:
        """A guest netns behind a veth named like a tap; block ``index`` of 10.213/16."""
        from hutch.net.addressing import AddressPool, tap_name, tap_prefix

        block = AddressPool("10.213.0.0/16").block(index)
        sid = f"sb-{secrets.token_hex(6)}"
        tap = tap_name(self.tag, sid) if register_name else tap_prefix(self.tag) + "f" * 10
        ns = self.netns(f"g{name}")
        sh(
            "ip",
            "-n",
            self.host,
            "link",
            "add",
            tap,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            ns,
        )
        sh("ip", "-n", self.host, "addr", "add", f"{block.gateway}/30", "dev", tap)
        sh("ip", "-n", self.host, "addr", "add", f"fd00::{index}:1/112", "dev", tap, "nodad")
        sh("ip", "-n", self.host, "link", "set", tap, "up")
        sh("ip", "-n", ns, "addr", "add", f"{block.guest}/30", "dev", "eth0")
        sh("ip", "-n", ns, "addr", "add", f"fd00::{index}:2/112", "dev", "eth0", "nodad")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "route", "add", "default", "via", str(block.gateway))
        sh("ip", "-n", ns, "-6", "route", "add", "default", "via", f"fd00::{index}:1")
        guest = Guest(name, ns, sid, tap, block.gateway, block.guest)
        self.guests[name] = guest
        return guest

    def serve(self, ns: str, label: str, specs: Sequence[str]) -> None:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", SERVER, label, *specs],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"server {label} in {ns} did not start: {proc.stderr.read()}")

    # -- probing ----------------------------------------------------------------
    def probe(
        self,
        ns: str,
        probes: Sequence[dict[str, Any]],
        timeout: float = 1.5,
        user: str | None = None,
    ) -> list[str]:
        """Run the probes concurrently from ``ns`` (as ``user`` if given); each result is
        the server's line or ``FAIL:<reason>``."""
        as_user = (
            ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "/usr/bin/python3"]
            if user
            else [sys.executable]
        )
        out = sh(
            "ip",
            "netns",
            "exec",
            ns,
            *as_user,
            "-c",
            PROBE,
            json.dumps(list(probes)),
            str(timeout),
        )
        results: list[str] = json.loads(out.stdout)
        return results

    def hold(self, ns: str, host: str, port: int) -> subprocess.Popen[str]:
        """A client in ``ns`` holding one TCP connection open (see HOLDER); the caller
        kills it."""
        return subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", HOLDER, host, str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def tcp(self, guest: str | Guest, host: str, port: int, src: str | None = None) -> str:
        ns = guest.netns if isinstance(guest, Guest) else guest
        return self.probe(ns, [{"proto": "tcp", "host": host, "port": port, "src": src}])[0]

    # -- teardown ---------------------------------------------------------------
    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(timeout=10)
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        self.procs.clear()
        for ns in reversed(self.namespaces):
            # Deleting a netns deletes its veth ends (and their peers) and nft tables.
            sh("ip", "netns", "del", ns, check=False)
        self.namespaces.clear()


@contextlib.contextmanager
def built_lab() -> Iterator[Lab]:
    """A lab built, and removed after (even on failure)."""
    require_tools()
    tag = secrets.token_hex(2)
    lab = Lab(prefix=f"hx{secrets.token_hex(2)}", tag=tag)
    try:
        lab.build()
        yield lab
    finally:
        lab.close()


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with built_lab() as lab:
        yield lab
