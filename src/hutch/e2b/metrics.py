"""``GET /sandboxes/{id}/metrics``: one sample measured inside the guest (CPU over half a
second from /proc/stat, memory from /proc/meminfo, the root filesystem from df), as
E2B's ``SandboxMetric``. It runs one short command in the sandbox (a shell, head, grep
and df: every built-in image has them)."""

from __future__ import annotations

import time
from typing import Any

from hutch.e2b.errors import E2bError
from hutch.models import SandboxRecord
from hutch.services.guest_ops import GuestOps

__all__ = ["parse_sample", "sample"]

SCRIPT = (
    "head -n1 /proc/stat; sleep 0.5; head -n1 /proc/stat; "
    "grep -E '^(MemTotal|MemAvailable|Cached):' /proc/meminfo; df -kP / | tail -n1"
)


def _cpu(line: str) -> tuple[int, int]:
    """(busy, total) jiffies of the ``cpu`` line of /proc/stat."""
    values = [int(v) for v in line.split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


def parse_sample(text: str, vcpus: int, now: float) -> dict[str, Any]:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    try:
        (busy1, total1), (busy2, total2) = _cpu(lines[0]), _cpu(lines[1])
        mem = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in lines[2:5]}
        df = lines[5].split()
        disk_total, disk_used = int(df[1]) * 1024, int(df[2]) * 1024
    except (IndexError, ValueError, KeyError) as exc:
        raise E2bError(409, f"could not read metrics in the guest (output {text[:200]!r})") from exc
    spent = total2 - total1
    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "timestampUnix": int(now),
        "cpuCount": vcpus,
        "cpuUsedPct": round(100.0 * (busy2 - busy1) / spent, 2) if spent > 0 else 0.0,
        "memTotal": mem["MemTotal"],
        "memUsed": mem["MemTotal"] - mem["MemAvailable"],
        "memCache": mem.get("Cached", 0),
        "diskTotal": disk_total,
        "diskUsed": disk_used,
    }


async def sample(svc: GuestOps, rec: SandboxRecord) -> dict[str, Any]:
    out = bytearray()
    async with await svc.exec(rec.id, ["/bin/sh", "-c", SCRIPT], timeout_s=10) as stream:
        async for chunk in stream:
            if chunk.stream == "stdout":
                out += chunk.data
        await stream.wait()
    return parse_sample(out.decode(errors="replace"), rec.shape.vcpus, time.time())
