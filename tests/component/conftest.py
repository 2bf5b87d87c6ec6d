"""Component tier: the real service, store and REST app in-process, the real guest agent
in a bubblewrap sandbox instead of a VM (see fake_backend.py)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import shutil
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import uvicorn

from hutch.api import create_app
from hutch.config import Limits, Settings
from hutch.daemon import build_services
from hutch.images.build import ImageArtifacts
from hutch.net.dataplane import MemoryDataplane
from hutch.services.composed import Services
from hutch.services.images import ImageDefaults, ImageSource, ImageView
from hutch.services.network import NetworkService as NetworkManager
from hutch.store import Store
from tests import pgserver
from tests.component.fake_backend import FakeBackend
from tests.conftest import delete_live_sandboxes, named_database

API_KEY = "hk_test-key"


async def until(
    check: Callable[[], bool | Awaitable[bool]], what: str, timeout_s: float = 30.0
) -> None:
    """Poll ``check`` (plain or async, e.g. an API call) until it holds (a state with no
    event to wait on); fails naming ``what`` did not happen after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = check()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        assert time.monotonic() < deadline, f"{what} (not within {timeout_s:g} s)"
        await asyncio.sleep(0.01)


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

    def find(self, name: str, project: str = "default") -> ImageArtifacts | None:
        return self.base if name == "base" else None

    def names(self, project: str = "default") -> list[str]:
        return ["base", "devbox"]

    def defaults(self, name: str, project: str = "default") -> ImageDefaults:
        return ImageDefaults()

    async def ensure_local(self, name: str, project: str = "default") -> None:
        """Nothing to fetch: ``base`` is here, ``devbox`` is not built anywhere."""

    def using(self, name: str, project: str = "default") -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def list(self, project: str | None = None) -> list[ImageView]:
        return [
            ImageView("base", "fake base", True, self.base.digest, 1 << 30, "6.1.0-fake"),
            ImageView("devbox", "fake devbox", False, None, None, None),
        ]


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(state_dir=tmp_path / "state", limits=Limits(max_sandboxes=40))


@contextlib.asynccontextmanager
async def started_services(
    settings: Settings,
    tmp_path: Path,
    images: ImageSource | None = None,
    *,
    networked: bool = False,
) -> AsyncIterator[Services]:
    """The real services on the bubblewrap backend, started; at the end every live
    sandbox is deleted and the backend must hold nothing. ``networked``: with a
    NetworkManager on the in-memory dataplane (no taps, no nftables) whose resolver
    forwards nowhere, so the host's resolv.conf is not consulted."""
    store = Store(settings.database)
    net: NetworkManager | None = None
    if networked:
        settings = replace(settings, dns_upstream=("127.0.0.1", 9))

        def name_of(sandbox_id: str) -> str | None:
            rec = store.get_sandbox(sandbox_id)
            return rec.name if rec else None

        net = NetworkManager(settings, store, names=name_of, dataplane=MemoryDataplane())
    backend = FakeBackend(tmp_path / "run")
    svc = build_services(settings, store, backend, images or FakeImages(tmp_path), net=net)
    await svc.start()
    try:
        yield svc
    finally:
        await delete_live_sandboxes(svc)
        await svc.close()
        assert backend.leftover_ids() == set(), "a test leaked sandbox resources"


@pytest.fixture
async def service(settings: Settings, tmp_path: Path) -> AsyncIterator[Services]:
    async with started_services(settings, tmp_path) as svc:
        yield svc


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


# Modules whose tests never open a daemon's store through Settings (the proxy, DNS,
# agent, blob and OCI parts, each on its own): the PostgreSQL pass of `make test`
# (HUTCH_TEST_DATABASE=postgres) leaves them out, since it would run the very same thing
# again (~1.5 min). The SQLite pass keeps the list honest: a test of a listed module that
# reads Settings.database fails, naming the module to take off the list.
STORE_FREE_MODULES = frozenset(
    {
        "test_agent_local.py",
        "test_blob_dirs_chain.py",
        "test_blob_store.py",
        "test_build_step.py",
        "test_fuzz.py",
        "test_net_dns.py",
        "test_net_inbound.py",
        "test_net_proxy.py",
        "test_net_proxy_http.py",
        "test_net_proxy_policy.py",
        "test_net_proxy_protocols.py",
        "test_net_proxy_tls.py",
        "test_oci_import.py",
    }
)


def _runs_both_backends(item: pytest.Item) -> bool:
    """A test of ``db_target`` (tests/conftest.py): the SQLite pass already runs it on
    SQLite and on PostgreSQL, with stores opened on the target it names."""
    return "db_target" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if pgserver.test_database() != "postgres":
        return
    # The PostgreSQL pass would run these the very same way again (~3.5 min here).
    kept = [
        i for i in items if i.path.name not in STORE_FREE_MODULES and not _runs_both_backends(i)
    ]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


@pytest.fixture(autouse=True)
def _what_the_postgres_pass_leaves_out_stays_so(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SQLite pass keeps what the PostgreSQL pass leaves out honest: a listed
    module's test opens no store through Settings, and a ``db_target`` test opens none
    but the target it names (the PostgreSQL pass would move Settings' own default)."""
    module = request.node.path.name
    if module in STORE_FREE_MODULES:

        def database(self: Settings) -> Path | str:
            raise AssertionError(
                f"{module} opens a store (Settings.database) but is listed in "
                "tests/component/conftest.py STORE_FREE_MODULES, which the PostgreSQL "
                "pass leaves out: take it off the list"
            )

    elif _runs_both_backends(request.node):

        def database(self: Settings) -> Path | str:
            named = named_database(self)
            if named is not None:
                return named
            raise AssertionError(
                f"{request.node.nodeid} takes db_target, which the PostgreSQL pass leaves "
                "out, yet opens a store on Settings' own default: give it the target "
                "(database_url, cluster.shared_db)"
            )

    else:
        return
    monkeypatch.setattr(Settings, "database", property(database))
