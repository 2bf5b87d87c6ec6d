"""Run hutch tool calls from synchronous or asynchronous framework code."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import httpx

from hutch.agent_tools.tools import HutchTools, ToolResult
from hutch.sdk import AsyncClient, Timeouts

__all__ = ["ToolRunner"]

T = TypeVar("T")


class ToolRunner:
    """Executes tools against one daemon.

    ``client``: an :class:`AsyncClient` that async calls share (the caller closes it).
    Without one, each call opens a client from ``base_url``/``api_key``/``transport``
    (defaults: ``HUTCH_URL``, ``HUTCH_API_KEY`` or the key file, as the SDK resolves
    them) and closes it after. Sync calls always use a client of their own: an
    ``AsyncClient`` belongs to the event loop it first ran on.
    """

    def __init__(
        self,
        client: AsyncClient | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        http_timeout: float | Timeouts | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.client = client
        if client is not None:
            base_url = base_url or client.base_url
            api_key = api_key or client.core.config.api_key
            http_timeout = http_timeout or client.core.config.timeouts
        self._base_url = base_url
        self._api_key = api_key
        self._http_timeout = http_timeout
        self._transport = transport

    def _new_client(self) -> AsyncClient:
        return AsyncClient(
            base_url=self._base_url,
            api_key=self._api_key,
            timeout=self._http_timeout,
            transport=self._transport,
        )

    async def acall(self, name: str, arguments: Mapping[str, Any] | None) -> ToolResult:
        """Run tool ``name``; raises :class:`hutch.agent_tools.tools.ToolError` on failure."""
        if self.client is not None:
            return await HutchTools(self.client).call(name, arguments)
        async with self._new_client() as client:
            return await HutchTools(client).call(name, arguments)

    def call(self, name: str, arguments: Mapping[str, Any] | None) -> ToolResult:
        """:meth:`acall` for synchronous code (also works inside a running event loop,
        as in a notebook: the call then runs on a worker thread)."""

        async def run() -> ToolResult:
            async with self._new_client() as client:
                return await HutchTools(client).call(name, arguments)

        return run_sync(run)


def run_sync(factory: Callable[[], Awaitable[T]]) -> T:
    """Run the coroutine ``factory()`` to completion from synchronous code."""

    async def main() -> T:
        return await factory()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    # This thread runs a loop already; asyncio.run would refuse. Use another thread.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, main()).result()
