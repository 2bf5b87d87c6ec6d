"""``density``: host memory of idle clones of one template (issue 15: goal <= 64 MiB of
private memory per idle 256 MiB clone; 100 clones on this 24 GiB host is the goal).

Set-up (untimed): one create builds the template at the shape; then ``N`` sandboxes
(``--quick``: 8; full: 24) are created from it, each answers ``echo``, and they idle for
``IDLE_S``. Then, per QEMU, ``/proc/<pid>/smaps_rollup`` (what ``smem`` reads):
``Private_Clean + Private_Dirty`` (memory only this clone holds), ``Pss`` and ``Rss``.
The template's RAM file pages are shared through the page cache and count as ``Shared_*``.
Baseline: the guest RAM size (256 MiB), so the ratio is the fraction of its RAM a clone
costs the host privately. Every clone must still answer ``echo`` at the end.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.cases.common import SANDBOX_MEMORY_MIB, SANDBOX_VCPUS, BenchContext, SideDaemon
from bench.cases.create_paths import wait_for_template
from bench.model import BenchResult, Metric, SampleSet
from hutch import Sandbox

__all__ = ["IDLE_S", "run_density", "smaps_rollup_kib"]

IDLE_S = 10.0
ECHO = ["echo", "hi"]


def smaps_rollup_kib(pid: int) -> dict[str, int]:
    """The kB fields of ``/proc/<pid>/smaps_rollup`` by name."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            fields[parts[0].rstrip(":")] = int(parts[1])
    return fields


def _echo(sb: Sandbox) -> bool:
    r = sb.exec(ECHO)
    return r.exit_code == 0 and r.stdout == "hi\n"


def run_density(ctx: BenchContext) -> BenchResult:
    n = 8 if ctx.quick else 24
    mib = SANDBOX_MEMORY_MIB
    result = BenchResult(
        "density",
        f"host memory per idle clone of one template ({n} clones)",
        ctx.quick,
        {"clones": n, "idle_s": IDLE_S, **ctx.sandbox_params()},
    )
    first = Sandbox.create(ctx.image, vcpus=SANDBOX_VCPUS, memory_mib=mib, client=ctx.client)
    clones: list[Sandbox] = []
    try:
        first.exec(ECHO)
        # The main daemon is the harness's own; its template dir is found the same way.
        wait_for_template(SideDaemon(ctx.daemon, ctx.client))

        def make(_: int) -> Sandbox:
            return Sandbox.create(ctx.image, vcpus=SANDBOX_VCPUS, memory_mib=mib, client=ctx.client)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            clones = list(pool.map(make, range(n)))
            if not all(pool.map(_echo, clones)):
                raise RuntimeError("a clone did not answer echo")
        created_s = time.perf_counter() - t0
        ctx.log(f"  {n} clones created and answering in {created_s:.1f} s; idling {IDLE_S:g} s")
        time.sleep(IDLE_S)
        private: list[float] = []
        pss: list[float] = []
        rss: list[float] = []
        for sb in clones:
            pid = int((ctx.daemon.state_dir / "sandboxes" / sb.id / "qemu.pid").read_text())
            f = smaps_rollup_kib(pid)
            private.append((f.get("Private_Clean", 0) + f.get("Private_Dirty", 0)) / 1024)
            pss.append(f.get("Pss", 0) / 1024)
            rss.append(f.get("Rss", 0) / 1024)
        load = os.getloadavg()
        with ThreadPoolExecutor(4) as pool:
            if not all(pool.map(_echo, clones)):
                raise RuntimeError("a clone stopped answering echo while idle")
    finally:
        for sb in [*clones, first]:
            sb.kill()
    result.metrics = [
        Metric(
            "private_mib_per_idle_clone",
            "MiB",
            "lower",
            "Private_Clean+Private_Dirty of each idle clone's QEMU ÷ its guest RAM "
            "(goal <= 64 MiB, i.e. <= 0.25)",
            SampleSet("private MiB per idle clone", private),
            SampleSet("guest RAM MiB", [float(mib)]),
        ),
        Metric(
            "pss_mib_per_idle_clone",
            "MiB",
            "lower",
            "Pss of each idle clone's QEMU (shared template pages split between clones)",
            SampleSet("Pss MiB per idle clone", pss),
            SampleSet("guest RAM MiB", [float(mib)]),
        ),
        Metric(
            "rss_mib_per_idle_clone",
            "MiB",
            "lower",
            "Rss of each idle clone's QEMU (for scale)",
            SampleSet("Rss MiB per idle clone", rss),
        ),
    ]
    result.notes.append(
        f"{n} clones, load average {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f} at measurement "
        f"on {os.cpu_count()} CPUs; created and answering in {created_s:.1f} s"
    )
    return result
