"""One live QEMU sandbox: its VM and agent, and what is done to the machine as a whole
(pause, freeze for a fork or snapshot, continue, destroy)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shutil
from pathlib import Path

from hutch.crashpoints import crash_point
from hutch.errors import Conflict, HutchError, InvalidArgument, VmError
from hutch.guest.client import AgentClient
from hutch.images.agent_runtime import runtime_python_argv
from hutch.models import PauseMode, SandboxRecord
from hutch.runtime.qemu.boot import Booter
from hutch.runtime.qemu.host import SandboxPaths
from hutch.runtime.qemu.rebase import rebase_frozen, rebases
from hutch.runtime.qemu.templates import finish_template
from hutch.vm.argv import share_port_name
from hutch.vm.console import console_tail
from hutch.vm.process import QemuVm
from hutch.vm.snapshot import save_snapshot

__all__ = ["QemuRuntime", "undo_interrupted_pause"]

log = logging.getLogger(__name__)


class QemuRuntime:
    def __init__(
        self,
        sandbox_id: str,
        vm: QemuVm,
        agent: AgentClient,
        paths: SandboxPaths,
        booter: Booter,
        pause_dir: Path,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.vm = vm
        self.agent = agent
        self.paths = paths
        self._booter = booter
        self._pause_dir = pause_dir

    async def wait_exited(self) -> None:
        await self.vm.wait_exited()

    def exit_reason(self) -> str | None:
        return self.vm.exit_reason

    async def destroy(self) -> None:
        with contextlib.suppress(Exception):
            await self.agent.close()
        await self.vm.kill()

    def console_tail(self, max_bytes: int = 4096) -> str:
        return console_tail(self.paths.console_log, max_bytes)

    async def cont(self) -> None:
        if await self.vm.query_status() != "running":
            await self.vm.qmp("cont")

    async def pause(self, mode: PauseMode) -> str | None:
        """Stop the VM, keeping memory state (memory mode) or only the disk.

        Returns the snapshot directory a resume restores from (None in disk mode: the
        guest boots again). On failure the VM keeps running and ``agent`` is a fresh
        connection.
        """
        if mode is PauseMode.DISK:
            # An imported image may have no `sync`: its runtime's Python syncs there.
            sync = ["sync"] if self.vm.cfg.runtime_disk is None else runtime_sync_argv()
            with contextlib.suppress(HutchError):
                await self.agent.run(sync, timeout_s=30)
            await self.agent.close()
            await self.vm.kill(grace_s=10.0)
            crash_point("pause.disk_quit")
            return None
        dest = self._pause_dir
        await asyncio.to_thread(shutil.rmtree, dest, True)
        await self._save(dest)
        return str(dest)

    async def freeze(self, snapshot_dir: Path) -> None:
        """Save the VM's state and take its disk into ``snapshot_dir``; QEMU exits.

        From then on the snapshot is the template of the parent and every child.
        """
        snapshot_dir.parent.mkdir(parents=True, exist_ok=True)
        await self._save(snapshot_dir)
        # The running VM's config says incoming=True if it was itself restored; the
        # snapshot records the machine, which restore() starts -incoming anyway.
        cfg = dataclasses.replace(self.vm.cfg, incoming=False)
        await asyncio.to_thread(finish_template, snapshot_dir, cfg)
        crash_point("freeze.done")
        # A clone's stream carries all its RAM (QEMU sends every page of a private
        # block): written once into a memory.ram of the snapshot's own, every clone of
        # it maps that copy-on-write and loads device state only.
        if rebases(cfg, self._booter.settings.fork_ram_in_file):
            await rebase_frozen(self._booter, snapshot_dir, cfg)

    async def _save(self, dest: Path) -> None:
        """Migrate the VM's state into ``dest``; on failure it runs on, reconnected."""
        await self.agent.close()
        try:
            await save_snapshot(self.vm, dest, ram_in_file=False)
        except BaseException:
            self.agent = await self._booter.connect(self.vm, self.paths)
            raise

    async def retake_identity(self, rec: SandboxRecord) -> None:
        """The guest takes ``rec``'s identity (its name as hostname) in one agent round
        trip on the open connection; an agent older than the ``identity`` op is
        reconnected with it instead (a hello: close, connect, handshake)."""
        identity = self._booter.identity(self.vm, rec.name or rec.id)
        try:
            await self.agent.take_identity(identity)
        except (Conflict, InvalidArgument):
            await self.agent.close()
            self.agent = await self._booter.connect(self.vm, self.paths, rec.name or rec.id)

    async def mount_volume(self, serial: str, path: str, *, read_only: bool) -> None:
        await self.agent.mount_volume(serial, path, read_only=read_only)

    async def mount_shared(self, slot: int, path: str, *, read_only: bool) -> None:
        await self.agent.mount_shared(share_port_name(slot), path, read_only=read_only)

    async def freeze_volumes(self, guest_paths: list[str]) -> None:
        await self.agent.freeze_fs(guest_paths)

    async def grow_disk(self, drive: str, guest_path: str, size_bytes: int) -> None:
        # block_resize grows the file (qcow2 virtual size, or a raw file's length) and
        # raises the virtio-blk capacity, which the guest kernel picks up at once.
        await self.vm.qmp("block_resize", device=drive, size=size_bytes)
        await self.agent.grow_fs(guest_path, size_bytes)


async def undo_interrupted_pause(vm: QemuVm) -> None:
    """A daemon killed during a pause or fork leaves QEMU stopped (possibly migrating).
    Nothing but hutch stops a guest, so an adopted VM that is not running is let run."""
    try:
        status = await vm.query_status()
        if status == "running":
            return
        with contextlib.suppress(VmError):
            await vm.qmp("migrate_cancel")
        await vm.qmp("cont")
        log.info("VM %s was %s after a daemon restart; resumed it", vm.cfg.name, status)
    except HutchError as exc:
        log.warning("could not resume adopted VM %s: %s", vm.cfg.name, exc)


def runtime_sync_argv() -> list[str]:
    """``sync`` through the agent runtime's own Python (an image may have no sync)."""
    return runtime_python_argv("-c", "import os; os.sync()")
