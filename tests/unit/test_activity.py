"""Leases (hutch.services.activity): activity and calls in flight are held by what the
services return and released once, however a call ends; the REST routes keep no books.
With the real agent and the REST app: tests/component/test_inflight.py."""

from __future__ import annotations

import ast
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from hutch.errors import NotFound
from hutch.models import SandboxRecord, SandboxState, Shape
from hutch.services.activity import Activity, LeasedBytes

SB = "sb-0123456789ab"
API = Path(__file__).resolve().parents[2] / "src" / "hutch" / "api"


def rec() -> SandboxRecord:
    return SandboxRecord(
        id=SB, image="base", state=SandboxState.RUNNING, shape=Shape(), created_at=0.0
    )


def test_a_lease_keeps_the_sandbox_busy_until_released_once() -> None:
    now = [100.0]
    activity = Activity(clock=lambda: now[0])
    lease = activity.work(SB, "exec 'x'")
    lease.admit()
    assert activity.inflight.inside(SB) == [lease.work]
    now[0] = 200.0
    assert activity.idle_for(rec(), now[0]) == 0.0
    lease.release()
    lease.release()  # idempotent: the count does not go below what is held
    assert activity.inflight.inside(SB) == []
    now[0] = 230.0
    assert activity.idle_for(rec(), now[0]) == 30.0
    with activity.busy(SB):
        assert activity.idle_for(rec(), now[0]) == 0.0
    assert activity.idle_for(rec(), now[0]) == 0.0  # released just now


def test_a_short_call_is_in_flight_but_no_activity() -> None:
    activity = Activity(clock=lambda: 50.0)
    with activity.call(SB, "stat /") as lease:
        lease.admit()
        assert activity.inflight.inside(SB) == [lease.work]
        assert activity.idle_for(rec(), 60.0) == 60.0
    assert activity.inflight.inside(SB) == []


async def _chunks(*items: bytes | Exception) -> AsyncIterator[bytes]:
    for item in items:
        if isinstance(item, Exception):
            raise item
        yield item


async def test_a_leased_stream_releases_with_its_last_byte() -> None:
    activity = Activity(clock=time.time)
    lease = activity.work(SB, "file download /x")
    lease.admit()
    stream = await LeasedBytes.open(_chunks(b"a", b"b"), lease)
    assert [c async for c in stream] == [b"a", b"b"]
    assert lease.released and activity.inflight.inside(SB) == []


async def test_a_leased_stream_releases_when_its_first_chunk_fails_or_it_is_closed() -> None:
    activity = Activity(clock=time.time)
    lease = activity.work(SB, "file download /missing")
    with pytest.raises(NotFound):
        await LeasedBytes.open(_chunks(NotFound("no /missing")), lease)
    assert lease.released
    lease = activity.work(SB, "file download /x")
    stream = await LeasedBytes.open(_chunks(b"a", b"b", b"c"), lease)
    assert await anext(stream) == b"a"
    assert not lease.released
    await stream.aclose()
    assert lease.released


#: What a route would call to keep books of activity or calls in flight (reading a
#: field of the same name, such as a terminal's ``attached``, is no bookkeeping).
BOOKKEEPING = {"activity", "busy", "work", "begin_work", "end_work", "attached", "in_use"}


def _bookkeeping(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "inflight":
            found.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in BOOKKEEPING
        ):
            found.add(node.func.attr)
    return found


@pytest.mark.parametrize("path", sorted(API.rglob("*.py")), ids=lambda p: p.name)
def test_the_rest_routes_keep_no_books(path: Path) -> None:
    assert not _bookkeeping(path), f"{path.name} tracks activity itself"


def test_the_bookkeeping_check_can_fail(tmp_path: Path) -> None:
    module = tmp_path / "route.py"
    module.write_text(
        "work = svc.begin_work(sid, 'x')\nwith procs.attached(sid):\n    pass\n"
        "n = svc.inflight.inside(sid)\nok = info.attached\n"
    )
    assert _bookkeeping(module) == {"begin_work", "attached", "inflight"}
