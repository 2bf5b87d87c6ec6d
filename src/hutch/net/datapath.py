"""The data path's own thread and asyncio loop.

The resolver, the SNI/Host proxy, the NFLOG reader and the counter poll serve what the
guests send, and a guest decides how much that is. They run in this loop, in a thread of
their own, so that a guest flooding its resolver keeps *this* loop busy while the API's
loop (exec, files, lifecycle of every other sandbox) goes on. Why a thread and not a
process: the servers share the networking state (who is behind an address, the
egress log, the learned-address sets) and are cheap per packet once the rate limits and the
kernel ceiling hold a flood back (:mod:`hutch.net.ratelimit`, :mod:`hutch.net.nft`); the
numbers are in ``bench/`` (``dns_flood``) and ARCHITECTURE.md.

The loop is uvloop's (libuv under the asyncio API), not the standard library's: a
proxied connection is a dozen loop turns (accept, sniff, connect, relay, two closes),
and uvloop runs them in about half the CPU (``python -m bench.proxy_cpu``: ~0.57 ms
of the thread's CPU per plain-HTTP connection with the standard loop, ~0.3 ms with
uvloop), which on a host whose cores the guests' vCPUs share is latency the guest
sees. The API's loop is not this one and stays the standard library's.

From the API's loop::

    dp = Datapath(); dp.start()
    port = await dp.run(resolver.start())   # run a coroutine there, await its result
    cut = await dp.call(proxy.revalidate, sid, policy)  # a plain function, there
    dp.spawn(reader, "hutch-nflog")         # a background task there: reader()
    await dp.stop()                         # cancel its tasks, end the thread

What runs there must not touch the API loop's objects (asyncio locks, futures); plain
data shared with the API's thread is either replaced whole (dicts published by
assignment) or guarded by a lock (:class:`hutch.net.egress_log.EgressLog`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import uvloop

from hutch.errors import NetworkError

__all__ = ["Datapath"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long stop() waits for the thread to finish its tasks' cleanup.
_STOP_TIMEOUT_S = 10.0


class Datapath:
    """One thread running one event loop (see the module docstring). ``stop()`` is
    safe to call twice and before ``start()``."""

    def __init__(self, name: str = "hutch-datapath") -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._spawned: set[concurrent.futures.Future[Any]] = set()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise NetworkError("the data path's loop is not running")
        return self._loop

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def start(self) -> None:
        """Start the thread and return once its loop runs. Idempotent."""
        if self._thread is not None:
            return
        ready = threading.Event()

        def main() -> None:
            loop = uvloop.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            ready.set()
            try:
                loop.run_forever()
            finally:
                _finish(loop)

        self._thread = threading.Thread(target=main, name=self.name, daemon=True)
        self._thread.start()
        ready.wait()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` in the data path's loop and return (or raise) what it does.
        Cancelling the caller cancels it there too."""
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except BaseException:
            coro.close()
            raise
        return await asyncio.wrap_future(future)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Call the plain function ``fn(*args)`` in the data path's loop (between its
        callbacks, so it sees that loop's objects in a consistent state) and return
        what it returns."""

        async def there() -> T:
            return fn(*args)

        return await self.run(there())

    def spawn(self, make: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        """Run ``make()`` in the background there until it ends or ``stop()`` (the
        coroutine is made there, so one cancelled before it starts leaves nothing
        unawaited). An exception it raises is logged; it ends only that task."""

        async def guarded() -> None:
            try:
                await make()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("data path task %s failed", name)

        future = asyncio.run_coroutine_threadsafe(guarded(), self.loop)
        self._spawned.add(future)
        future.add_done_callback(self._spawned.discard)

    async def stop(self) -> None:
        """Cancel the spawned tasks, stop the loop and join the thread."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        for future in list(self._spawned):
            future.cancel()
        loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join, _STOP_TIMEOUT_S)
        if thread.is_alive():
            log.warning("the data path thread did not stop within %.0f s", _STOP_TIMEOUT_S)
        self._thread = self._loop = None


def _finish(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left (the spawned tasks' finally blocks run), then close."""
    try:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()
