"""Threads that serve requests, kept for the next one instead of started per request.

Every request runs in a thread of its own (a command's output pump, a terminal, a file
watch may each run for hours), so the agent cannot use a fixed-size pool. Under TCG a
thread start is a few milliseconds of translated clone/mmap/futex work, paid on every
exec; a thread that finished a request therefore waits ``IDLE_S`` for another before it
exits. There are never more threads than requests in flight plus those idle ones.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["IDLE_S", "Workers"]

#: How long a finished worker waits for the next request before its thread exits.
IDLE_S = 30.0

Job = Callable[[], None]


class _Worker:
    def __init__(self) -> None:
        self.job: Job | None = None
        self.name = ""
        self.wake = threading.Event()


class Workers:
    def __init__(self, idle_s: float = IDLE_S) -> None:
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self.started = 0  # threads ever started (tests read it)

    def run(self, job: Job, name: str) -> None:
        """Run ``job`` in an idle worker, or in a new thread named ``name``."""
        with self._lock:
            worker = self._idle.pop() if self._idle else None
            if worker is not None:
                worker.job, worker.name = job, name
                worker.wake.set()
                return
            self.started += 1
        worker = _Worker()
        worker.job, worker.name = job, name
        threading.Thread(target=self._loop, args=(worker,), name=name, daemon=True).start()

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def _loop(self, worker: _Worker) -> None:
        while True:
            job, worker.job = worker.job, None
            if job is not None:
                threading.current_thread().name = worker.name  # what the agent's log shows
                job()  # the job handles its own errors (Agent.serve)
            with self._lock:
                worker.wake.clear()
                self._idle.append(worker)
            if worker.wake.wait(self.idle_s):
                continue
            with self._lock:
                if worker.wake.is_set():
                    continue  # handed a job as the wait ran out
                self._idle.remove(worker)
                return
