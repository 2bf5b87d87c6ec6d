"""``net``: connection setup latency and download throughput from a sandbox to a fake
internet (``tests.netfake``), through the enforcement path vs the unfiltered path vs the
host itself, all in one run.

- **rules** (enforcement): the sandbox has egress ``["good.test"]``, so its port-80
  connections go through hutch's Host/SNI proxy, which checks the name, resolves it
  itself and connects.
- **open** (unfiltered): the same sandbox with no rules: plain forwarding and NAT.
- **host**: the same requests from the host straight to the fake internet (no VM).

The guest times its own requests (``tests/netfake/probe.py`` ``latency``/``get`` ops),
so the exec round trip that starts each batch is not in the samples. Rounds interleave
the three paths (rules are switched live on the one sandbox) so drifting load hits all
alike. Needs root (the fake internet is a network namespace); runs on a side daemon
``net`` with its own address pool and ``HUTCH_DNS_UPSTREAM`` at the fake DNS server.

The side daemon runs without templates or a pool (``QUIET_ENV``): with templates on, its
first create starts a template build in the background, a second TCG guest booting and
being frozen by the daemon (sha256 of its files in the daemon's API loop) while the
rounds are timed. That costs the open path little (the kernel forwards its packets) and
the rules path a lot (every connection needs the proxy's thread scheduled, and it shares
the two cores and the interpreter lock with that build): it measured the build, not
the proxy.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from tests.netfake import FakeInternet, free_net_pool
from tests.netfake.probe import run_checks

from bench.cases.common import SANDBOX_MEMORY_MIB, SANDBOX_VCPUS, BenchContext
from bench.model import BenchResult, Metric, SampleSet
from hutch import Sandbox
from hutch.config import Settings

__all__ = ["run_net"]

PROBE = Path(__file__).resolve().parents[2] / "tests" / "netfake" / "probe.py"
MB = 1e6
#: No background template build or pool refill competing with the timed rounds.
QUIET_ENV = {"HUTCH_TEMPLATES": "0", "HUTCH_POOL_SIZE": "0"}


def _guest(sb: Sandbox, checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    answer = sb.exec(["python3", "/root/probe.py", json.dumps(checks)], timeout_s=600)
    if answer.exit_code != 0:
        raise RuntimeError(f"probe failed in {sb.id}: {answer.stderr[-2000:]}")
    results: list[dict[str, Any]] = json.loads(answer.stdout)
    bad = [r for r in results if not r.get("ok")]
    if bad:
        raise RuntimeError(f"probe in {sb.id} (egress {sb.egress.get().rules}): {bad}")
    return results


def _host(checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = run_checks(checks)
    bad = [r for r in results if not r.get("ok")]
    if bad:
        raise RuntimeError(f"host probe failed: {bad}")
    return results


def run_net(ctx: BenchContext) -> BenchResult:
    if os.geteuid() != 0:
        raise RuntimeError("the net benchmark needs root (it builds a network namespace)")
    rounds, per_round, size = (2, 10, 8 << 20) if ctx.quick else (3, 30, 32 << 20)
    params = {
        "rounds": rounds,
        "requests_per_round": per_round,
        "download_bytes": size,
        "rules": ["good.test"],
        "request": "TCP connect + GET / (HTTP/1.0, ~200 byte JSON answer) + read to close",
        "image": ctx.image,
        "vcpus": SANDBOX_VCPUS,
        "memory_mib": SANDBOX_MEMORY_MIB,
        "side_daemon_env": QUIET_ENV,
    }
    result = BenchResult("net", "egress: enforcement path vs open NAT vs host", ctx.quick, params)
    lat: dict[str, list[float]] = {"rules": [], "open": [], "host": []}
    rate: dict[str, list[float]] = {"rules": [], "open": [], "host": []}
    with FakeInternet() as net:
        side = ctx.side_daemon("net", {"HUTCH_NET_POOL": free_net_pool(), **net.env(), **QUIET_ENV})
        try:
            sb = Sandbox.create(
                ctx.image, vcpus=SANDBOX_VCPUS, memory_mib=SANDBOX_MEMORY_MIB, client=side.client
            )
            with sb:
                sb.files.write("/root/probe.py", PROBE.read_bytes())
                sb.files.write("/root/fakenet-ca.pem", net.ca_cert.read_bytes())
                latency = {"op": "latency", "addr": net.web, "host": "good.test"}
                download = {"op": "get", "addr": net.web, "host": "good.test", "size": size}
                # Untimed warm-up of every path (ARP, conntrack, proxy's first resolve).
                for rules in (["good.test"], []):
                    sb.egress.set(rules)
                    _guest(sb, [{**latency, "count": 3}])
                _host([{**latency, "count": 3}])
                for i in range(rounds):
                    ctx.log(f"  round {i + 1}/{rounds}")
                    for mode, rules in (("rules", ["good.test"]), ("open", [])):
                        sb.egress.set(rules)
                        [r] = _guest(sb, [{**latency, "count": per_round, "timeout": 30}])
                        lat[mode] += r["samples"]
                        [d] = _guest(sb, [{**download, "timeout": 120}])
                        rate[mode].append(size / d["seconds"] / MB)
                    [r] = _host([{**latency, "count": per_round}])
                    lat["host"] += r["samples"]
                    [d] = _host([{**download, "timeout": 120}])
                    rate["host"].append(size / d["seconds"] / MB)
                counters = sb.egress.get()
                result.notes.append(
                    f"egress counters after the run: allowed {counters.allowed}, "
                    f"denied {counters.denied}"
                )
        finally:
            ctx.stop_side_daemon("net")
            # A stopping daemon keeps its nft table for sandboxes that outlive it; this
            # one has none left, so the table would only pile up run after run.
            tag = Settings(state_dir=side.daemon.state_dir).daemon_tag
            subprocess.run(["nft", "delete", "table", "inet", f"hutch_{tag}"], capture_output=True)
    labels = {
        "rules": "sandbox, egress ['good.test'] (Host proxy)",
        "open": "sandbox, open egress (NAT)",
        "host": "host -> fake internet directly",
    }
    pairs = (("rules", "open"), ("open", "host"), ("rules", "host"))
    for a, b in pairs:
        result.metrics.append(
            Metric(
                f"connect_get_{a}_vs_{b}",
                "s",
                "lower",
                "connection setup + small HTTP GET, timed where the client runs",
                SampleSet(labels[a], lat[a]),
                SampleSet(labels[b], lat[b]),
            )
        )
    for a, b in pairs:
        result.metrics.append(
            Metric(
                f"download_{a}_vs_{b}",
                "MB/s",
                "higher",
                f"GET of {size >> 20} MiB over HTTP, one connection",
                SampleSet(labels[a], rate[a]),
                SampleSet(labels[b], rate[b]),
            )
        )
    for m in result.metrics:
        ctx.log(f"  {m.name}: {m.hutch.headline:.4g} vs {m.baseline.headline:.4g} {m.unit}"
                if m.baseline else f"  {m.name}")  # fmt: skip
    return result
