"""``create_paths``: create -> first command output by the three ways a sandbox can
start, measured in one run against each other and against bubblewrap.

* cold boot: a side daemon with ``HUTCH_TEMPLATES=0`` (every create boots the kernel);
* template: a side daemon with ``HUTCH_TEMPLATES=1`` and no pool, after its template for
  the shape exists (one untimed create first, then wait for ``templates/*/vm.json``);
* warm pool: a side daemon with ``HUTCH_POOL_SIZE=1``. Before every pool sample the
  harness waits until the pool is full again: it counts the daemon's
  ``warm pool for <image>: N ready`` log lines (one per VM put in the pool) and waits
  until more VMs went in than creates took out, so every sample is a pool hit and no
  refill runs while any other sample is timed.

All sandboxes have the pool's shape (1 vCPU, 512 MiB, 4 GiB: the pool serves only the
default shape). Each round takes one sample of each path, interleaved, so drifting load
hits all alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from bench.baselines import BWRAP, time_spawn
from bench.cases.coldboot import (
    COLD_DAEMON,
    COLD_ENV,
    ECHO,
    cold_label,
    cold_sample,
    time_create_echo,
    warm_cold,
)
from bench.cases.common import SANDBOX_VCPUS, BenchContext, SideDaemon, now
from bench.model import BenchResult, Metric, SampleSet
from hutch import Sandbox
from hutch.sdk import Client

__all__ = ["DEFAULT_SHAPE_MIB", "PoolGauge", "run_create_paths"]

#: The warm pool's (and the SDK's default) shape: 1 vCPU, 512 MiB, 4 GiB disk.
DEFAULT_SHAPE_MIB = 512
TEMPLATE_DAEMON = "template"
POOL_DAEMON = "pool"
TEMPLATE_ENV = {"HUTCH_TEMPLATES": "1", "HUTCH_POOL_SIZE": "0"}
POOL_ENV = {"HUTCH_TEMPLATES": "1", "HUTCH_POOL_SIZE": "1"}
#: Seconds to wait for a template build (one cold boot + settle + save) or a refill.
TEMPLATE_WAIT_S = 600.0
POOL_WAIT_S = 300.0


def wait_for_template(side: SideDaemon, timeout_s: float = TEMPLATE_WAIT_S) -> Path:
    """Wait until the side daemon has a finished template (``vm.json`` is written last;
    a ``<key>.build`` directory is one still being made)."""
    root = side.daemon.state_dir / "templates"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = sorted(root.glob("*/vm.json")) if root.is_dir() else []
        done = [p for p in found if not p.parent.name.endswith(".build")]
        if done:
            return done[0].parent
        time.sleep(0.5)
    raise RuntimeError(
        f"no template appeared in {root} within {timeout_s:.0f} s; daemon log:\n"
        f"{side.daemon.log_tail()}"
    )


class PoolGauge:
    """Counts VMs put into the pool (from the daemon's log) against creates served."""

    def __init__(self, log_path: Path, image: str) -> None:
        self.log_path = log_path
        self.needle = f"warm pool for {image}: "
        self.taken = 0

    def filled(self) -> int:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return 0
        return sum(1 for line in text.splitlines() if self.needle in line and "ready" in line)

    def wait_ready(self, timeout_s: float = POOL_WAIT_S) -> float:
        """Block until a pooled VM is waiting; returns the seconds waited."""
        start = time.monotonic()
        while self.filled() <= self.taken:
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(
                    f"the warm pool did not refill within {timeout_s:.0f} s "
                    f"({self.filled()} filled, {self.taken} taken); see {self.log_path}"
                )
            time.sleep(0.1)
        return time.monotonic() - start


#: Exec round trips timed on each sandbox handed out by the pool, after its first command.
EXECS_PER_POOLED = 5


def time_pool_create_and_execs(
    client: Client, image: str, memory_mib: int, settle: Callable[[], object]
) -> tuple[float, list[float]]:
    """Create (from the pool) + ``echo hi`` until its output is back; then, once
    ``settle()`` returned (the pool's refill done, so nothing else runs), the yardstick
    of ``pool_vs_exec``: :data:`EXECS_PER_POOLED` ``echo hi`` round trips on the same
    running sandbox. The sandbox is killed afterwards (untimed)."""
    t0 = now()
    sb = Sandbox.create(image, vcpus=SANDBOX_VCPUS, memory_mib=memory_mib, client=client)
    try:
        first = sb.exec(ECHO)
        elapsed = now() - t0
        if first.exit_code != 0 or first.stdout != "hi\n":
            raise RuntimeError(f"echo hi in {sb.id} gave {first.exit_code}, {first.stdout!r}")
        settle()
        execs = []
        for _ in range(EXECS_PER_POOLED):
            t1 = now()
            sb.exec(ECHO)
            execs.append(now() - t1)
    finally:
        sb.kill()
    return elapsed, execs


def run_create_paths(ctx: BenchContext) -> BenchResult:
    runs = 3 if ctx.quick else 10
    mib = DEFAULT_SHAPE_MIB
    result = BenchResult(
        "create_paths",
        "create -> first output: cold boot vs template vs warm pool vs bwrap",
        ctx.quick,
        {
            "runs": runs,
            "command": ECHO,
            "image": ctx.image,
            "vcpus": 1,
            "memory_mib": mib,
            "disk_gib": 4,
            "daemons": {
                COLD_DAEMON: COLD_ENV,
                TEMPLATE_DAEMON: TEMPLATE_ENV,
                POOL_DAEMON: POOL_ENV,
            },
        },
    )
    bwrap_argv = [*BWRAP, *ECHO]
    try:
        template = ctx.side_daemon(TEMPLATE_DAEMON, TEMPLATE_ENV)
        pool = ctx.side_daemon(POOL_DAEMON, POOL_ENV)
        # Set-up, untimed: the first create on each daemon boots cold and (templates on)
        # builds the template in the background; the pool fills once it exists.
        ctx.log("  set-up: first creates, template builds, pool fill")
        time_spawn(bwrap_argv, "hi\n")
        warm_cold(ctx, mib)
        time_create_echo(template.client, ctx.image, mib)
        time_create_echo(pool.client, ctx.image, mib)
        wait_for_template(template)
        wait_for_template(pool)
        gauge = PoolGauge(pool.daemon.log_path, ctx.image)
        gauge.wait_ready()
        # One untimed create per fast path: the first restore pays for reading the
        # template files into the page cache.
        time_create_echo(template.client, ctx.image, mib)
        time_create_echo(pool.client, ctx.image, mib)
        gauge.taken += 1

        bwraps: list[float] = []
        colds: list[float] = []
        templates: list[float] = []
        pools: list[float] = []
        waits: list[float] = []
        exec_rts: list[float] = []
        for i in range(runs):
            # The refill must finish before anything is timed: a restore running beside
            # another sample would slow that sample down.
            waits.append(gauge.wait_ready())
            bwraps.append(time_spawn(bwrap_argv, "hi\n"))
            colds.append(cold_sample(ctx, mib))
            templates.append(time_create_echo(template.client, ctx.image, mib))
            gauge.wait_ready()
            gauge.taken += 1
            pooled, execs = time_pool_create_and_execs(
                pool.client, ctx.image, mib, gauge.wait_ready
            )
            pools.append(pooled)
            exec_rts.extend(execs)
            ctx.log(
                f"  run {i + 1}/{runs}: cold {colds[-1]:.3f} s, template {templates[-1]:.3f} s, "
                f"pool {pools[-1]:.3f} s, bwrap {bwraps[-1]:.4f} s"
            )
    finally:
        ctx.stop_side_daemon(TEMPLATE_DAEMON)
        ctx.stop_side_daemon(POOL_DAEMON)

    bwrap = SampleSet("bwrap --unshare-all ... echo hi (same run)", bwraps)
    cold = SampleSet(cold_label(mib), colds)
    ctx.cold_boots[mib] = cold
    tmpl = SampleSet("Sandbox.create + exec(echo hi), restored from the template", templates)
    warm = SampleSet("Sandbox.create + exec(echo hi), taken from the warm pool", pools)
    result.metrics = [
        Metric(
            "template_vs_cold",
            "s",
            "lower",
            "create from the template snapshot ÷ cold boot (target <= 0.1)",
            tmpl,
            cold,
        ),
        Metric(
            "pool_vs_bwrap",
            "s",
            "lower",
            "create from the warm pool ÷ bubblewrap sandbox spawn (target <= 3)",
            warm,
            bwrap,
        ),
        Metric(
            "pool_vs_exec",
            "s",
            "lower",
            "create from the warm pool to first output ÷ one exec(echo hi) round trip on a "
            "running sandbox (target <= 2, issue 15)",
            SampleSet(warm.label, pools),
            SampleSet(
                f"exec(echo hi) round trip on the sandbox just handed out ({EXECS_PER_POOLED} "
                "after its first command and the pool's refill, every run)",
                exec_rts,
            ),
        ),
        Metric(
            "cold_vs_bwrap",
            "s",
            "lower",
            "cold boot ÷ bubblewrap sandbox spawn (for scale)",
            SampleSet(cold_label(mib), colds),
            bwrap,
        ),
        Metric(
            "template_vs_bwrap",
            "s",
            "lower",
            "create from the template ÷ bubblewrap sandbox spawn (for scale)",
            SampleSet(tmpl.label, templates),
            bwrap,
        ),
    ]
    result.notes.append(
        "set-up (untimed): one create per daemon, template built, pool filled, then one more "
        "create per fast path; each round waits for the pool refill before timing anything "
        f"(waits p50 {sorted(waits)[len(waits) // 2]:.2f} s)"
    )
    return result
