"""The in-flight tracker and gate (hutch.services.activity), deterministic and pure
asyncio; with the real service and agent: tests/component/test_inflight.py, with real
VMs and the daemon: tests/e2e/test_inflight_auth.py."""

from __future__ import annotations

import asyncio

import pytest

from hutch.errors import Busy, Conflict
from hutch.services.activity import InFlight, describe_command

SB = "sb-0123456789ab"


async def test_quiesce_waits_for_calls_inside_then_runs() -> None:
    inflight = InFlight()
    work = inflight.begin(SB, "exec 'sleep 3'")
    inflight.admit(work)
    order: list[str] = []

    async def lifecycle() -> None:
        async with inflight.quiesce(SB, "pause", 5.0):
            order.append("paused")

    task = asyncio.create_task(lifecycle())
    await asyncio.sleep(0.05)
    assert order == [] and not inflight.is_open(SB)
    order.append("exec done")
    inflight.end(work)
    await task
    assert order == ["exec done", "paused"] and inflight.is_open(SB)


async def test_busy_names_what_still_runs_and_cuts_nothing() -> None:
    now = [100.0]
    inflight = InFlight(clock=lambda: now[0])
    long = inflight.begin(SB, describe_command(["sleep", "300"]))
    inflight.admit(long)
    now[0] += 42
    with pytest.raises(Busy) as caught:
        async with inflight.quiesce(SB, "snapshot", 0.05):
            raise AssertionError("must not run")
    msg = caught.value.message
    assert isinstance(caught.value, Conflict) and caught.value.code == "busy"
    assert "exec 'sleep 300' (running 42 s)" in msg and "snapshot" in msg
    assert "HUTCH_LIFECYCLE_WAIT_S" in msg
    # Nothing was cut: the call is still inside, and the gate is open again.
    assert inflight.inside(SB) == [long] and inflight.is_open(SB)


async def test_calls_arriving_during_a_lifecycle_call_wait_at_the_gate() -> None:
    inflight = InFlight()
    release = asyncio.Event()
    events: list[str] = []

    async def lifecycle() -> None:
        async with inflight.quiesce(SB, "fork", 5.0):
            events.append("fork starts")
            await release.wait()
            events.append("fork ends")

    async def call() -> None:
        work = inflight.begin(SB, "exec 'true'")
        await inflight.wait_open(SB)
        inflight.admit(work)
        events.append("call runs")
        inflight.end(work)

    fork = asyncio.create_task(lifecycle())
    await asyncio.sleep(0)
    waiting = asyncio.create_task(call())
    await asyncio.sleep(0.05)
    # A call waiting at the gate is not inside: it does not hold the fork up.
    assert events == ["fork starts"] and inflight.inside(SB) == []
    release.set()
    await asyncio.gather(fork, waiting)
    assert events == ["fork starts", "fork ends", "call runs"]


async def test_nested_holds_keep_the_gate_closed_until_the_outer_one_ends() -> None:
    inflight = InFlight()
    async with inflight.quiesce(SB, "fork", 1.0):
        async with inflight.quiesce(SB, "pause", 1.0):
            pass
        assert not inflight.is_open(SB)
    assert inflight.is_open(SB)


def test_end_is_idempotent_and_work_never_admitted_counts_for_nothing() -> None:
    inflight = InFlight()
    work = inflight.begin(SB, "exec 'x'")
    inflight.end(work)
    inflight.admit(work)  # ended first: a late admit does not resurrect it
    assert inflight.inside(SB) == []
    inflight.end(work)
    inflight.forget(SB)


def test_long_commands_are_shortened_in_labels() -> None:
    label = describe_command("x" * 500)
    assert label.startswith("exec 'xxx") and label.endswith("...'") and len(label) < 100
