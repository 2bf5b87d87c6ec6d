"""After a freeze: the snapshot of a clone rebased on a memory file of its own, so its
children (and the parent's clone back) map RAM copy-on-write and load device state
only (``hutch.vm.snapshot_rebase``; ARCHITECTURE.md, "Copy-on-write memory")."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
from pathlib import Path

from hutch.errors import HutchError
from hutch.models import new_sandbox_id
from hutch.runtime.qemu.boot import Booter
from hutch.runtime.qemu.host import HostLayout
from hutch.vm.argv import VmConfig
from hutch.vm.cgroup_driver import record_path
from hutch.vm.process import kill_verified, log_tail
from hutch.vm.snapshot import create_clone_disk
from hutch.vm.snapshot_dir import load_manifest
from hutch.vm.snapshot_rebase import rebase_memory
from hutch.vm.snapshot_seal import seal_memory

__all__ = ["rebase_frozen", "rebases"]

log = logging.getLogger(__name__)


def rebases(cfg: VmConfig, enabled: bool) -> bool:
    """Whether a freeze of the VM ``cfg`` is rebased: its RAM must be a memory backend
    object (a clone of a template: the stream names that block), and it has no volume
    drives (the helper would open them)."""
    return enabled and cfg.memory_file is not None and not cfg.volumes


async def rebase_frozen(booter: Booter, snapshot_dir: Path, frozen_cfg: VmConfig) -> bool:
    """Rebase the frozen full-stream ``snapshot_dir`` (saved from ``frozen_cfg``) on a
    ``memory.ram`` of its own and seal it. A failure is logged and leaves the full
    stream, which restores as before: returns whether it was rebased.

    The helper runs as a sandbox id no row owns, so a daemon killed meanwhile has its
    QEMU, files and cgroup removed with the other leftovers at the next start."""
    helper = new_sandbox_id()
    p = HostLayout(booter.settings).paths(helper)
    try:
        p.state.mkdir(parents=True, mode=0o700)
        p.run.mkdir(parents=True, mode=0o700)
        await asyncio.to_thread(create_clone_disk, snapshot_dir, p.disk)
        cfg = dataclasses.replace(
            p.relocate(frozen_cfg),
            name=helper,
            run_as=booter.run_as,
            tcg_tb_mib=booter.tb_mib,
        )
        manifest = load_manifest(snapshot_dir)
        await rebase_memory(
            snapshot_dir,
            manifest,
            cfg,
            qemu_version=manifest.qemu_version,
            cgroup=booter.cgroups.for_vm(helper, cfg),
        )
        # Not fsynced, as the full stream it replaces is not (save_snapshot's default):
        # pages a host crash loses fail the digest, and the snapshot is refused.
        await asyncio.to_thread(seal_memory, snapshot_dir, fsync=False)
        return True
    except HutchError as exc:
        log.warning(
            "snapshot %s keeps RAM in its stream: %s; the helper QEMU's log:\n%s",
            snapshot_dir,
            exc,
            log_tail(p.qemu_log, 2000),
        )
        return False
    finally:
        await asyncio.to_thread(kill_verified, p.pidfile, str(p.run))
        await asyncio.to_thread(booter.cgroups.release, helper, record_path(p.pidfile))
        await asyncio.to_thread(shutil.rmtree, p.run, True)
        await asyncio.to_thread(shutil.rmtree, p.state, True)
