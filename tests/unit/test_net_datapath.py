"""The data path's thread and loop (hutch.net.datapath): what runs there, on which loop."""

from __future__ import annotations

import asyncio
import threading

import pytest
import uvloop

from hutch.errors import NetworkError
from hutch.net.datapath import Datapath


async def test_coroutines_and_functions_run_in_its_own_thread_on_uvloop() -> None:
    dp = Datapath("test-datapath")
    dp.start()
    try:

        async def where() -> tuple[str, type]:
            return threading.current_thread().name, type(asyncio.get_running_loop())

        name, loop_type = await dp.run(where())
        assert name == "test-datapath"
        assert issubclass(loop_type, uvloop.Loop)
        assert await dp.call(lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(ZeroDivisionError):
            await dp.call(lambda: 1 / 0)
    finally:
        await dp.stop()
    assert dp.thread is None


async def test_a_spawned_task_runs_until_stop_and_its_cleanup_runs() -> None:
    dp = Datapath()
    dp.start()
    started, cleaned = threading.Event(), threading.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.set()

    dp.spawn(forever, "forever")
    assert await asyncio.to_thread(started.wait, 5)
    await dp.stop()
    assert cleaned.is_set()
    await dp.stop()  # twice is fine


async def test_a_failing_spawned_task_is_logged_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dp = Datapath()
    dp.start()
    try:

        async def broken() -> None:
            raise RuntimeError("boom")

        dp.spawn(broken, "broken")
        for _ in range(100):
            if "data path task broken failed" in caplog.text:
                break
            await asyncio.sleep(0.01)
        assert "data path task broken failed" in caplog.text
        assert await dp.call(lambda: "still serving") == "still serving"
    finally:
        await dp.stop()


def test_its_loop_before_start_is_an_error() -> None:
    with pytest.raises(NetworkError, match="not running"):
        Datapath().loop  # noqa: B018
