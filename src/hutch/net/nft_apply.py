"""Run nft scripts from :mod:`hutch.net.nft` and read the table back.

``apply`` runs one script as ``nft -f -`` does: nft commits it as one transaction, so a
failing script changes nothing. In the host's namespace it goes through the daemon's
libnftables context (:mod:`hutch.net.nft_lib`: no process per script, which cost 15-24
ms each); ``netns`` runs the ``nft`` program inside that network namespace (the
privileged tests use scratch namespaces; production passes None), as does a host
without the library.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from hutch.errors import NetworkError
from hutch.net import nft_lib
from hutch.net.links import run_command
from hutch.net.nft_common import table_name

__all__ = [
    "SandboxCounters",
    "apply",
    "delete_table",
    "list_table",
    "read_counters",
    "table_exists",
]

_COUNTER_RE = re.compile(r"^c_([0-9a-f]{12})_(allow|deny|nolog|limit|tx)$")
_LOCATION_RE = re.compile(r"^/dev/stdin:(\d+):")


@dataclass(frozen=True)
class SandboxCounters:
    allowed: int  # connections the policy accepted (re-checked after a rule change: again)
    denied: int  # packets dropped (any reason)
    unlogged: int = 0  # of the denied, those past the sandbox's log budget (no NFLOG entry)
    rate_limited: int = 0  # DNS packets / new resolver+proxy connections past the ceiling
    denied_bytes: int = 0  # bytes of the denied packets
    sent_bytes: int = 0  # bytes forwarded from the tap out of the host (accepted egress)


def _failing_lines(script: str, stderr: str) -> str:
    """The script lines nft complains about (its stderr names them as /dev/stdin:N:)."""
    lines = script.splitlines()
    shown: list[str] = []
    for err_line in stderr.splitlines():
        match = _LOCATION_RE.match(err_line)
        if match:
            number = int(match.group(1))
            if 0 < number <= len(lines):
                shown.append(f"line {number}: {lines[number - 1].strip()}")
    return "\n".join(dict.fromkeys(shown))


async def apply(script: str, netns: str | None = None) -> None:
    """Apply ``script`` atomically, as ``nft -f -`` does.

    Raises ``NetworkError`` with nft's errors and the failing script line(s); nothing of
    the script is applied then.
    """
    ran = await nft_lib.run(script) if netns is None else None
    if ran is not None:
        code, err = ran
    else:
        code, _, err = await run_command(["nft", "-f", "-"], netns=netns, stdin=script.encode())
    if code != 0:
        where = _failing_lines(script, err)
        raise NetworkError(
            "nftables refused hutch's ruleset (nothing was changed): "
            + err.strip()
            + (f"\nfailing script {where}" if where else "")
        )


async def _nft_json(args: list[str], netns: str | None) -> list[dict[str, Any]]:
    """``nft -j ARGS``: through the daemon's libnftables context on the host, the
    ``nft`` program in a netns or where the library is missing."""
    ran = await nft_lib.list_json(" ".join(args)) if netns is None else None
    if ran is not None:
        code, out, err = ran
    else:
        code, out, err = await run_command(["nft", "-j", *args], netns=netns)
    if code != 0:
        raise NetworkError(f"`nft -j {' '.join(args)}` failed: {err.strip()}")
    try:
        doc = json.loads(out)
    except json.JSONDecodeError as exc:
        raise NetworkError(f"`nft -j {' '.join(args)}` printed invalid JSON: {exc}") from exc
    items: list[dict[str, Any]] = doc.get("nftables", [])
    return items


async def table_exists(tag: str, netns: str | None = None) -> bool:
    code, _, _ = await run_command(["nft", "list", "table", "inet", table_name(tag)], netns=netns)
    return code == 0


async def list_table(tag: str, netns: str | None = None) -> list[dict[str, Any]]:
    """``nft -j list table inet hutch_<tag>``: the objects (metainfo left out)."""
    items = await _nft_json(["list", "table", "inet", table_name(tag)], netns)
    return [item for item in items if "metainfo" not in item]


async def read_counters(tag: str, netns: str | None = None) -> dict[str, SandboxCounters]:
    """Per-sandbox counters, keyed by sandbox id (``sb-<12 hex>``)."""
    items = await _nft_json(["list", "counters", "table", "inet", table_name(tag)], netns)
    found: dict[str, dict[str, int]] = {}
    for item in items:
        counter = item.get("counter")
        if not counter:
            continue
        match = _COUNTER_RE.match(counter.get("name", ""))
        if match:
            values = found.setdefault("sb-" + match.group(1), {})
            values[match.group(2)] = int(counter.get("packets", 0))
            values[match.group(2) + "_bytes"] = int(counter.get("bytes", 0))
    return {
        sid: SandboxCounters(
            allowed=v.get("allow", 0),
            denied=v.get("deny", 0),
            unlogged=v.get("nolog", 0),
            rate_limited=v.get("limit", 0),
            denied_bytes=v.get("deny_bytes", 0),
            sent_bytes=v.get("tx_bytes", 0),
        )
        for sid, v in found.items()
    }


async def delete_table(tag: str, netns: str | None = None) -> None:
    """Delete the daemon's table; a missing table is fine (idempotent)."""
    name = table_name(tag)
    await apply(f"add table inet {name}\ndelete table inet {name}\n", netns=netns)
