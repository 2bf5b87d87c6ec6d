"""``exec``: the round trip of ``exec(["true"])`` on one running sandbox."""

from __future__ import annotations

import subprocess

from bench.cases.common import BenchContext, new_sandbox, now
from bench.model import BenchResult, Metric, SampleSet

__all__ = ["run_exec"]

WARMUP = 3


def _host_true() -> float:
    t0 = now()
    subprocess.run(["true"], check=True)
    return now() - t0


def run_exec(ctx: BenchContext) -> BenchResult:
    count = 50
    result = BenchResult(
        "exec",
        "exec round trip for `true`",
        ctx.quick,
        {"execs": count, "warmup": WARMUP, "command": ["true"], **ctx.sandbox_params()},
    )
    hutch: list[float] = []
    host: list[float] = []
    with new_sandbox(ctx) as sb:
        for _ in range(WARMUP):
            sb.exec(["true"])
            _host_true()
        for _ in range(count):
            host.append(_host_true())
            t0 = now()
            answer = sb.exec(["true"])
            hutch.append(now() - t0)
            if answer.exit_code != 0:
                raise RuntimeError(f"exec(['true']) in {sb.id} exited {answer.exit_code}")
    result.metrics = [
        Metric(
            "exec_round_trip",
            "s",
            "lower",
            "sequential sb.exec(['true']) on one sandbox, request to exit status",
            SampleSet("sb.exec(['true'])", hutch),
            SampleSet("subprocess.run(['true']) on the host", host),
        )
    ]
    ctx.log(f"  p50 {result.metrics[0].hutch.summary.p50 * 1e3:.1f} ms")
    return result
