"""Probes of private networks across the workers of the test cluster: what a guest
resolves and reaches (``probe``), and the host side's tunnel devices and rules."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from hutch.sdk import Client
from tests.e2e.cluster_lab import Worker

#: Seconds for a member on one worker to be known on another (a poll is 1 s).
LEARN_S = 15.0
HTTP_PORT = 8000
#: Run in a guest with targets as arguments: each target's address (by the private
#: resolver) and the body of http://TARGET:8000/marker, or why not (all at once).
PROBE = """
import concurrent.futures as f, json, socket, sys, urllib.request as u
def one(t):
    try:
        ip = socket.gethostbyname(t)
    except OSError as e:
        return t, {"ip": "", "body": "ERR resolve %s" % e}
    try:
        body = u.urlopen("http://%s:8000/marker" % t, timeout=3).read().decode().strip()
    except Exception as e:
        body = "ERR %s" % type(e).__name__
    return t, {"ip": ip, "body": body}
with f.ThreadPoolExecutor(8) as pool:
    print(json.dumps(dict(pool.map(one, sys.argv[1:]))))
"""
#: Run in a guest: its network devices, and a VXLAN frame (carrying a packet to
#: argv[1]) sent to every tunnel port in argv[2:] on its gateway (the host side).
INJECT = """
import socket, struct, sys, os
gw = next(socket.inet_ntoa(struct.pack("<L", int(f[2], 16)))
          for f in (l.split() for l in open("/proc/net/route").readlines()[1:])
          if f[1] == "00000000")
ip = bytes([0x45, 0, 0, 20, 0, 0, 0, 0, 64, 17, 0, 0])
inner = (b"\\x02" * 12 + b"\\x08\\x00" + ip
         + socket.inet_aton("10.0.0.1") + socket.inet_aton(sys.argv[1]))
frame = bytes([8, 0, 0, 0]) + (4213).to_bytes(3, "big") + b"\\0" + inner
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for port in sys.argv[2:]:
    for _ in range(5):
        s.sendto(frame, (gw, int(port)))
print(" ".join(sorted(os.listdir("/sys/class/net"))))
"""


def probe(c: Client, sandbox_id: str, *targets: str) -> dict[str, dict[str, str]]:
    done = c.exec(sandbox_id, ["python3", "-c", PROBE, *targets], timeout_s=60)
    assert done.exit_code == 0, done.stdout + done.stderr
    found: dict[str, dict[str, str]] = json.loads(done.stdout)
    return found


def device(name: str) -> dict[str, Any] | None:
    shown = subprocess.run(
        ["ip", "-j", "-s", "-d", "link", "show", "dev", name], capture_output=True, text=True
    )
    if shown.returncode != 0:
        return None
    found: dict[str, Any] = json.loads(shown.stdout)[0]
    return found


def packets(name: str) -> tuple[int, int]:
    """(received, sent) by the device."""
    dev = device(name)
    assert dev is not None, f"no device {name}"
    return int(dev["stats64"]["rx"]["packets"]), int(dev["stats64"]["tx"]["packets"])


def ip_rules_of(w: Worker) -> int:
    rules = subprocess.run(["ip", "rule", "show"], capture_output=True, text=True).stdout
    return sum(1 for line in rules.splitlines() if f"lookup {w.route_table}" in line)


def tunnel_routes(w: Worker) -> list[str]:
    """The words of ``w``'s overlay routing table (empty: no route)."""
    shown = subprocess.run(
        ["ip", "route", "show", "table", w.route_table], capture_output=True, text=True
    )
    return shown.stdout.split()
