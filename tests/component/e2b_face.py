"""The E2B face served by a real uvicorn on loopback over the component tier's service
(the real agent in bubblewrap), for the real E2B SDKs to talk to."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn

from hutch.e2b import create_e2b_app
from hutch.e2b.keys import e2b_form
from hutch.services.composed import Services

TOKEN_SECRET = b"s" * 32


@dataclass(frozen=True)
class Face:
    url: str
    api_key: str  # the e2b_ form

    @property
    def opts(self) -> dict[str, Any]:
        """Connection options for the E2B SDKs (what the three variables would set)."""
        return {"api_url": self.url, "sandbox_url": self.url, "api_key": self.api_key}


@asynccontextmanager
async def serve_face(service: Services, hutch_key: str) -> AsyncIterator[Face]:
    app = create_e2b_app(service, hutch_key, TOKEN_SECRET)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
        if task.done():
            task.result()
    try:
        yield Face(f"http://127.0.0.1:{port}", e2b_form(hutch_key))
    finally:
        server.should_exit = True
        await task
        await app.close()
        sock.close()
