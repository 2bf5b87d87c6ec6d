from __future__ import annotations

import asyncio

import pytest

from hutch.teardown import TeardownError, TeardownStack


async def test_runs_in_reverse_and_continues_past_failures() -> None:
    ran: list[str] = []
    stack = TeardownStack()

    async def undo_async() -> None:
        await asyncio.sleep(0)
        ran.append("tap")

    def boom() -> None:
        ran.append("nft")
        raise OSError("nft gone")

    stack.register("process", lambda: ran.append("process"))
    stack.register("tap", undo_async)
    stack.register("nft", boom)
    stack.register("overlay", lambda: ran.append("overlay"))
    failures = await stack.close()
    assert ran == ["overlay", "nft", "tap", "process"]
    assert [(name, str(exc)) for name, exc in failures] == [("nft", "nft gone")]
    assert stack.closed


async def test_close_twice_and_concurrently_runs_once() -> None:
    calls = 0
    stack = TeardownStack()

    async def slow() -> None:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)

    stack.register("slow", slow)
    await asyncio.gather(stack.close(), stack.close(), stack.close())
    await stack.close()
    assert calls == 1


async def test_raise_errors_and_register_after_close() -> None:
    stack = TeardownStack()
    stack.register("bad", lambda: 1 / 0)
    with pytest.raises(TeardownError, match="bad"):
        await stack.close(raise_errors=True)
    with pytest.raises(RuntimeError, match="already closed"):
        stack.register("late", lambda: None)


async def test_cancelled_caller_does_not_cancel_teardown() -> None:
    done = asyncio.Event()
    stack = TeardownStack()

    async def step() -> None:
        await asyncio.sleep(0.05)
        done.set()

    stack.register("step", step)
    caller = asyncio.create_task(stack.close())
    await asyncio.sleep(0.01)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await stack.close()
    assert done.is_set()
