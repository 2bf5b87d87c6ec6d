"""``density``: host memory of idle clones of one template (issue 15: goal <= 64 MiB of
private memory per idle 256 MiB clone; 100 clones on this 24 GiB host is the goal).

Set-up (untimed): one create builds the template at the shape; then ``N`` sandboxes
(``--quick``: 8; full: 24) are created from it, each answers ``echo``, and they idle for
``IDLE_S``. Then, per QEMU, ``/proc/<pid>/smaps_rollup`` (what ``smem`` reads):
``Private_Clean + Private_Dirty`` (memory only this clone holds), ``Pss`` and ``Rss``.
The template's RAM file pages are shared through the page cache and count as ``Shared_*``.
Baselines: the guest RAM size (256 MiB: the fraction of its RAM a clone costs the host
privately), and the same clones on a side daemon whose templates carry RAM in the stream
(``HUTCH_TEMPLATE_RAM_IN_FILE=0``, same run). Every clone must still answer ``echo`` at
the end.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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


def guest_ram_kib(pid: int) -> dict[str, int]:
    """``Pss`` and ``Rss`` (kB) of the QEMU's guest RAM: the mappings of a file named
    ``memory.ram`` (a clone maps its template's, or its snapshot's, privately). What the
    QEMU holds beyond them is its own overhead (issue 15 item 5)."""
    totals = {"Pss": 0, "Rss": 0}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if parts and "-" in parts[0] and len(parts) >= 5 and ":" not in parts[0]:
            inside = parts[-1].endswith("memory.ram")
        elif inside and len(parts) == 3 and parts[0].rstrip(":") in totals:
            totals[parts[0].rstrip(":")] += int(parts[1])
    return totals


def _echo(sb: Sandbox) -> bool:
    r = sb.exec(ECHO)
    return r.exit_code == 0 and r.stdout == "hi\n"


STREAM_DAEMON = "stream-templates"
STREAM_ENV = {"HUTCH_TEMPLATE_RAM_IN_FILE": "0"}


@dataclass
class Footprint:
    private: list[float]
    pss: list[float]
    rss: list[float]
    overhead: list[float]
    created_s: float
    load: tuple[float, float, float]


def _footprint(ctx: BenchContext, side: SideDaemon, n: int) -> Footprint:
    """``n`` idle clones of the template on ``side``'s daemon, measured, then killed."""
    mib = SANDBOX_MEMORY_MIB

    def make(_: int) -> Sandbox:
        return Sandbox.create(ctx.image, vcpus=SANDBOX_VCPUS, memory_mib=mib, client=side.client)

    first = make(0)
    clones: list[Sandbox] = []
    try:
        first.exec(ECHO)
        wait_for_template(side)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            clones = list(pool.map(make, range(n)))
            if not all(pool.map(_echo, clones)):
                raise RuntimeError("a clone did not answer echo")
        created_s = time.perf_counter() - t0
        ctx.log(f"  {n} clones created and answering in {created_s:.1f} s; idling {IDLE_S:g} s")
        time.sleep(IDLE_S)
        fp = Footprint([], [], [], [], created_s, (0.0, 0.0, 0.0))
        for sb in clones:
            pid = int((side.daemon.state_dir / "sandboxes" / sb.id / "qemu.pid").read_text())
            f = smaps_rollup_kib(pid)
            fp.private.append((f.get("Private_Clean", 0) + f.get("Private_Dirty", 0)) / 1024)
            fp.pss.append(f.get("Pss", 0) / 1024)
            fp.rss.append(f.get("Rss", 0) / 1024)
            fp.overhead.append((f.get("Pss", 0) - guest_ram_kib(pid)["Pss"]) / 1024)
        fp.load = os.getloadavg()
        with ThreadPoolExecutor(4) as pool:
            if not all(pool.map(_echo, clones)):
                raise RuntimeError("a clone stopped answering echo while idle")
    finally:
        for sb in [*clones, first]:
            sb.kill()
    return fp


#: The full-stream comparison runs at most this many clones: each holds most of its
#: RAM privately, so 100 of them would not fit this host.
STREAM_MAX = 24


def run_density(ctx: BenchContext) -> BenchResult:
    """``HUTCH_BENCH_DENSITY_N`` sets the number of clones (issue 15 aims at 100; the
    daemon then needs ``HUTCH_MAX_SANDBOXES`` and ``HUTCH_MAX_MEMORY_MIB`` above it)."""
    n = int(os.environ.get("HUTCH_BENCH_DENSITY_N", "0")) or (8 if ctx.quick else 24)
    n_stream = min(n, STREAM_MAX)
    mib = SANDBOX_MEMORY_MIB
    result = BenchResult(
        "density",
        f"host memory per idle clone of one template ({n} clones), file vs stream templates",
        ctx.quick,
        {"clones": n, "stream_clones": n_stream, "idle_s": IDLE_S, **ctx.sandbox_params()},
    )
    ctx.log("  copy-on-write templates (the main daemon)")
    cow = _footprint(ctx, SideDaemon(ctx.daemon, ctx.client), n)
    ctx.log(f"  full-stream templates (side daemon, {STREAM_ENV})")
    stream = _footprint(ctx, ctx.side_daemon(STREAM_DAEMON, STREAM_ENV), n_stream)
    ctx.stop_side_daemon(STREAM_DAEMON)
    result.metrics = [
        Metric(
            "private_mib_per_idle_clone",
            "MiB",
            "lower",
            "Private_Clean+Private_Dirty of each idle clone's QEMU ÷ its guest RAM "
            "(goal <= 64 MiB, i.e. <= 0.25)",
            SampleSet("private MiB per idle clone", cow.private),
            SampleSet("guest RAM MiB", [float(mib)]),
        ),
        Metric(
            "private_cow_vs_stream_templates",
            "MiB",
            "lower",
            "private MiB per idle clone: copy-on-write template ÷ full-stream template "
            "(HUTCH_TEMPLATE_RAM_IN_FILE=0, same run)",
            SampleSet("private MiB, copy-on-write template", cow.private),
            SampleSet("private MiB, full-stream template", stream.private),
        ),
        Metric(
            "pss_mib_per_idle_clone",
            "MiB",
            "lower",
            "Pss of each idle clone's QEMU (shared template pages split between clones), "
            "÷ the same with full-stream templates",
            SampleSet("Pss MiB, copy-on-write template", cow.pss),
            SampleSet("Pss MiB, full-stream template", stream.pss),
        ),
        Metric(
            "qemu_overhead_pss_mib_per_idle_clone",
            "MiB",
            "lower",
            "Pss of each idle clone's QEMU minus the Pss of its guest RAM mapping "
            "(memory.ram): what the VMM itself costs (issue 15 item 5; Firecracker "
            "promises < 5 MiB)",
            SampleSet("QEMU Pss beyond guest RAM, MiB", cow.overhead),
        ),
        Metric(
            "rss_mib_per_idle_clone",
            "MiB",
            "lower",
            "Rss of each idle clone's QEMU (for scale)",
            SampleSet("Rss MiB per idle clone", cow.rss),
        ),
    ]
    for name, fp, count in (("copy-on-write", cow, n), ("full-stream", stream, n_stream)):
        result.notes.append(
            f"{name}: {count} clones created and answering in {fp.created_s:.1f} s; load average "
            f"{fp.load[0]:.2f}/{fp.load[1]:.2f}/{fp.load[2]:.2f} at measurement on "
            f"{os.cpu_count()} CPUs"
        )
    return result
