"""A real sandbox service (QEMU backend, SQLite store, built images) for VM-tier tests:
:func:`real_service` over the built images, :func:`image_service` with the host's whole
image store (OCI pulls, imports, Dockerfile builds) and :func:`served` for its REST API."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn

from hutch.api import create_app
from hutch.config import Settings
from hutch.daemon import build_services
from hutch.runtime.qemu.backend import QemuBackend
from hutch.sdk import AsyncClient
from hutch.services.composed import Services
from hutch.services.images import HostImages, LocalBootSets, LocalImages
from hutch.store import Store
from hutch.store.images import ImageStore
from tests.conftest import (
    delete_live_sandboxes,
    ensure_image,
    qemu_pids_mentioning,
    test_images_dir,
)
from tests.leases import own_tag_state_dir, release_tag


@asynccontextmanager
async def real_service(state: Path, **settings: Any) -> AsyncIterator[Services]:
    """Start a service on ``state``; on exit delete every sandbox and check that no QEMU
    process of it is left."""
    ensure_image("base")
    config = Settings(
        # A tag (taps, nft table, cgroups) no other live test daemon on this host has.
        state_dir=own_tag_state_dir(state),
        images_dir_override=test_images_dir(),
        accel=os.environ.get("HUTCH_ACCEL", "auto"),
        **settings,
    )
    svc = build_services(
        config, Store(config.database), QemuBackend(config), LocalImages(config.images_dir)
    )
    await svc.start()
    try:
        yield svc
    finally:
        await delete_live_sandboxes(svc)
        await svc.close()
        release_tag(config.state_dir)
        assert qemu_pids_mentioning(str(config.run_dir)) == []


def image_service(state: Path) -> Services:
    """A service on ``state`` (no templates) whose images are the host's image store over
    the test images dir: what pulls, imports and Dockerfile builds need. Not started:
    :func:`served` starts it with the API."""
    images_dir = test_images_dir()
    config = Settings(
        state_dir=own_tag_state_dir(state),  # tests/leases.py
        images_dir_override=images_dir,
        accel=os.environ.get("HUTCH_ACCEL", "auto"),
        templates=False,
    )
    store = Store(config.database)
    images = HostImages(
        LocalImages(images_dir), ImageStore(store), images_dir, LocalBootSets(images_dir)
    )
    return build_services(config, store, QemuBackend(config), images)


@asynccontextmanager
async def served(svc: Services, api_key: str) -> AsyncIterator[AsyncClient]:
    """``svc``'s REST API on a loopback port (uvicorn's lifespan starts and closes the
    service), and a client of it; on exit delete every live sandbox, stop the API and
    check that no QEMU process of it is left."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(create_app(svc, api_key), log_config=None, access_log=False)
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
        if task.done():
            task.result()
    client = AsyncClient(
        base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", api_key=api_key, timeout=900
    )
    try:
        yield client
    finally:
        await delete_live_sandboxes(svc)
        await client.aclose()
        server.should_exit = True
        await task
        sock.close()
        assert qemu_pids_mentioning(str(svc.settings.run_dir)) == []
