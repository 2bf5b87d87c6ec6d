"""The benchmarks, in the order a full run executes them."""

from __future__ import annotations

from bench.cases.boot import run_boot, run_create
from bench.cases.common import BenchContext, Benchmark
from bench.cases.exec_rps import run_exec_rps
from bench.cases.exec_rt import run_exec
from bench.cases.files import run_files

__all__ = ["BENCHMARKS", "BenchContext", "Benchmark"]

BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("boot", "cold boot to first command output", run_boot),
        Benchmark("exec", "exec round trip for `true`", run_exec),
        Benchmark("files", "file throughput host<->guest", run_files),
        Benchmark("create", "create -> first command (p50/p95)", run_create),
        Benchmark("exec_rps", "sustained exec req/s across sandboxes", run_exec_rps),
    )
}
