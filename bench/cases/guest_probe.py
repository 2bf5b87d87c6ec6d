"""The fake internet's probe (``tests/netfake/probe.py``) run inside a benchmark's sandbox:
the network cases time their requests where the client runs, in the guest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hutch import Sandbox

__all__ = ["install_probe", "run_probe"]

PROBE = Path(__file__).resolve().parents[2] / "tests" / "netfake" / "probe.py"
#: Where the probe lives in the guest.
GUEST_PROBE = "/root/probe.py"


def install_probe(sb: Sandbox) -> None:
    sb.files.write(GUEST_PROBE, PROBE.read_bytes())


def run_probe(sb: Sandbox, checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The probe's results for ``checks``; raises naming the sandbox and its egress rules
    when the probe fails or any check is not ok."""
    answer = sb.exec(["python3", GUEST_PROBE, json.dumps(checks)], timeout_s=600)
    if answer.exit_code != 0:
        raise RuntimeError(f"probe failed in {sb.id}: {answer.stderr[-2000:]}")
    results: list[dict[str, Any]] = json.loads(answer.stdout)
    bad = [r for r in results if not r.get("ok")]
    if bad:
        raise RuntimeError(f"probe in {sb.id} (egress {sb.egress.get().rules}): {bad}")
    return results
