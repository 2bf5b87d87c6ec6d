"""Uploads to the blob store that run in the background until done
(:class:`BackgroundUploads`): the one skeleton images (``image_blobs``), named
snapshots (``snapshot_blobs``) and paused sandboxes (``moves``) share.

Each item is keyed by a string (a digest, a snapshot id); scheduling a key whose upload
is under way does nothing. An upload is one ``attempt(item)`` (a coroutine; blocking
work goes through ``asyncio.to_thread`` inside it) repeated after each failure
(``HutchError`` or ``OSError``) with a growing delay (``RETRY_S``: 2, 5, 15, then every
60 s), for as long as ``wanted(item)`` holds (asked before each attempt and after each
failure: a deleted image or snapshot stops its retries) and the uploads are not closed.
Any other exception ends the task (a bug, not a store away). ``close`` cancels every
upload under way and waits for them; an attempt's thread, which cannot be cancelled,
is told through :attr:`BackgroundUploads.closed` (its ``put`` progress callback asks).

Stopping one upload: ``cancel(key)`` ends its task at once (the attempt's thread, if
any, runs on until it looks at its own flags); ``stop(key)`` is for a caller about to
change the files the upload reads (a paused sandbox resuming): the attempt under way is
told through :meth:`BackgroundUploads.stopping` (asked by its progress callback at
each part) and waited for, thread included; an upload waiting to retry ends at once.

Threads: :meth:`BackgroundUploads.schedule` may be called from any thread once an event
loop is known (:meth:`BackgroundUploads.start`, or the first ``schedule`` made on a
loop); from another thread it hands the spawn to that loop (``call_soon_threadsafe``),
before any loop is known it does nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from hutch.errors import HutchError

__all__ = ["RETRY_S", "BackgroundUploads"]

#: Seconds between attempts: the n-th failure waits ``RETRY_S[n]``, the last one after.
RETRY_S: tuple[float, ...] = (2.0, 5.0, 15.0, 60.0)

T = TypeVar("T")


@dataclasses.dataclass
class _Upload:
    """One key's upload task and what ``stop`` tells it."""

    task: asyncio.Task[None]
    #: ``stop`` was called: the attempt ends at its next part, no retry follows.
    stopping: bool = False
    #: An attempt runs (else the task has yet to start one, or sleeps before a retry).
    attempting: bool = False


class BackgroundUploads(Generic[T]):
    """One background upload task per key, retried until done, unwanted or closed."""

    def __init__(
        self,
        kind: str,
        attempt: Callable[[T], Awaitable[None]],
        wanted: Callable[[T], bool],
        key: Callable[[T], str],
        *,
        log: logging.Logger,
        task_prefix: str,
        retry_s: Sequence[float] = RETRY_S,
        what: str = "upload",
    ) -> None:
        """``kind`` names the items in log lines ("image", "snapshot"); ``wanted`` is
        called on the event loop (keep it cheap); ``task_prefix`` + key names each task;
        ``retry_s``: the delays (seconds, at least one), tests pass tiny ones; ``what``
        the upload in its failure's log line ("<kind> <key>: <what> failed ...")."""
        if not retry_s:
            raise ValueError("BackgroundUploads needs at least one retry delay")
        self.kind = kind
        self._attempt = attempt
        self._wanted = wanted
        self._key = key
        self._log = log
        self._task_prefix = task_prefix
        self._retry_s = tuple(retry_s)
        self._what = what
        self._uploads: dict[str, _Upload] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        """``close`` was called: nothing new starts, threads under way should stop."""
        return self._closed

    @property
    def started(self) -> bool:
        """An event loop is known (``schedule`` from another thread works)."""
        return self._loop is not None

    def running(self, key: str) -> bool:
        """The upload of ``key`` is under way (or waiting to retry)."""
        return key in self._uploads

    def stopping(self, key: str) -> bool:
        """The upload of ``key`` is to end at its next part: ``stop(key)`` or ``close``
        was called. Callable from the attempt's thread (its progress callback)."""
        upload = self._uploads.get(key)
        return self._closed or (upload is not None and upload.stopping)

    def start(self) -> None:
        """On the event loop: remember it, for ``schedule`` from worker threads."""
        self._loop = asyncio.get_running_loop()

    def schedule(self, item: T) -> None:
        """Upload ``item`` in the background unless its upload is under way; callable
        from any thread (see the module docstring); a no-op once closed."""
        if self._closed:
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None and self._loop is None:
            self._loop = running
        if self._loop is None:
            return  # no loop yet to run it on
        if running is self._loop:
            self._spawn(item)
        else:
            self._loop.call_soon_threadsafe(self._spawn, item)

    def _spawn(self, item: T) -> None:
        key = self._key(item)
        if self._closed or key in self._uploads:
            return
        task = asyncio.create_task(self._until_done(item), name=f"{self._task_prefix}{key}")
        self._uploads[key] = _Upload(task)
        task.add_done_callback(lambda _t: self._uploads.pop(key, None))

    async def wait(self, key: str, timeout_s: float | None = None) -> None:
        """Until the upload of ``key`` under way (if any) has ended, or ``timeout_s`` has
        passed (None: no limit; the upload goes on, as it does when the waiter is
        cancelled). Raises what ended the upload, if not the upload's own failures or a
        cancellation: a bug."""
        upload = self._uploads.get(key)
        if upload is None:
            return
        task = upload.task
        await asyncio.wait({task}, timeout=timeout_s)
        bug = task.exception() if task.done() and not task.cancelled() else None
        if bug is not None:
            raise bug

    async def stop(self, key: str) -> None:
        """End the upload of ``key`` (if any) at its next part, and wait until it has
        ended, its attempt's thread included: the caller may then change what it read.
        An upload waiting to retry ends at once. Until it has ended, a ``schedule`` of
        ``key`` does nothing (its upload is under way); after, it starts a new one."""
        upload = self._uploads.get(key)
        if upload is None:
            return
        upload.stopping = True
        if not upload.attempting:
            upload.task.cancel()  # nothing in flight: not worth the wait for a retry
        await asyncio.gather(upload.task, return_exceptions=True)

    async def cancel(self, key: str) -> None:
        """Cancel the upload of ``key`` (if any) and wait until its task has ended (its
        attempt's thread may run on: it learns of a delete from its own flags)."""
        upload = self._uploads.get(key)
        if upload is not None:
            upload.task.cancel()
            await asyncio.gather(upload.task, return_exceptions=True)

    async def close(self) -> None:
        """Cancel every upload under way and wait for them; ``schedule`` is a no-op
        from now on."""
        self._closed = True
        tasks = [upload.task for upload in self._uploads.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _until_done(self, item: T) -> None:
        key = self._key(item)
        upload = self._uploads[key]
        failures = 0
        while not self._closed and not upload.stopping:
            if not self._wanted(item):
                return  # deleted meanwhile: nothing to upload
            upload.attempting = True
            try:
                await self._attempt(item)
                return
            except (HutchError, OSError) as exc:
                failure: HutchError | OSError = exc
            finally:
                upload.attempting = False
            if upload.stopping or not self._wanted(item):
                return
            delay = self._retry_s[min(failures, len(self._retry_s) - 1)]
            failures += 1
            self._log.warning(
                "%s %s: %s failed (retry in %.0f s): %s", self.kind, key, self._what, delay, failure
            )
            await asyncio.sleep(delay)
