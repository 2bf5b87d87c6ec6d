"""Component tier: the real service, store and REST app in-process, the real guest agent
in a bubblewrap sandbox instead of a VM (see fake_backend.py)."""

from __future__ import annotations

import asyncio
import shutil
import socket
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import uvicorn

from hutch.api import create_app
from hutch.config import Limits, Settings
from hutch.daemon import build_services
from hutch.images.build import ImageArtifacts
from hutch.services.composed import Services
from hutch.services.images import ImageDefaults, ImageView
from hutch.store import Store
from tests.component.fake_backend import FakeBackend

API_KEY = "hk_test-key"

if shutil.which("bwrap") is None:  # pragma: no cover - make test installs it
    pytest.exit("bubblewrap (bwrap) is missing: run `make deps`", returncode=1)


class FakeImages:
    """`base` is built, `devbox` is known but not built."""

    def __init__(self, root: Path) -> None:
        self.base = ImageArtifacts(
            name="base",
            digest="0" * 16,
            kernel=root / "vmlinux",
            initrd=root / "initrd",
            rootfs=root / "rootfs.ext4",
            kernel_release="6.1.0-fake",
            cmdline="",
            size_bytes=1 << 30,
        )

    def find(self, name: str) -> ImageArtifacts | None:
        return self.base if name == "base" else None

    def names(self) -> list[str]:
        return ["base", "devbox"]

    def defaults(self, name: str) -> ImageDefaults:
        return ImageDefaults()

    def list(self) -> list[ImageView]:
        return [
            ImageView("base", "fake base", True, self.base.digest, 1 << 30, "6.1.0-fake"),
            ImageView("devbox", "fake devbox", False, None, None, None),
        ]


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(state_dir=tmp_path / "state", limits=Limits(max_sandboxes=40))


@pytest.fixture
async def service(settings: Settings, tmp_path: Path) -> AsyncIterator[Services]:
    backend = FakeBackend(tmp_path / "run")
    svc = build_services(settings, Store(settings.database), backend, FakeImages(tmp_path))
    await svc.start()
    try:
        yield svc
    finally:
        for rec in svc.sandboxes.list_sandboxes():
            if rec.state.is_live:
                await svc.sandboxes.delete(rec.id)
        await svc.close()
        assert backend.leftover_ids() == set(), "a test leaked sandbox resources"


@pytest.fixture
async def api(service: Services) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app served by a real uvicorn on loopback.

    httpx's in-memory ASGI transport buffers whole responses, which would hide whether
    output streams; a real server does not.
    """
    app = create_app(service, API_KEY, manage_service=False)
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
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=60,
        ) as client:
            yield client
    finally:
        server.should_exit = True
        await task
        sock.close()


def with_limits(settings: Settings, **kw: int) -> Settings:
    return replace(settings, limits=replace(settings.limits, **kw))
