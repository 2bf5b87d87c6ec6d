"""hutchd keeps an idle connection open longer than any hutch client keeps one pooled:
the forwarder of host-to-host calls and the SDK. With the two equal (uvicorn's and
httpx's 5 s), a request sent on a pooled connection just as the server closed it got
"Server disconnected without sending a response" (a cluster drain failed so in CI)."""

from __future__ import annotations

import asyncio

import httpx

from hutch.api.cluster_router import FORWARD_KEEP_ALIVE_S, SERVER_KEEP_ALIVE_S, Forwarder
from hutch.daemon import server_config


async def _app(scope: object, receive: object, send: object) -> None:
    raise AssertionError("not served")


def _expiry(client: httpx.AsyncClient | httpx.Client) -> float | None:
    pool = client._transport._pool  # type: ignore[union-attr]
    expiry: float | None = pool._keepalive_expiry
    return expiry


def test_clients_let_go_of_idle_connections_before_hutchd_closes_them() -> None:
    server = server_config(_app)
    assert server.timeout_keep_alive == SERVER_KEEP_ALIVE_S
    forwarder = Forwarder()
    try:
        assert _expiry(forwarder.client) == FORWARD_KEEP_ALIVE_S
        assert FORWARD_KEEP_ALIVE_S * 2 <= SERVER_KEEP_ALIVE_S
    finally:
        asyncio.run(forwarder.close())
    with httpx.Client() as sdk_like:  # the SDK's clients take httpx's default limits
        default = _expiry(sdk_like)
        assert default is not None and default * 2 <= SERVER_KEEP_ALIVE_S
