"""``exec_rps``: sustained ``exec(["true"])`` requests per second across several
sandboxes, driven by a fixed number of asyncio workers through one ``AsyncClient``.

The host baseline (``true`` spawned by the same number of workers for the same time) is
measured *before* the sandboxes exist: idle TCG guests still take CPU, and charging that
to the baseline would flatter hutch.
"""

from __future__ import annotations

import asyncio
import time

from bench.baselines import spawn_load
from bench.cases.common import SANDBOX_MEMORY_MIB, SANDBOX_VCPUS, BenchContext
from bench.model import BenchResult, Metric, SampleSet
from hutch import AsyncSandbox, HutchError
from hutch.sdk import AsyncClient

__all__ = ["run_exec_rps"]

#: Creates run at most this many at once: TCG boots are CPU-bound on a 2-core host.
CREATE_CONCURRENCY = 2


class _Load:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.finish_times: list[float] = []
        self.errors: list[str] = []


async def _create_all(ctx: BenchContext, client: AsyncClient, count: int) -> list[AsyncSandbox]:
    gate = asyncio.Semaphore(CREATE_CONCURRENCY)
    made: list[AsyncSandbox] = []

    async def one() -> None:
        async with gate:
            sb = await AsyncSandbox.create(
                ctx.image, vcpus=SANDBOX_VCPUS, memory_mib=SANDBOX_MEMORY_MIB, client=client
            )
            made.append(sb)  # registered before anything else can fail: it gets killed
            await sb.exec(["true"])

    outcomes = await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    if failures:
        await asyncio.gather(*(sb.kill() for sb in made), return_exceptions=True)
        raise RuntimeError(f"{len(failures)} of {count} creates failed: {failures[0]!r}")
    return made


async def _drive(sandboxes: list[AsyncSandbox], workers: int, duration_s: float) -> _Load:
    load = _Load()
    start = time.perf_counter()
    deadline = start + duration_s

    async def worker(index: int) -> None:
        sb = sandboxes[index % len(sandboxes)]
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            try:
                answer = await sb.exec(["true"])
            except HutchError as exc:
                load.errors.append(f"{sb.id}: {exc}")
                continue
            t1 = time.perf_counter()
            if answer.exit_code != 0:
                load.errors.append(f"{sb.id}: exit {answer.exit_code}")
                continue
            load.latencies.append(t1 - t0)
            load.finish_times.append(t1 - start)

    await asyncio.gather(*(worker(i) for i in range(workers)))
    return load


def _per_second(finish_times: list[float], duration_s: float) -> list[float]:
    """Completions in each whole second of the run (the spread of the rate)."""
    buckets = [0.0] * max(1, int(duration_s))
    for t in finish_times:
        if t < len(buckets):
            buckets[int(t)] += 1
    return buckets


async def _run(ctx: BenchContext, result: BenchResult) -> None:
    n_sandboxes = int(result.params["sandboxes"])
    workers = int(result.params["workers"])
    duration = float(result.params["duration_s"])
    ctx.log(f"  host baseline: {workers} workers spawning `true` for {duration:.0f} s")
    base = await spawn_load(["true"], workers, duration)
    async with AsyncClient(base_url=ctx.daemon.base_url, api_key=ctx.daemon.api_key) as client:
        ctx.log(f"  creating {n_sandboxes} sandboxes")
        sandboxes = await _create_all(ctx, client, n_sandboxes)
        try:
            ctx.log(f"  {workers} workers exec'ing `true` for {duration:.0f} s")
            load = await _drive(sandboxes, workers, duration)
        finally:
            await asyncio.gather(*(sb.kill() for sb in sandboxes), return_exceptions=True)
    elapsed = max(load.finish_times, default=duration)
    rate = len(load.latencies) / elapsed if elapsed > 0 else 0.0
    ctx.log(f"  hutch {rate:.1f} req/s, host {base.rate:.0f} spawns/s")
    if not load.latencies:
        raise RuntimeError(f"no exec succeeded; errors: {load.errors[:3]}")
    result.metrics = [
        Metric(
            "exec_rps",
            "req/s",
            "higher",
            "completed exec(['true']) per second over the run (samples: per-second counts)",
            SampleSet(
                f"exec(['true']) across {n_sandboxes} sandboxes",
                _per_second(load.finish_times, duration),
                value=rate,
            ),
            SampleSet(
                "host `true` spawns at the same concurrency",
                _per_second(base.finish_times, duration),
                value=base.rate,
            ),
        ),
        Metric(
            "exec_latency_under_load",
            "s",
            "lower",
            "latency of each exec(['true']) during the run",
            SampleSet("exec(['true']) under load", load.latencies),
            SampleSet("host `true` spawn under the same concurrency", base.latencies),
        ),
    ]
    result.params["completed"] = len(load.latencies)
    result.params["baseline_completed"] = base.completed
    if load.errors:
        result.notes.append(f"{len(load.errors)} exec errors, first: {load.errors[0]}")


def run_exec_rps(ctx: BenchContext) -> BenchResult:
    result = BenchResult(
        "exec_rps",
        "sustained exec requests per second across sandboxes",
        ctx.quick,
        {
            "sandboxes": 3 if ctx.quick else 10,
            "workers": 3 if ctx.quick else 10,
            "duration_s": 5.0 if ctx.quick else 20.0,
            "command": ["true"],
            **ctx.sandbox_params(),
        },
    )
    asyncio.run(_run(ctx, result))
    return result
