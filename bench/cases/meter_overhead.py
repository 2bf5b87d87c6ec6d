"""``meter_overhead``: the exec round trip with the event log and the meter's request path
(each exec appends its ``sandbox.exec`` event; each request carries its caller) against
the same on a side daemon with ``HUTCH_EVENTS=off``, in the same run, samples
interleaved so that both see the same host.

The meter itself is not on the exec path (it is written with state changes only), and
the API-key check is the same on both daemons: what differs is what recording a request
costs.
"""

from __future__ import annotations

from bench.cases.common import SANDBOX_MEMORY_MIB, SANDBOX_VCPUS, BenchContext, now
from bench.model import BenchResult, Metric, SampleSet
from hutch.sdk import Client, Sandbox

__all__ = ["run_meter_overhead"]

WARMUP = 5
SIDE = "events-off"
SIDE_ENV = {"HUTCH_EVENTS": "off", "HUTCH_TEMPLATES": "0"}


def _exec(sb: Sandbox) -> float:
    t0 = now()
    answer = sb.exec(["true"])
    elapsed = now() - t0
    if answer.exit_code != 0:
        raise RuntimeError(f"exec(['true']) in {sb.id} exited {answer.exit_code}")
    return elapsed


def _sandbox(ctx: BenchContext, client: Client) -> Sandbox:
    return Sandbox.create(
        ctx.image, vcpus=SANDBOX_VCPUS, memory_mib=SANDBOX_MEMORY_MIB, client=client
    )


def run_meter_overhead(ctx: BenchContext) -> BenchResult:
    count = 20 if ctx.quick else 100
    result = BenchResult(
        "meter_overhead",
        "exec round trip: event log on vs off (same run)",
        ctx.quick,
        {"execs": count, "warmup": WARMUP, "command": ["true"], "side_env": SIDE_ENV,
         **ctx.sandbox_params()},
    )  # fmt: skip
    on: list[float] = []
    off: list[float] = []
    try:
        side = ctx.side_daemon(SIDE, SIDE_ENV)
        with _sandbox(ctx, ctx.client) as a, _sandbox(ctx, side.client) as b:
            for _ in range(WARMUP):
                _exec(a)
                _exec(b)
            for i in range(count):
                # Alternate which goes first: neither always follows the other's exec.
                if i % 2:
                    on.append(_exec(a))
                    off.append(_exec(b))
                else:
                    off.append(_exec(b))
                    on.append(_exec(a))
            events = ctx.client.sandbox_events(a.id, types="sandbox.exec", limit=1000).events
            if len(events) < count:
                raise RuntimeError(f"expected {count} exec events, found {len(events)}")
    finally:
        ctx.stop_side_daemon(SIDE)
    with_events = SampleSet("events on (the default)", on)
    without = SampleSet("HUTCH_EVENTS=off, same run", off)
    result.metrics = [
        Metric(
            "exec_round_trip_recorded",
            "s",
            "lower",
            "sb.exec(['true']) with its exec event appended vs HUTCH_EVENTS=off",
            with_events,
            without,
        )
    ]
    ctx.log(
        f"  p50 on {with_events.summary.p50 * 1e3:.2f} ms, off {without.summary.p50 * 1e3:.2f} ms"
    )
    return result
