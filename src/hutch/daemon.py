"""hutchd: wire settings, store, backend, services and REST app together, then serve.

:func:`build_services` is the composition root of the sandbox services.
"""

from __future__ import annotations

import asyncio
import logging
import logging.handlers
import os
import socket
import sys

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from hutch.api import create_app
from hutch.api.auth import load_or_create_key
from hutch.api.cluster_router import SERVER_KEEP_ALIVE_S
from hutch.api.redact import RedactingFormatter
from hutch.config import Settings
from hutch.e2b import create_e2b_app
from hutch.e2b.keys import load_or_create_secret, write_e2b_key_file
from hutch.models import NetworkMode
from hutch.runtime.backend import VmBackend
from hutch.runtime.qemu.backend import QemuBackend
from hutch.services.blob_cache import ImageCache
from hutch.services.builtin_blobs import BuiltinBlobs
from hutch.services.builtin_users import HostBuiltinUsers
from hutch.services.cluster import ClusterService
from hutch.services.composed import Services
from hutch.services.files_extra import FilesExtraService
from hutch.services.guest_ops import GuestOps
from hutch.services.image_blobs import ImageBlobs
from hutch.services.images import HostImages, ImageSource, LocalBootSets, LocalImages
from hutch.services.interpreter import InterpreterService
from hutch.services.lifecycle import LifecycleService
from hutch.services.moves import SandboxMoves
from hutch.services.network import NetworkService
from hutch.services.networking import NetworkingService
from hutch.services.pool import WarmPool
from hutch.services.processes import ProcessService
from hutch.services.reaper import Reaper
from hutch.services.reconcile import Reconciler
from hutch.services.registry import SandboxRegistry
from hutch.services.sandboxes import SandboxService
from hutch.services.secret_box import SecretKey
from hutch.services.secrets import SecretService
from hutch.services.snapshot_blobs import SnapshotBlobs
from hutch.services.snapshots import SnapshotService
from hutch.services.template_blobs import TemplateBlobs
from hutch.services.templates import TemplateService
from hutch.services.usage import UsageService
from hutch.services.volumes import VolumeService
from hutch.storage.blobs import BlobStore, blob_store_from_settings
from hutch.store import Store
from hutch.store.image_uploads import ImageUploadStore
from hutch.store.images import ImageStore
from hutch.store.secrets import SecretStore

log = logging.getLogger("hutch")


def setup_logging(settings: Settings, secrets: tuple[str, ...] = ()) -> None:
    """Log to ``logs/hutchd.log`` (rotated) and stderr, every line redacted: no query
    string, API key (``secrets``, or any hutch-shaped key) or credential is written."""
    settings.logs_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.handlers.RotatingFileHandler(
        settings.logs_dir / "hutchd.log", maxBytes=20 << 20, backupCount=3
    )
    fmt = RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", secrets=secrets)
    handler.setFormatter(fmt)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(fmt)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    root.addHandler(console)


def prepare_state_dir(settings: Settings) -> str:
    """Create the state dir (0700) and return the API key (created on first start);
    with the E2B face on, also its token secret and the key in E2B's form."""
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(settings.state_dir, 0o700)
    key = load_or_create_key(settings.api_key_path)
    if settings.e2b_listen is not None:
        load_or_create_secret(settings.e2b_secret_path)
        write_e2b_key_file(settings.e2b_key_path, key)
    return key


def build_services(
    settings: Settings,
    store: Store,
    backend: VmBackend,
    images: ImageSource,
    net: NetworkService | None = None,
    *,
    blob_store: BlobStore | None = None,
) -> Services:
    """The one place the sandbox services are composed (the daemon and the tests).

    ``net`` None (no root, or tests without netns): every sandbox gets network "none".
    ``blob_store``: the store ``HUTCH_BLOB_URL`` names, opened once by the caller whose
    images share it (the daemon); None: opened here (``blob_store_from_settings``), and
    none at all when the setting is unset.
    """
    if blob_store is None:
        blob_store = blob_store_from_settings(settings)
    secrets = SecretService(SecretStore(store), SecretKey(settings.secrets_key_path))
    secrets.prepare()  # the key file is created on the first start
    if net is not None:
        # A transform's {secret:NAME} is rendered by the egress proxy, in the data
        # path's thread, from the sandbox's project (the store takes its own lock).
        net.enforcer.proxy.secrets = secrets
    core = SandboxRegistry(settings, store, backend, images, net, secrets)
    lifecycle = LifecycleService(core, SandboxMoves(core, blob_store))
    snapshots = SnapshotService(core, lifecycle, SnapshotBlobs.from_settings(core, blob_store))
    guest = GuestOps(core, lifecycle)
    networking = NetworkingService(core)
    # Templates: this host's, or fetched from the blob store, else built and uploaded.
    templates = TemplateService(
        backend.templates,
        TemplateBlobs.from_settings(
            backend.templates, blob_store, ImageUploadStore(store), settings
        ),
        settings.images_dir,
        hold_builtin=settings.blob_url is not None and settings.blob_builtin_images,
    )
    pool = WarmPool(
        core,
        settings.pool_size if settings.templates else 0,
        prepare=networking.prepare_pooled,
        network=NetworkMode.DEFAULT if net is not None else NetworkMode.NONE,
        templates=templates.for_create,
    )
    templates.on_ready = pool.refill
    volumes = VolumeService(core)
    sandboxes = SandboxService(core, networking, snapshots, pool, volumes, templates)
    builtins = None
    if isinstance(images, HostImages) and images.blobs.enabled:
        # One blob cache budget: imported images' copies are evicted with snapshots'.
        cache = ImageCache(core, images)
        snapshots.blobs.images = cache
        images.blobs.on_cached = snapshots.blobs.evict_soon
        # An adoption (a copy here unlike the bucket's) waits while this host uses it.
        images.blobs.in_use = lambda digest: cache.user(digest, here=True)
        # Built-in images: one content per digest on every host, fetched by digest
        # under a frozen state that needs one this host lacks.
        builtins = BuiltinBlobs.beside(
            images.blobs, core.hosts, converge=settings.blob_builtin_images
        )
        if builtins is not None:
            images.hold_builtins = builtins.converging
            builtins.users = HostBuiltinUsers(core, pool, snapshots.blobs.frozen_base)
            lifecycle.moves.base_images = builtins
            snapshots.blobs.base_images = builtins
    return Services(
        cluster=ClusterService(core, lifecycle, snapshots.blobs.uploaded),
        core=core,
        sandboxes=sandboxes,
        lifecycle=lifecycle,
        snapshots=snapshots,
        guest=guest,
        networking=networking,
        pool=pool,
        reaper=Reaper(core, sandboxes, lifecycle),
        reconciler=Reconciler(core),
        processes=ProcessService(guest),
        interpreter=InterpreterService(guest),
        files=FilesExtraService(guest),
        usage=UsageService(core),
        volumes=volumes,
        secrets=secrets,
        builtins=builtins,
    )


def build(settings: Settings) -> tuple[Services, str]:
    key = prepare_state_dir(settings)
    store = Store(settings.database)

    def name_of(sandbox_id: str) -> str | None:
        rec = store.get_sandbox(sandbox_id)
        return rec.name if rec else None

    net: NetworkService | None = None
    if os.geteuid() == 0:
        net = NetworkService(settings, store, names=name_of)
    else:
        # Taps and nftables need root: without it every sandbox gets network "none".
        log.warning("hutchd is not running as root: sandboxes get no network (network none)")
    backend = QemuBackend(settings, guest_network=net.guest_settings if net else None)
    # One store (one S3 client and connection pool) for images, snapshots and pauses.
    blob_store = blob_store_from_settings(settings)
    images = HostImages(
        LocalImages(settings.images_dir),
        ImageStore(store),
        settings.images_dir,
        LocalBootSets(settings.images_dir),
        ImageBlobs.from_settings(settings, ImageUploadStore(store), blob_store),
    )
    return build_services(settings, store, backend, images, net, blob_store=blob_store), key


class ByListener:
    """One ASGI app per listening socket, told apart by the local port of the
    connection: hutch's REST API, and the E2B face when it is on. One server, one
    lifespan (the REST app's: it starts and closes the services), one shutdown."""

    def __init__(self, main: ASGIApp, others: dict[int, ASGIApp]) -> None:
        self.main = main
        self.others = others

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            server = scope.get("server")
            target = self.others.get(server[1]) if server else None
            if target is not None:
                await target(scope, receive, send)
                return
        await self.main(scope, receive, send)


def listen_socket(host: str, port: int, what: str) -> socket.socket:
    """A listening TCP socket whose connections have Nagle's algorithm off.

    Why TCP_NODELAY here: uvicorn writes a response's head and body in two sends, and
    with Nagle on the body waits for the client's delayed ACK of the head (40 ms on
    Linux), so every request took >= 40 ms (an exec round trip 85 ms, of which the guest
    was 28 ms). asyncio turns Nagle off only for sockets whose ``proto`` is
    IPPROTO_TCP, which ``socket.create_server`` leaves 0; Linux gives each accepted
    connection the listener's TCP_NODELAY, so it is set once, here.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        raise SystemExit(f"hutchd could not listen on {host}:{port} ({what}): {exc}") from exc
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def server_config(app: ASGIApp) -> uvicorn.Config:
    """The HTTP server of hutchd: idle connections kept SERVER_KEEP_ALIVE_S, longer than
    any hutch client keeps one pooled (api/cluster_router.py)."""
    return uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=SERVER_KEEP_ALIVE_S,
    )


async def serve(settings: Settings) -> None:
    services, key = build(settings)
    app = create_app(services, key)
    sockets = [listen_socket(settings.listen_host, settings.listen_port, "HUTCH_LISTEN")]
    e2b = None
    routed: ASGIApp = app
    if settings.e2b_listen is not None:
        host, port = settings.e2b_listen
        sockets.append(listen_socket(host, port, "HUTCH_E2B_LISTEN"))
        e2b = create_e2b_app(
            services, key, load_or_create_secret(settings.e2b_secret_path), app.state.forwarder
        )
        app.state.e2b = e2b  # E2B requests other hosts forward here (their sandbox's host)
        routed = ByListener(app, {port: e2b})
    config = server_config(routed)
    server = uvicorn.Server(config)
    e2b_line = ""
    if settings.e2b_listen is not None:
        e2b_host, e2b_port = settings.e2b_listen
        e2b_line = f", E2B API on http://{e2b_host}:{e2b_port}"
    print(
        f"hutchd {app.version}: listening on http://{settings.listen}{e2b_line}, "
        f"state in {settings.state_dir} (database {services.core.store.display}), "
        f"accel {services.backend.accel}",
        file=sys.stderr,
        flush=True,
    )
    try:
        await server.serve(sockets=sockets)
    finally:
        if e2b is not None:
            await e2b.close()
        for sock in sockets:
            sock.close()
    if not server.started:
        raise SystemExit(f"hutchd could not listen on {settings.listen}")


def run(settings: Settings) -> None:
    """Run the daemon in the foreground until SIGINT/SIGTERM. Sandboxes keep running."""
    setup_logging(settings, secrets=(prepare_state_dir(settings),))
    asyncio.run(serve(settings))
