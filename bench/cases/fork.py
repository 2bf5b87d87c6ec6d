"""``fork``: ``sb.fork(10)`` of a running 256 MiB sandbox until all ten children have
answered ``exec(["true"])``, against the run's cold boot.

``sb.fork`` returns once the children run; the ten execs then go out at once (one
thread each, one shared HTTP client). Per-child time = that total ÷ 10 (target <= 1/10
of a cold boot). The children are killed after each run (untimed); the parent is reused.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from bench.cases.coldboot import cold_sample, reference_or_measured
from bench.cases.common import SANDBOX_MEMORY_MIB, SANDBOX_VCPUS, BenchContext, now
from bench.model import BenchResult, Metric, SampleSet
from hutch import Sandbox

__all__ = ["CHILDREN", "run_fork"]

CHILDREN = 10


def _answers(sb: Sandbox) -> bool:
    return sb.exec(["true"]).exit_code == 0


def run_fork(ctx: BenchContext) -> BenchResult:
    runs = 1 if ctx.quick else 3
    mib = SANDBOX_MEMORY_MIB
    result = BenchResult(
        "fork",
        f"fork of {CHILDREN} from a running sandbox vs cold boot",
        ctx.quick,
        {"runs": runs, "children": CHILDREN, **ctx.sandbox_params()},
    )
    totals: list[float] = []
    per_child: list[float] = []
    fork_calls: list[float] = []
    colds: list[float] = []
    need_cold = mib not in ctx.cold_boots
    parent = Sandbox.create(ctx.image, vcpus=SANDBOX_VCPUS, memory_mib=mib, client=ctx.client)
    try:
        if not _answers(parent):
            raise RuntimeError(f"parent {parent.id} does not answer exec")
        with ThreadPoolExecutor(CHILDREN) as pool:
            for i in range(runs):
                if need_cold:
                    colds.append(cold_sample(ctx, mib))
                children: list[Sandbox] = []
                try:
                    t0 = now()
                    children = parent.fork(CHILDREN)
                    t1 = now()
                    answered = list(pool.map(_answers, children))
                    total = now() - t0
                finally:
                    for child in children:
                        child.kill()
                if len(children) != CHILDREN or not all(answered):
                    raise RuntimeError(
                        f"fork gave {len(children)} children, {sum(answered)} answered true"
                    )
                totals.append(total)
                per_child.append(total / CHILDREN)
                fork_calls.append(t1 - t0)
                ctx.log(
                    f"  run {i + 1}/{runs}: {CHILDREN} children answered in {total:.3f} s "
                    f"(fork call {fork_calls[-1]:.3f} s, per child {per_child[-1]:.3f} s)"
                    + (f", cold boot {colds[-1]:.3f} s" if colds else "")
                )
                if not _answers(parent):
                    raise RuntimeError(f"parent {parent.id} stopped answering after the fork")
    finally:
        parent.kill()

    cold = reference_or_measured(ctx, mib, colds, result.notes)
    result.metrics = [
        Metric(
            "fork_per_child_vs_cold_boot",
            "s",
            "lower",
            f"(sb.fork({CHILDREN}) + exec(true) in every child) ÷ {CHILDREN}, ÷ cold boot "
            "(target <= 0.1)",
            SampleSet(f"fork({CHILDREN}) until all answer, ÷ {CHILDREN}", per_child),
            cold,
        ),
        Metric(
            "fork_total_vs_cold_boot",
            "s",
            "lower",
            f"sb.fork({CHILDREN}) + exec(true) in every child ÷ one cold boot",
            SampleSet(f"fork({CHILDREN}) until all {CHILDREN} answer", totals),
            SampleSet(cold.label, list(cold.samples)),
        ),
        Metric(
            "fork_call",
            "s",
            "lower",
            f"sb.fork({CHILDREN}) alone (returns when every child runs)",
            SampleSet(f"sb.fork({CHILDREN})", fork_calls),
        ),
    ]
    result.notes.append("parent and children: 1 vCPU, 256 MiB; children killed after each run")
    return result
