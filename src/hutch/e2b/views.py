"""hutch records as E2B's control-plane models (``Sandbox``, ``ListedSandbox``,
``SandboxDetail``, ``SnapshotInfo``), field names as E2B spells them."""

from __future__ import annotations

import datetime as dt
from typing import Any

from hutch.contract.limits import TIMEOUT_S_RANGE
from hutch.e2b.keys import TokenIssuer
from hutch.models import PauseMode, SandboxRecord, SandboxState, SnapshotRecord

__all__ = [
    "CLIENT_ID",
    "DOMAIN",
    "e2b_state",
    "listed_sandbox",
    "sandbox_created",
    "sandbox_detail",
    "snapshot_info",
]

#: E2B's ``clientID`` (the node a sandbox runs on): this daemon.
CLIENT_ID = "hutch"
#: What ``Sandbox.get_host(port)`` builds URLs on. A name under ``.invalid`` (RFC 2606)
#: never resolves, so such a URL fails at once instead of reaching E2B's cloud; hutch
#: reaches sandbox ports with ``hutch port expose`` instead.
DOMAIN = "hutch.invalid"


def _iso(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.UTC).isoformat().replace("+00:00", "Z")


def e2b_state(rec: SandboxRecord) -> str | None:
    """E2B knows ``running`` and ``paused``; a sandbox on its way between them is shown
    as where it is going; an ended one does not exist for E2B (None)."""
    if rec.state in (SandboxState.CREATING, SandboxState.RUNNING, SandboxState.RESUMING):
        return "running"
    if rec.state in (SandboxState.PAUSING, SandboxState.PAUSED):
        return "paused"
    return None


def _end_at(rec: SandboxRecord) -> float:
    """When the sandbox ends: its deadline; with none (idle auto-pause only, or no
    timeout at all) the longest timeout hutch accepts from its start."""
    if rec.expires_at is not None:
        return rec.expires_at
    return (rec.started_at or rec.created_at) + TIMEOUT_S_RANGE[1]


def sandbox_created(rec: SandboxRecord, tokens: TokenIssuer, envd_version: str) -> dict[str, Any]:
    return {
        "templateID": rec.image,
        "alias": rec.image,
        "sandboxID": rec.id,
        "clientID": CLIENT_ID,
        "envdVersion": envd_version,
        "envdAccessToken": tokens.envd_token(rec.id),
        "trafficAccessToken": tokens.traffic_token(rec.id),
        "domain": DOMAIN,
    }


def listed_sandbox(rec: SandboxRecord, envd_version: str) -> dict[str, Any]:
    return {
        "templateID": rec.image,
        "alias": rec.image,
        "sandboxID": rec.id,
        "clientID": CLIENT_ID,
        "startedAt": _iso(rec.started_at or rec.created_at),
        "endAt": _iso(_end_at(rec)),
        "cpuCount": rec.shape.vcpus,
        "memoryMB": rec.shape.memory_mib,
        "diskSizeMB": rec.shape.disk_gib * 1024,
        "metadata": dict(rec.metadata),
        "state": e2b_state(rec) or "running",
        "envdVersion": envd_version,
        "volumeMounts": [],
    }


def sandbox_detail(
    rec: SandboxRecord, tokens: TokenIssuer, envd_version: str, rules: list[str] | None
) -> dict[str, Any]:
    """``rules``: the sandbox's egress rules (None: no network at all)."""
    out = listed_sandbox(rec, envd_version)
    out.update(
        envdAccessToken=tokens.envd_token(rec.id),
        domain=DOMAIN,
        lifecycle={
            "onTimeout": "pause" if rec.auto_pause_s else "kill",
            "autoResume": rec.auto_resume,
        },
    )
    if rules is None or rules == ["deny-all"]:
        out["network"] = {"denyOut": ["0.0.0.0/0"]}
    elif rules:
        out["network"] = {"allowOut": list(rules), "denyOut": ["0.0.0.0/0"]}
    if rec.state is SandboxState.PAUSED:
        out["pauseMode"] = "filesystem" if rec.pause_mode is PauseMode.DISK else "full"
    return out


def snapshot_info(snap: SnapshotRecord) -> dict[str, Any]:
    return {"snapshotID": snap.id, "names": [snap.name]}
