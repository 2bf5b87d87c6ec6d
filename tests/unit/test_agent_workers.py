"""The agent's request threads (``hutch_agent.workers``): a finished one serves the next
request, concurrent requests each get their own, and idle ones exit."""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

AGENT_DIR = str(Path(__file__).resolve().parents[2] / "guest_agent")
if AGENT_DIR not in sys.path:
    sys.path.insert(0, AGENT_DIR)

from hutch_agent.workers import Workers  # noqa: E402


def _until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_a_finished_worker_serves_the_next_request() -> None:
    workers = Workers(idle_s=30)
    names: list[str] = []
    for i in range(5):
        done = threading.Event()

        def job(done: threading.Event = done) -> None:
            names.append(threading.current_thread().name)
            done.set()

        workers.run(job, name=f"exec-{i}")
        assert done.wait(10)
        _until(lambda: workers.idle() == 1)
    assert workers.started == 1
    # The thread takes each request's name, so the agent's log names the request.
    assert names == [f"exec-{i}" for i in range(5)]


def test_concurrent_requests_get_threads_of_their_own() -> None:
    workers = Workers(idle_s=30)
    release = threading.Event()
    running = threading.Semaphore(0)

    def job() -> None:
        running.release()
        release.wait(10)

    for i in range(4):
        workers.run(job, name=f"pty-{i}")
    for _ in range(4):
        assert running.acquire(timeout=10)  # all four at once: none waits for another
    assert workers.started == 4
    release.set()
    _until(lambda: workers.idle() == 4)


def test_idle_workers_exit() -> None:
    workers = Workers(idle_s=0.05)
    workers.run(lambda: None, name="exec-1")
    _until(lambda: workers.started == 1 and workers.idle() == 0 and _named("exec-1") == 0)


def test_every_job_runs_once_while_workers_come_and_go() -> None:
    # An idle time near the gap between requests: hand-outs race the workers' exits.
    workers = Workers(idle_s=0.001)
    ran: list[int] = []
    lock = threading.Lock()

    def job(i: int) -> None:
        with lock:
            ran.append(i)

    for i in range(300):
        workers.run(functools.partial(job, i), name="churn")
        if i % 7 == 0:
            time.sleep(0.002)
    _until(lambda: len(ran) == 300)
    assert sorted(ran) == list(range(300))


def _named(name: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name == name)
