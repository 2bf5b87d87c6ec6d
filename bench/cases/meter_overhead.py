"""``meter_overhead``: the exec round trip with the event log and the meter's request path
(each exec appends its ``sandbox.exec`` event; each request carries its caller) against
the same on a side daemon with ``HUTCH_EVENTS=off``, in the same run, samples
interleaved so that both see the same host.

The meter itself is not on the exec path (it is written with state changes only), and
the API-key check is the same on both daemons: what differs is what recording a request
costs.

The auth side (``exec_round_trip_project_key``, ``request_project_key``): the same sandbox
driven with a project's developer key (its id looked up in the store, the secret's sha256
compared, expiry and revocation checked, the role's permission checked, ``last_used_at``
touched) against the instance's admin key (compared first, in constant time, with no
lookup and no role table: the least a request can be checked with), interleaved on the
main daemon. The lighter request (``GET /v1/sandboxes/{id}``, no guest) shows the check's
share where it is largest.
"""

from __future__ import annotations

from collections.abc import Callable

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


def _timed(call: Callable[[], object]) -> float:
    t0 = now()
    call()
    return now() - t0


def _interleaved(
    count: int, a: Callable[[], float], b: Callable[[], float]
) -> tuple[list[float], list[float]]:
    """``count`` samples of each, alternating which goes first."""
    xs: list[float] = []
    ys: list[float] = []
    for i in range(count):
        if i % 2:
            xs.append(a())
            ys.append(b())
        else:
            ys.append(b())
            xs.append(a())
    return xs, ys


def _auth_metrics(ctx: BenchContext, count: int) -> list[Metric]:
    """A project's developer key against the admin key on one sandbox (same daemon)."""
    base_url = ctx.client.core.base_url
    admin_key = ctx.client.core.config.api_key
    project = f"bench-auth-{int(now() * 1000) % 10**9}"
    ctx.client.projects.create(project)
    created = ctx.client.keys.create("bench", "developer", project=project)
    try:
        with (
            Client(base_url=base_url, api_key=created.secret) as dev,
            Client(base_url=base_url, api_key=admin_key, project=project) as admin,
            _sandbox(ctx, dev) as by_key,
        ):
            by_admin = Sandbox.connect(by_key.id, client=admin)
            for _ in range(WARMUP):
                _exec(by_key)
                _exec(by_admin)
            keyed, plain = _interleaved(count, lambda: _exec(by_key), lambda: _exec(by_admin))
            got_keyed, got_plain = _interleaved(
                count, lambda: _timed(by_key.refresh), lambda: _timed(by_admin.refresh)
            )
    finally:
        ctx.client.keys.revoke(created.id, project=project)
        ctx.client.projects.delete(project)  # nothing left in it: the sandbox is gone
    ctx.log(
        f"  exec p50 project key {SampleSet('k', keyed).summary.p50 * 1e3:.2f} ms, admin key "
        f"{SampleSet('a', plain).summary.p50 * 1e3:.2f} ms; GET p50 "
        f"{SampleSet('k', got_keyed).summary.p50 * 1e3:.2f} ms vs "
        f"{SampleSet('a', got_plain).summary.p50 * 1e3:.2f} ms"
    )
    return [
        Metric(
            "exec_round_trip_project_key",
            "s",
            "lower",
            "sb.exec(['true']) with a developer key (lookup, hash, expiry, role) vs the "
            "admin key (no lookup, no role table)",
            SampleSet("developer key of a project", keyed),
            SampleSet("admin key, same sandbox, same run", plain),
        ),
        Metric(
            "request_project_key",
            "s",
            "lower",
            "GET /v1/sandboxes/{id} with a developer key vs the admin key",
            SampleSet("developer key of a project", got_keyed),
            SampleSet("admin key, same sandbox, same run", got_plain),
        ),
    ]


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
    auth = _auth_metrics(ctx, count)
    result.metrics = [
        *auth,
        Metric(
            "exec_round_trip_recorded",
            "s",
            "lower",
            "sb.exec(['true']) with its exec event appended vs HUTCH_EVENTS=off",
            with_events,
            without,
        ),
    ]
    ctx.log(
        f"  p50 on {with_events.summary.p50 * 1e3:.2f} ms, off {without.summary.p50 * 1e3:.2f} ms"
    )
    return result
