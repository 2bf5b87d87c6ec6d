"""``fork``: ``sb.fork(10)`` of a running 256 MiB sandbox until all ten children have
answered ``exec(["true"])``, against the run's cold boot and against one resume.

``sb.fork`` returns once the children run; the ten execs then go out at once (one
thread each, one shared HTTP client). Per-child time = that total ÷ 10 (target <= 1/10
of a cold boot). The children are killed after each run (untimed); the parent is reused.
One resume (the baseline of ``fork_vs_one_resume``, issue 15: target <= 3): the parent's
``sb.pause()`` (untimed) then ``sb.resume()`` + ``exec(true)``, in every run. A fork of
``BIG`` (50; ``--quick``: 20) is timed once the same way and reported with the host's
load average.

The parent is a template clone (the first create boots cold and builds the template; the
parent is created once it exists), as every sandbox but a shape's first is: its fork's
snapshot is rebased on a memory file of its own. ``fork_rebased_vs_stream`` compares the
fork of 10 with the same on a side daemon with ``HUTCH_TEMPLATE_RAM_IN_FILE=0``, where
every child loads the parent's full stream (the path before the rebase).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from bench.cases.coldboot import cold_sample, reference_or_measured
from bench.cases.common import SANDBOX_MEMORY_MIB, SANDBOX_VCPUS, BenchContext, SideDaemon, now
from bench.cases.create_paths import wait_for_template
from bench.model import BenchResult, Metric, SampleSet
from hutch import Sandbox
from hutch.sdk import Client

__all__ = ["BIG", "CHILDREN", "run_fork"]

CHILDREN = 10
BIG = 50


def _answers(sb: Sandbox) -> bool:
    return sb.exec(["true"]).exit_code == 0


STREAM_DAEMON = "fork-stream"
#: The old path, for the same-run comparison: templates (and so every fork of a clone)
#: carry the guest's RAM in the migration stream.
STREAM_ENV = {"HUTCH_TEMPLATE_RAM_IN_FILE": "0"}


def template_clone(client: Client, side: SideDaemon, image: str, mib: int) -> Sandbox:
    """A sandbox restored from the daemon's template at the shape (the first create
    there boots cold and builds it; it is killed once the template exists), as every
    create but the first is: its fork is a fork of a clone."""
    first = Sandbox.create(image, vcpus=SANDBOX_VCPUS, memory_mib=mib, client=client)
    try:
        if not _answers(first):
            raise RuntimeError(f"{first.id} does not answer exec")
        wait_for_template(side)
    finally:
        first.kill()
    return Sandbox.create(image, vcpus=SANDBOX_VCPUS, memory_mib=mib, client=client)


def _fork_until_answered(parent: Sandbox, n: int, pool: ThreadPoolExecutor) -> float:
    children: list[Sandbox] = []
    try:
        t0 = now()
        children = parent.fork(n)
        answered = list(pool.map(_answers, children))
        total = now() - t0
    finally:
        for child in children:
            child.kill()
    if len(children) != n or not all(answered):
        raise RuntimeError(f"fork({n}) gave {len(children)} children, {sum(answered)} answered")
    return total


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
    resumes: list[float] = []
    big: list[float] = []
    big_n = 20 if ctx.quick else BIG
    colds: list[float] = []
    need_cold = mib not in ctx.cold_boots
    stream_totals: list[float] = []
    parent = template_clone(ctx.client, SideDaemon(ctx.daemon, ctx.client), ctx.image, mib)
    try:
        if not _answers(parent):
            raise RuntimeError(f"parent {parent.id} does not answer exec")
        with ThreadPoolExecutor(max(CHILDREN, big_n)) as pool:
            for i in range(runs):
                if need_cold:
                    colds.append(cold_sample(ctx, mib))
                parent.pause()
                t0 = now()
                parent.resume()
                if not _answers(parent):
                    raise RuntimeError(f"parent {parent.id} does not answer after a resume")
                resumes.append(now() - t0)
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
            children = []
            try:
                t0 = now()
                children = parent.fork(big_n)
                answered = list(pool.map(_answers, children))
                big.append(now() - t0)
                load = os.getloadavg()
            finally:
                for child in children:
                    child.kill()
            if len(children) != big_n or not all(answered):
                raise RuntimeError(f"fork({big_n}) gave {len(children)}, {sum(answered)} answered")
            ctx.log(f"  fork of {big_n}: all answered in {big[0]:.3f} s (load {load[0]:.2f})")
            result.notes.append(
                f"fork of {big_n}: load average {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f} "
                f"right after, on {os.cpu_count()} CPUs"
            )
    finally:
        parent.kill()
    side = ctx.side_daemon(STREAM_DAEMON, STREAM_ENV)
    try:
        other = template_clone(side.client, side, ctx.image, mib)
        try:
            with ThreadPoolExecutor(CHILDREN) as pool:
                for i in range(runs):
                    stream_totals.append(_fork_until_answered(other, CHILDREN, pool))
                    ctx.log(
                        f"  run {i + 1}/{runs}, RAM in the stream ({STREAM_ENV}): "
                        f"{CHILDREN} children answered in {stream_totals[-1]:.3f} s"
                    )
        finally:
            other.kill()
    finally:
        ctx.stop_side_daemon(STREAM_DAEMON)

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
            "fork_vs_one_resume",
            "s",
            "lower",
            f"sb.fork({CHILDREN}) + exec(true) in every child ÷ one sb.resume() + exec(true) "
            "of the same 256 MiB parent (target <= 3)",
            SampleSet(f"fork({CHILDREN}) until all {CHILDREN} answer", totals),
            SampleSet("sb.resume() + exec(true), 256 MiB", resumes),
        ),
        Metric(
            "fork_rebased_vs_stream",
            "s",
            "lower",
            f"sb.fork({CHILDREN}) of a template clone until all answer: the fork's snapshot "
            "rebased on a memory file (children map it copy-on-write, load state only) ÷ "
            f"the same on a side daemon with {STREAM_ENV} (every child loads the full stream)",
            SampleSet(f"fork({CHILDREN}), rebased", list(totals)),
            SampleSet(f"fork({CHILDREN}), RAM in the stream", stream_totals),
        ),
        Metric(
            f"fork{big_n}_total",
            "s",
            "lower",
            f"sb.fork({big_n}) + exec(true) in every child (one run; reported, no target)",
            SampleSet(f"fork({big_n}) until all {big_n} answer", big),
        ),
        Metric(
            "fork_call",
            "s",
            "lower",
            f"sb.fork({CHILDREN}) alone (returns when every child runs)",
            SampleSet(f"sb.fork({CHILDREN})", fork_calls),
        ),
    ]
    result.notes.append(
        "parent: a template clone; parent and children: 1 vCPU, 256 MiB; children killed "
        "after each run"
    )
    return result
