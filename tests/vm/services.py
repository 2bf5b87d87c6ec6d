"""A real sandbox service (QEMU backend, SQLite store, built images) for VM-tier tests."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from hutch.config import Settings
from hutch.daemon import build_services
from hutch.runtime.qemu.backend import QemuBackend
from hutch.services.composed import Services
from hutch.services.images import LocalImages
from hutch.store import Store
from tests.conftest import ensure_image, qemu_pids_mentioning, test_images_dir
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
        for rec in svc.sandboxes.list_sandboxes():
            if rec.state.is_live:
                await svc.sandboxes.delete(rec.id)
        await svc.close()
        release_tag(config.state_dir)
        assert qemu_pids_mentioning(str(config.run_dir)) == []
