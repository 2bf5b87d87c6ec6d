"""``boot`` and ``create``: a new sandbox until its first command's output is back.

Each hutch sample is interleaved with one bubblewrap sample, so slow drift in the
machine's load hits both sides alike.
"""

from __future__ import annotations

from bench.baselines import BWRAP, time_spawn
from bench.cases.common import BenchContext, new_sandbox, now
from bench.model import BenchResult, Metric, SampleSet

__all__ = ["run_boot", "run_create"]


def _cycle(ctx: BenchContext, cmd: list[str], expect: str) -> tuple[float, float, float]:
    """One create → exec(cmd) → delete; seconds for (create, first exec, delete)."""
    t0 = now()
    sb = new_sandbox(ctx)
    try:
        t1 = now()
        result = sb.exec(cmd)
        t2 = now()
        if result.exit_code != 0 or result.stdout != expect:
            raise RuntimeError(
                f"{cmd!r} in {sb.id} gave exit {result.exit_code}, stdout {result.stdout!r}, "
                f"stderr {result.stderr!r}; expected exit 0 and {expect!r}"
            )
    finally:
        t3 = now()
        sb.kill()
    return t1 - t0, t2 - t1, now() - t3


def _measure(
    ctx: BenchContext, runs: int, cmd: list[str], expect: str
) -> tuple[SampleSet, SampleSet, SampleSet, SampleSet, SampleSet]:
    bwrap_argv = [*BWRAP, *cmd]
    # Untimed warm-up: the first boot after the daemon starts pays for reading the image
    # into the page cache; that is a property of the disk, not of hutch.
    time_spawn(bwrap_argv, expect)
    _cycle(ctx, cmd, expect)
    totals, creates, firsts, deletes, bwraps = [], [], [], [], []
    for i in range(runs):
        bwraps.append(time_spawn(bwrap_argv, expect))
        create_s, first_s, delete_s = _cycle(ctx, cmd, expect)
        creates.append(create_s)
        firsts.append(first_s)
        totals.append(create_s + first_s)
        deletes.append(delete_s)
        ctx.log(f"  run {i + 1}/{runs}: {create_s + first_s:.3f} s (bwrap {bwraps[-1]:.4f} s)")
    label = "Sandbox.create + exec(" + " ".join(cmd) + ")"
    return (
        SampleSet(label, totals),
        SampleSet("bwrap --unshare-all ... " + " ".join(cmd), bwraps),
        SampleSet("Sandbox.create (returns when the guest agent answers)", creates),
        SampleSet("first exec(" + " ".join(cmd) + ")", firsts),
        SampleSet("Sandbox.kill", deletes),
    )


def run_boot(ctx: BenchContext) -> BenchResult:
    runs = 2 if ctx.quick else 5
    result = BenchResult(
        "boot",
        "cold boot to first command output",
        ctx.quick,
        {"runs": runs, "command": ["true"], **ctx.sandbox_params()},
    )
    total, bwrap, create, first, _ = _measure(ctx, runs, ["true"], "")
    result.metrics = [
        Metric(
            "boot_to_first_output",
            "s",
            "lower",
            "Sandbox.create + exec(['true']) wall time",
            total,
            bwrap,
        ),
        Metric("create", "s", "lower", "Sandbox.create alone", create),
        Metric("first_exec", "s", "lower", "the first exec on a fresh sandbox", first),
    ]
    result.notes.append("one untimed warm-up cycle before the timed runs")
    return result


def run_create(ctx: BenchContext) -> BenchResult:
    runs = 5 if ctx.quick else 20
    result = BenchResult(
        "create",
        "create -> first command output",
        ctx.quick,
        {"runs": runs, "command": ["echo", "hi"], **ctx.sandbox_params()},
    )
    total, bwrap, _, _, delete = _measure(ctx, runs, ["echo", "hi"], "hi\n")
    result.metrics = [
        Metric(
            "create_to_first_output",
            "s",
            "lower",
            "Sandbox.create + exec(['echo','hi']) wall time",
            total,
            bwrap,
        ),
        Metric("delete", "s", "lower", "Sandbox.kill (DELETE) wall time", delete),
    ]
    result.notes.append("one untimed warm-up cycle before the timed runs")
    return result
