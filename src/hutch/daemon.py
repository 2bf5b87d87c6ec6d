"""hutchd: wire settings, store, backend, service and REST app together, then serve."""

from __future__ import annotations

import asyncio
import logging
import logging.handlers
import os
import sys

import uvicorn

from hutch.api import create_app
from hutch.api.auth import load_or_create_key
from hutch.api.redact import RedactingFormatter
from hutch.config import Settings
from hutch.services.images import HostImages, LocalBootSets, LocalImages
from hutch.services.network import NetworkService as NetworkManager
from hutch.services.qemu_backend import QemuBackend
from hutch.services.sandboxes import SandboxService
from hutch.store import Store
from hutch.store.images import ImageStore

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
    """Create the state dir (0700) and return the API key (created on first start)."""
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(settings.state_dir, 0o700)
    return load_or_create_key(settings.api_key_path)


def build(settings: Settings) -> tuple[SandboxService, str]:
    key = prepare_state_dir(settings)
    store = Store(settings.db_path)

    def name_of(sandbox_id: str) -> str | None:
        rec = store.get_sandbox(sandbox_id)
        return rec.name if rec else None

    net: NetworkManager | None = None
    if os.geteuid() == 0:
        net = NetworkManager(settings, store, names=name_of)
    else:
        # Taps and nftables need root: without it every sandbox gets network "none".
        log.warning("hutchd is not running as root: sandboxes get no network (network none)")
    backend = QemuBackend(settings, guest_network=net.guest_settings if net else None)
    images = HostImages(
        LocalImages(settings.images_dir),
        ImageStore(store),
        settings.images_dir,
        LocalBootSets(settings.images_dir),
    )
    return SandboxService(settings, store, backend, images, net=net), key


async def serve(settings: Settings) -> None:
    svc, key = build(settings)
    app = create_app(svc, key)
    config = uvicorn.Config(
        app,
        host=settings.listen_host,
        port=settings.listen_port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    print(
        f"hutchd {app.version}: listening on http://{settings.listen}, "
        f"state in {settings.state_dir}, accel {svc.backend.accel}",
        file=sys.stderr,
        flush=True,
    )
    await server.serve()
    if not server.started:
        raise SystemExit(f"hutchd could not listen on {settings.listen}")


def run(settings: Settings) -> None:
    """Run the daemon in the foreground until SIGINT/SIGTERM. Sandboxes keep running."""
    setup_logging(settings, secrets=(prepare_state_dir(settings),))
    asyncio.run(serve(settings))
