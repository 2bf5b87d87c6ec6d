"""``dns_flood``: another sandbox's exec latency while one guest floods its resolver, as a
ratio to quiet, and hutchd's CPU use meanwhile, in one run (issue 17.5).

A side daemon ``flood`` with the default limits and ``HUTCH_DNS_UPSTREAM`` at a fake
internet (``tests.netfake``). Two sandboxes, open egress: the *flooder* runs
``tests/netfake/flood.py``; the *victim* answers sequential ``exec(["true"])``. Each
round has three phases of the same number of execs:

- ``quiet``: the flooder idles;
- ``burn``: the flooder runs the flood loop without sending: its vCPU is as busy as in a
  flood (one of the host's cores), without the network. The yardstick that separates
  "a busy neighbour VM" from "what the flood costs hutch";
- ``flood``: the flooder sends DNS queries to its resolver as fast as it can from one
  socket, a new name each (open egress: forwarded upstream while under the limit).

hutchd's CPU (user + system of all its threads and its waited-for children, such as
``nft``) is read from ``/proc`` around each phase's execs. The flood starts
:data:`RAMP_S` before the first timed exec and stops (SIGTERM) after the last.

``HUTCH_BENCH_OLD_SRC=<source tree>`` (e.g. ``git archive main | tar -x -C /tmp/old``)
runs the same rounds, interleaved, on a second side daemon started from that tree: the
same run then compares before and after (``*_old`` metrics and ``*_new_vs_old``).
Needs root (the fake internet is a network namespace).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

from tests.netfake import FakeInternet, free_net_pool

from bench.cases.common import SANDBOX_MEMORY_MIB, SANDBOX_VCPUS, BenchContext, SideDaemon, now
from bench.model import BenchResult, Metric, SampleSet
from bench.stats import percentile
from hutch import Sandbox
from hutch.config import NetLimits, Settings

__all__ = ["run_dns_flood"]

FLOOD = Path(__file__).resolve().parents[2] / "tests" / "netfake" / "flood.py"
#: Seconds the flood runs before the first timed exec (so every sample is under it).
RAMP_S = 2.0
#: Seconds between phases: the last phase's backlog (answers, counters) drains.
SETTLE_S = 3.0
PHASES = ("quiet", "burn", "flood")


@dataclass
class _Side:
    """One daemon under test with its two sandboxes and what was measured on it."""

    name: str
    side: SideDaemon
    flooder: Sandbox
    victim: Sandbox
    gateway: str
    execs: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    cpu: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    floods: list[dict[str, Any]] = field(default_factory=list)


def _cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime of ``pid`` (every thread; waited-for children)."""
    after_comm = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(x) for x in after_comm[11:15])  # fields 14-17 of proc(5)
    return ticks / os.sysconf("SC_CLK_TCK")


def _exec_true(sb: Sandbox) -> float:
    t0 = now()
    answer = sb.exec(["true"], timeout_s=120)
    elapsed = now() - t0
    if answer.exit_code != 0:
        raise RuntimeError(f"exec(['true']) in {sb.id} exited {answer.exit_code}")
    return elapsed


def _setup(ctx: BenchContext, name: str, env: dict[str, str], repo: Path | None) -> _Side:
    side = ctx.side_daemon(name, env, repo)
    made = [
        Sandbox.create(
            ctx.image,
            vcpus=SANDBOX_VCPUS,
            memory_mib=SANDBOX_MEMORY_MIB,
            name=role,
            client=side.client,
        )
        for role in ("flooder", "victim")
    ]
    flooder, victim = made
    flooder.files.write("/root/flood.py", FLOOD.read_bytes())
    info = flooder.refresh()
    if info.network is None or not info.network.address:
        raise RuntimeError(f"sandbox {flooder.id} on daemon {name} has no address")
    gateway = str(IPv4Address(info.network.address.split("/")[0]) - 1)  # its resolver
    for _ in range(3):  # untimed warm-up
        _exec_true(victim)
    return _Side(name, side, flooder, victim, gateway)


def _phase(s: _Side, phase: str, count: int) -> None:
    pid = s.side.daemon.pid
    if pid is None:
        raise RuntimeError(f"side daemon {s.name} is not running")
    process = None
    if phase != "quiet":
        kind = "dns" if phase == "flood" else "burn"
        process = s.flooder.processes.start(["python3", "/root/flood.py", kind, s.gateway, "600"])
        time.sleep(RAMP_S)
    cpu0, t0 = _cpu_seconds(pid), now()
    samples = [_exec_true(s.victim) for _ in range(count)]
    cpu1, t1 = _cpu_seconds(pid), now()
    s.execs[phase] += samples
    s.cpu[phase].append(100.0 * (cpu1 - cpu0) / (t1 - t0))
    if process is not None:
        process.signal("TERM")
        info = process.wait(timeout_s=120)
        out = process.output()
        if info.exit_code != 0:
            raise RuntimeError(f"flood.py {phase} in {s.flooder.id} failed: {out.stderr[-2000:]}")
        stats: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        if phase == "flood":
            s.floods.append(stats)
    time.sleep(SETTLE_S)


def _metrics(s: _Side, suffix: str) -> list[Metric]:
    label = f"victim exec(['true']) on daemon {s.name}"
    flood, quiet, burn = (s.execs[p] for p in ("flood", "quiet", "burn"))

    def p99(samples: list[float]) -> float:
        return percentile(samples, 99)

    return [
        Metric(
            f"exec_during_dns_flood_vs_quiet{suffix}",
            "s",
            "lower",
            "another sandbox's exec round trip while a guest floods its resolver, vs quiet",
            SampleSet(f"{label}, neighbour flooding DNS", flood),
            SampleSet(f"{label}, neighbour idle", quiet),
        ),
        Metric(
            f"exec_p99_during_dns_flood_vs_quiet{suffix}",
            "s",
            "lower",
            "the same, p99 of each",
            SampleSet(f"{label}, neighbour flooding DNS (p99)", flood, value=p99(flood)),
            SampleSet(f"{label}, neighbour idle (p99)", quiet, value=p99(quiet)),
        ),
        Metric(
            f"exec_during_dns_flood_vs_cpu_burn{suffix}",
            "s",
            "lower",
            "exec while the neighbour floods vs while it burns the same CPU sending nothing",
            SampleSet(f"{label}, neighbour flooding DNS", flood),
            SampleSet(f"{label}, neighbour burning CPU", burn),
        ),
        Metric(
            f"hutchd_cpu_during_dns_flood_vs_quiet{suffix}",
            "%",
            "lower",
            "hutchd's CPU (all threads + waited-for children) per round, % of one core",
            SampleSet(f"hutchd {s.name}, neighbour flooding DNS", s.cpu["flood"]),
            SampleSet(f"hutchd {s.name}, neighbour idle", s.cpu["quiet"]),
        ),
    ]


def _flood_note(s: _Side) -> str:
    sent = sum(f["sent"] for f in s.floods)
    seconds = sum(f["seconds"] for f in s.floods) or 1.0
    rcodes: dict[str, int] = {}
    for f in s.floods:
        for k, v in f.get("rcodes", {}).items():
            rcodes[k] = rcodes.get(k, 0) + v
    egress = s.flooder.egress.get()
    return (
        f"daemon {s.name}: the flooder sent {sent} queries in {seconds:.0f} s "
        f"({sent / seconds:.0f}/s), got {sum(f['replies'] for f in s.floods)} answers "
        f"{rcodes}; its egress counters: denied {egress.denied}, rate_limited "
        f"{egress.rate_limited}; hutchd CPU % per round: quiet {s.cpu['quiet']}, burn "
        f"{s.cpu['burn']}, flood {s.cpu['flood']}"
    )


def run_dns_flood(ctx: BenchContext) -> BenchResult:
    if os.geteuid() != 0:
        raise RuntimeError("the dns_flood benchmark needs root (it builds a network namespace)")
    rounds, count = (2, 15) if ctx.quick else (3, 40)
    old_src = os.environ.get("HUTCH_BENCH_OLD_SRC")
    old_repo = Path(old_src).resolve() if old_src else None
    if old_repo is not None and not (old_repo / "src" / "hutch").is_dir():
        raise RuntimeError(f"HUTCH_BENCH_OLD_SRC={old_src}: no src/hutch in it")
    limits = NetLimits()
    params: dict[str, Any] = {
        "rounds": rounds,
        "execs_per_phase": count,
        "phases": list(PHASES),
        "ramp_s": RAMP_S,
        "flood": "one UDP socket, a new name per A query (f<n>.flood.test), open egress",
        "limits": {"dns_rate": limits.dns_rate, "dns_burst": limits.dns_burst},
        "old_src": str(old_repo) if old_repo else None,
        **ctx.sandbox_params(),
    }
    result = BenchResult(
        "dns_flood", "another sandbox's exec during a DNS flood vs quiet", ctx.quick, params
    )
    sides: list[_Side] = []
    with FakeInternet() as net:
        try:
            env = {"HUTCH_NET_POOL": free_net_pool(), **net.env()}
            sides.append(_setup(ctx, "flood", env, None))
            if old_repo is not None:
                old_env = {"HUTCH_NET_POOL": free_net_pool(), **net.env()}
                sides.append(_setup(ctx, "flood-old", old_env, old_repo))
            for i in range(rounds):
                for s in sides:
                    ctx.log(f"  round {i + 1}/{rounds} on {s.name}")
                    for phase in PHASES:
                        _phase(s, phase, count)
            result.notes += [_flood_note(s) for s in sides]
        finally:
            for s in sides:
                ctx.stop_side_daemon(s.name)
                # A stopping daemon keeps its table for sandboxes that outlive it; these
                # have none left, so the table would only pile up run after run.
                tag = Settings(state_dir=s.side.daemon.state_dir).daemon_tag
                subprocess.run(
                    ["nft", "delete", "table", "inet", f"hutch_{tag}"], capture_output=True
                )
    result.metrics += _metrics(sides[0], "")
    if len(sides) > 1:
        new, old = sides
        result.metrics += _metrics(old, "_old")
        result.metrics += [
            Metric(
                "exec_during_dns_flood_new_vs_old",
                "s",
                "lower",
                "another sandbox's exec during the flood: this tree vs HUTCH_BENCH_OLD_SRC",
                SampleSet("victim exec, this tree", new.execs["flood"]),
                SampleSet("victim exec, old tree", old.execs["flood"]),
            ),
            Metric(
                "hutchd_cpu_during_dns_flood_new_vs_old",
                "%",
                "lower",
                "hutchd's CPU during the flood: this tree vs HUTCH_BENCH_OLD_SRC",
                SampleSet("hutchd, this tree", new.cpu["flood"]),
                SampleSet("hutchd, old tree", old.cpu["flood"]),
            ),
        ]
    for m in result.metrics:
        ctx.log(f"  {m.name}: {m.hutch.headline:.4g} vs {m.baseline.headline:.4g} {m.unit}"
                if m.baseline else f"  {m.name}")  # fmt: skip
    return result
