"""BackgroundUploads, the retry skeleton ImageBlobs, SnapshotBlobs and SandboxMoves share:
one task per key, retried after a failure while wanted, cancelled on close, stopped at
its next part (its thread waited for), schedulable from a worker thread. Attempts are
plain coroutines driven by events, or threads that ask ``stopping`` as a progress
callback does (no store: the blob services' own tests run it against real ones); the
retry delays are injected tiny."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading

import pytest

from hutch.errors import BlobError
from hutch.services.background_uploads import RETRY_S, BackgroundUploads

log = logging.getLogger("tests.background_uploads")
TINY = (0.001, 0.002)
DEADLINE_S = 10.0


class Attempts:
    """An ``attempt`` that fails the first ``failures`` calls, then, with ``hold``, waits
    for ``release`` before succeeding."""

    def __init__(self, failures: int = 0, *, hold: bool = False) -> None:
        self.failures = failures
        self.calls: list[str] = []
        self.threads: list[int] = []
        self.done: list[str] = []
        self.release = asyncio.Event()
        self.entered = asyncio.Event()
        self.entered_by: collections.defaultdict[str, asyncio.Event] = collections.defaultdict(
            asyncio.Event
        )
        if not hold:
            self.release.set()

    async def __call__(self, key: str) -> None:
        self.calls.append(key)
        self.threads.append(threading.get_ident())
        self.entered.set()
        self.entered_by[key].set()
        if len(self.calls) <= self.failures:
            raise BlobError(f"store away (call {len(self.calls)})")
        await self.release.wait()
        self.done.append(key)


def uploads(attempt: Attempts, wanted: set[str] | None = None) -> BackgroundUploads[str]:
    return BackgroundUploads(
        "thing",
        attempt,
        (lambda key: True) if wanted is None else (lambda key: key in wanted),
        key=lambda key: key,
        log=log,
        task_prefix="test-upload-",
        retry_s=TINY,
    )


async def test_a_key_under_way_is_spawned_once() -> None:
    attempt = Attempts(hold=True)
    up = uploads(attempt)
    up.schedule("a")
    up.schedule("a")
    await asyncio.wait_for(attempt.entered.wait(), DEADLINE_S)
    up.schedule("a")
    assert up.running("a")
    attempt.release.set()
    await up.wait("a")
    assert attempt.calls == ["a"] and attempt.done == ["a"]
    assert not up.running("a")
    # Done: a later schedule uploads again (the attempt itself knows "already there").
    up.schedule("a")
    await up.wait("a")
    assert attempt.calls == ["a", "a"]


async def test_a_failed_attempt_is_retried_until_it_succeeds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    attempt = Attempts(failures=3)
    up = uploads(attempt)
    with caplog.at_level(logging.WARNING, logger=log.name):
        up.schedule("a")
        await up.wait("a")
    assert attempt.calls == ["a"] * 4 and attempt.done == ["a"]
    warnings = [r.getMessage() for r in caplog.records if r.name == log.name]
    assert len(warnings) == 3
    assert warnings[0] == "thing a: upload failed (retry in 0 s): store away (call 1)"


async def test_retries_stop_once_the_item_is_no_longer_wanted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    wanted = {"a"}

    class Forgetting(Attempts):
        async def __call__(self, key: str) -> None:
            if len(self.calls) == 1:
                wanted.discard(key)  # deleted during its second attempt
            await super().__call__(key)

    attempt = Forgetting(failures=100)
    up = uploads(attempt, wanted)
    with caplog.at_level(logging.WARNING, logger=log.name):
        up.schedule("a")
        await up.wait("a")
    assert attempt.calls == ["a", "a"] and attempt.done == []
    # The failure after the delete is not one to retry: no "retry in" for it.
    assert len([r for r in caplog.records if r.name == log.name]) == 1
    # Never wanted: never attempted.
    up.schedule("b")
    await up.wait("b")
    assert attempt.calls == ["a", "a"]


async def test_an_unexpected_error_ends_the_upload_without_a_retry() -> None:
    calls: list[str] = []

    async def broken(key: str) -> None:
        calls.append(key)
        raise RuntimeError("a bug")

    up = BackgroundUploads(
        "thing", broken, lambda key: True, key=lambda k: k, log=log, task_prefix="t-", retry_s=TINY
    )
    up.schedule("a")
    with pytest.raises(RuntimeError, match="a bug"):
        await up.wait("a")
    assert calls == ["a"]


async def test_close_cancels_what_is_under_way_and_refuses_new_work() -> None:
    attempt = Attempts(hold=True)
    failing = Attempts(failures=10**6)  # forever waiting to retry
    up, up2 = uploads(attempt), uploads(failing)
    up.schedule("a")
    up2.schedule("b")
    await asyncio.wait_for(attempt.entered.wait(), DEADLINE_S)
    await asyncio.wait_for(failing.entered.wait(), DEADLINE_S)
    await up.close()
    await up2.close()
    assert up.closed and not up.running("a") and not up2.running("b")
    assert attempt.done == []
    up.schedule("c")
    assert not up.running("c") and attempt.calls == ["a"]


async def test_cancel_stops_one_key_and_leaves_the_others() -> None:
    attempt = Attempts(hold=True)
    up = uploads(attempt)
    up.schedule("a")
    up.schedule("b")
    for key in ("a", "b"):
        await asyncio.wait_for(attempt.entered_by[key].wait(), DEADLINE_S)
    waiter = asyncio.create_task(up.wait("a"))
    await asyncio.sleep(0)  # the waiter waits
    await up.cancel("a")
    await asyncio.wait_for(waiter, DEADLINE_S)  # its waiter returns: no CancelledError
    assert not up.running("a") and up.running("b")
    attempt.release.set()
    await up.wait("b")
    assert attempt.done == ["b"]
    await up.cancel("gone")  # nothing under way: a no-op


async def test_a_cancelled_waiter_leaves_the_upload_running() -> None:
    attempt = Attempts(hold=True)
    up = uploads(attempt)
    up.schedule("a")
    waiter = asyncio.create_task(up.wait("a"))
    await asyncio.wait_for(attempt.entered.wait(), DEADLINE_S)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert up.running("a")
    attempt.release.set()
    await up.wait("a")
    assert attempt.done == ["a"]


async def test_schedule_from_another_thread_runs_on_the_loop() -> None:
    attempt = Attempts()
    up = uploads(attempt)
    # No loop known yet: from a thread there is nothing to hand it to.
    await asyncio.to_thread(up.schedule, "early")
    assert not up.started
    up.start()
    await asyncio.to_thread(up.schedule, "a")
    await asyncio.wait_for(attempt.entered.wait(), DEADLINE_S)
    await up.wait("a")
    assert attempt.calls == ["a"]
    assert attempt.threads == [threading.get_ident()]  # the loop's thread ran it


def test_the_default_backoff_and_an_empty_one() -> None:
    assert RETRY_S == (2.0, 5.0, 15.0, 60.0)
    with pytest.raises(ValueError):
        BackgroundUploads(
            "t", Attempts(), lambda k: True, key=lambda k: k, log=log, task_prefix="t-", retry_s=()
        )


class Parts:
    """An attempt whose blocking part runs in a thread, as the blob services' do: it
    sends "parts" until ``stopping`` says so (the progress callback's question) or
    ``finish`` is set, and records which ended it."""

    def __init__(self, failures: int = 0) -> None:
        self.up: BackgroundUploads[str] | None = None
        self.failures = failures
        self.calls = 0
        self.in_thread = threading.Event()
        self.finish = threading.Event()
        self.failed = asyncio.Event()
        self.ended: list[str] = []

    def _send(self, key: str) -> None:
        assert self.up is not None
        self.in_thread.set()
        while not self.finish.wait(0.001):
            if self.up.stopping(key):
                self.ended.append("stopped")
                raise BlobError(f"the upload of {key} was stopped")
        self.ended.append("sent")

    async def __call__(self, key: str) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            self.failed.set()
            raise BlobError(f"store away (call {self.calls})")
        await asyncio.to_thread(self._send, key)


def parts_uploads(
    attempt: Parts, retry_s: tuple[float, ...] = TINY, **kw: str
) -> BackgroundUploads[str]:
    up = BackgroundUploads(
        "thing",
        attempt,
        lambda key: True,
        key=lambda key: key,
        log=log,
        task_prefix="test-upload-",
        retry_s=retry_s,
        **kw,
    )
    attempt.up = up
    return up


async def test_stop_ends_the_attempt_at_its_next_part_and_waits_for_its_thread() -> None:
    attempt = Parts()
    up = parts_uploads(attempt)
    up.schedule("a")
    up.schedule("b")
    await asyncio.to_thread(attempt.in_thread.wait, DEADLINE_S)
    assert not up.stopping("a")
    await up.stop("a")
    # The thread has ended (not merely the task): what it read may change now.
    assert attempt.ended == ["stopped"] and not up.running("a")
    assert up.running("b") and not up.stopping("b")  # the others go on
    # No retry after a stop; a later schedule is a new upload.
    attempt.finish.set()
    await up.wait("b")
    up.schedule("a")
    await up.wait("a")
    assert attempt.calls == 3 and sorted(attempt.ended) == ["sent", "sent", "stopped"]
    await up.stop("gone")  # nothing under way: a no-op


async def test_stop_ends_an_upload_waiting_to_retry_at_once() -> None:
    attempt = Parts(failures=1)
    up = parts_uploads(attempt, retry_s=(3600.0,))  # the retry would be an hour away
    up.schedule("a")
    # Woken once the failed task is in its sleep before the retry (the same step).
    await asyncio.wait_for(attempt.failed.wait(), DEADLINE_S)
    await asyncio.wait_for(up.stop("a"), DEADLINE_S)
    assert not up.running("a") and attempt.calls == 1 and attempt.ended == []


async def test_close_is_seen_by_the_attempt_thread_as_stopping() -> None:
    attempt = Parts()
    up = parts_uploads(attempt)
    up.schedule("a")
    await asyncio.to_thread(attempt.in_thread.wait, DEADLINE_S)
    await up.close()
    assert up.stopping("a") and up.stopping("never-scheduled")


async def test_wait_with_a_timeout_returns_and_leaves_the_upload_running(
    caplog: pytest.LogCaptureFixture,
) -> None:
    attempt = Parts(failures=1)
    up = parts_uploads(attempt, what="pause upload")
    with caplog.at_level(logging.WARNING, logger=log.name):
        up.schedule("a")
        await asyncio.to_thread(attempt.in_thread.wait, DEADLINE_S)
        await up.wait("a", timeout_s=0.01)
    assert up.running("a")
    # ``what`` names the upload in the failure's line.
    warnings = [r.getMessage() for r in caplog.records if r.name == log.name]
    assert warnings == ["thing a: pause upload failed (retry in 0 s): store away (call 1)"]
    attempt.finish.set()
    await up.wait("a", timeout_s=DEADLINE_S)
    assert not up.running("a") and attempt.ended == ["sent"]
