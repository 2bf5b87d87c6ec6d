"""``noisy``: another sandbox's ``echo`` exec latency while a neighbour misbehaves, as a
ratio to quiet, in one run (issue 15, item 4: resource limits per sandbox).

Two sandboxes on the main daemon (per-sandbox cgroups on when it runs as root): the
*victim* answers sequential ``exec(["echo", "hi"])``; the *neighbour* is quiet, then in
turn runs each load below, in a fresh sandbox each (a fork bomb can leave its guest
unusable). Each phase times the same number of execs, starting :data:`RAMP_S` after
the load did:

- ``quiet``: the neighbour idles (the baseline);
- ``fork_bomb``: ``f() { f | f & }; f`` in the guest;
- ``memory_hog``: Python filling guest RAM with written pages, again and again;
- ``disk_fill``: ``dd`` of zeros to the guest disk until it is full, with ``sync``;
- ``cpu_burn``: a busy loop per vCPU;
- ``net_flood``: UDP datagrams of 1400 bytes as fast as the guest sends them, to its
  gateway (the host's end of its tap, port 9), which the host drops: every packet
  crosses the tap, QEMU's virtio-net and the host's nftables, and none leaves the machine.

(A flood of DNS queries is ``dns_flood``'s subject, with its fake internet.) The host's
load average and MemAvailable are recorded before and after each phase in the notes.

``HUTCH_BENCH_CGROUPS=off`` runs the same on a side daemon with ``HUTCH_CGROUPS=off``
(sandboxes without host limits), for comparison with the default.
"""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path
from typing import Any

from bench.cases.common import SANDBOX_MEMORY_MIB, SANDBOX_VCPUS, BenchContext, now
from bench.model import BenchResult, Metric, SampleSet
from bench.stats import percentile
from hutch import Sandbox
from hutch.sdk import Client

__all__ = ["run_noisy"]

#: Seconds the load runs before the first timed exec.
RAMP_S = 3.0
#: Seconds after a phase, for the host to settle (page cache writeback, reclaim).
SETTLE_S = 3.0
#: ``pgrep -f`` pattern of a process each load must show in the guest once started
#: (None: not checkable: a fork bomb leaves no room to run ``pgrep``, a busy loop is the
#: shell itself).
PROOF: dict[str, str | None] = {
    "fork_bomb": None,
    "memory_hog": "l.append",
    "disk_fill": "of=/var/tmp/fill",
    "cpu_burn": None,
    "net_flood": "sendto",
}
#: The guest's default gateway, from /proc/net/route (no `ip` needed), then the flood.
NET_FLOOD = (
    "import socket\n"
    "g = [l.split()[2] for l in open('/proc/net/route') if l.split()[1] == '00000000'][0]\n"
    "to = (socket.inet_ntoa(bytes.fromhex(g)[::-1]), 9)\n"
    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    "d = b'x' * 1400\n"
    "while True:\n"
    "    try:\n"
    "        s.sendto(d, to)\n"
    "    except OSError:\n"
    "        pass\n"
)
LOADS: dict[str, str] = {
    "fork_bomb": "f() { f | f & }; f",
    "memory_hog": (
        "while true; do python3 -c \"l=[]\nwhile True: l.append(b'x' * (16 << 20))\"; done"
    ),
    "disk_fill": "while true; do dd if=/dev/zero of=/var/tmp/fill bs=1M; sync; rm -f "
    "/var/tmp/fill; done",
    "cpu_burn": "for i in $(seq $(nproc)); do (while :; do :; done) & done; wait",
    "net_flood": f"exec python3 -c {shlex.quote(NET_FLOOD)}",
}


def _echo(sb: Sandbox) -> float:
    t0 = now()
    answer = sb.exec(["echo", "hi"], timeout_s=120)
    elapsed = now() - t0
    if answer.exit_code != 0 or answer.stdout != "hi\n":
        raise RuntimeError(f"echo in {sb.id}: exit {answer.exit_code}, {answer.stdout!r}")
    return elapsed


def _host() -> str:
    load = os.getloadavg()
    mem = next(
        line.split()[1]
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemAvailable:")
    )
    return f"load {load[0]:.2f} {load[1]:.2f}, MemAvailable {int(mem) >> 10} MiB"


def _new(ctx: BenchContext, client: Client) -> Sandbox:
    return Sandbox.create(
        ctx.image, vcpus=SANDBOX_VCPUS, memory_mib=SANDBOX_MEMORY_MIB, client=client
    )


def _phase(
    ctx: BenchContext, client: Client, victim: Sandbox, name: str, count: int
) -> list[float]:
    load = LOADS.get(name)
    neighbour = _new(ctx, client)
    try:
        if load is not None:
            # setsid + nohup: the load outlives the exec that started it.
            neighbour.exec(
                [
                    "sh",
                    "-c",
                    f"setsid nohup sh -c {shlex.quote(load)} >/dev/null 2>&1 </dev/null &",
                ],
                timeout_s=60,
            )
            time.sleep(RAMP_S)
            proof = PROOF.get(name)
            if proof is not None and neighbour.exec(["pgrep", "-f", proof]).exit_code != 0:
                raise RuntimeError(f"the {name} load is not running in {neighbour.id}")
        return [_echo(victim) for _ in range(count)]
    finally:
        neighbour.kill()
        time.sleep(SETTLE_S)


def run_noisy(ctx: BenchContext) -> BenchResult:
    rounds, count = (1, 20) if ctx.quick else (2, 60)
    cgroups = os.environ.get("HUTCH_BENCH_CGROUPS", "auto")
    client = ctx.client
    if cgroups != "auto":
        client = ctx.side_daemon(f"cgroups-{cgroups}", {"HUTCH_CGROUPS": cgroups}).client
    params: dict[str, Any] = {
        "cgroups": cgroups,
        "rounds": rounds,
        "execs_per_phase": count,
        "ramp_s": RAMP_S,
        "loads": LOADS,
        **ctx.sandbox_params(),
    }
    result = BenchResult(
        "noisy", "another sandbox's echo p99 under a neighbour's load vs quiet", ctx.quick, params
    )
    samples: dict[str, list[float]] = {"quiet": [], **{name: [] for name in LOADS}}
    victim = _new(ctx, client)
    try:
        for _ in range(3):  # untimed warm-up
            _echo(victim)
        for i in range(rounds):
            for name in samples:
                before = _host()
                got = _phase(ctx, client, victim, name, count)
                samples[name] += got
                after = _host()
                result.notes.append(f"round {i + 1} {name}: host before {before}; after {after}")
                ctx.log(f"  round {i + 1}/{rounds} {name}: p99 {percentile(got, 99) * 1e3:.1f} ms")
    finally:
        victim.kill()  # ``with`` would only close the handle
        if cgroups != "auto":
            ctx.stop_side_daemon(f"cgroups-{cgroups}")
    quiet = samples["quiet"]
    for name in LOADS:
        loaded = samples[name]
        result.metrics.append(
            Metric(
                f"echo_p99_during_{name}_vs_quiet",
                "s",
                "lower",
                f"another sandbox's exec(echo) p99 while a neighbour runs {name}, vs quiet",
                SampleSet(f"victim echo, neighbour {name} (p99)", loaded, percentile(loaded, 99)),
                SampleSet("victim echo, neighbour idle (p99)", quiet, percentile(quiet, 99)),
            )
        )
    for m in result.metrics:
        if m.baseline is not None:
            ctx.log(f"  {m.name}: {m.hutch.headline:.4g} vs {m.baseline.headline:.4g} s")
    return result
