"""The production VM backend: one QEMU ``microvm`` per sandbox, a qcow2 overlay on the
image's read-only root filesystem, and the guest agent over virtio-serial.

Where things live is described in ARCHITECTURE.md ("State on disk") and
:mod:`hutch.runtime.qemu.host`. ``vm.json`` in the sandbox directory records the exact
VM configuration so that a restarted daemon can adopt the VM without guessing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

from hutch.config import Settings
from hutch.crashpoints import crash_point
from hutch.errors import GuestError, HutchError, Timeout, VmError
from hutch.guest.client import AgentClient
from hutch.images.build import ImageArtifacts
from hutch.models import SANDBOX_ID_RE, NetworkMode, SandboxRecord, SandboxState
from hutch.net.addressing import tap_name
from hutch.runtime.qemu.boot import Booter, GuestNetwork
from hutch.runtime.qemu.host import HostLayout, SandboxPaths, read_config, write_config
from hutch.runtime.qemu.runtime import QemuRuntime, undo_interrupted_pause
from hutch.runtime.qemu.snapshots import QemuSnapshotFiles, discard_stale_saves, save_written
from hutch.runtime.qemu.template_key import keyed_complete, read_key_file
from hutch.runtime.qemu.templates import QemuTemplates, finish_template
from hutch.storage.overlay import create_overlay
from hutch.vm.argv import SharePort, VmConfig, VolumeDrive
from hutch.vm.cgroup_driver import record_path
from hutch.vm.disk_chain import compact_if_deep
from hutch.vm.process import QemuVm, kill_verified
from hutch.vm.snapshot import MEMORY_FILE, create_clone_disk
from hutch.vm.snapshot_dir import load_manifest

__all__ = ["QemuBackend"]

log = logging.getLogger(__name__)


class QemuBackend:
    def __init__(self, settings: Settings, guest_network: GuestNetwork | None = None) -> None:
        self.settings = settings
        self.layout = HostLayout(settings)
        self.booter = Booter(settings, guest_network)
        self.templates = QemuTemplates(self.layout, self.booter)
        self.snapshots = QemuSnapshotFiles(self.layout)

    @property
    def accel(self) -> str:
        return self.booter.accel

    def tap_of(self, rec: SandboxRecord) -> str | None:
        """The host tap of ``rec``'s NIC (created by the network layer), None with no network."""
        if rec.network is NetworkMode.NONE:
            return None
        return tap_name(self.settings.daemon_tag, rec.id)

    def paths(self, sandbox_id: str) -> SandboxPaths:
        return self.layout.paths(sandbox_id)

    def pause_dir(self, sandbox_id: str) -> Path:
        return self.layout.pause_dir(sandbox_id)

    def disk_path(self, sandbox_id: str) -> Path:
        return self.paths(sandbox_id).disk

    def rehome(self, rec: SandboxRecord) -> None:
        """vm.json fetched from another host names that host's state and run dirs: this
        host's own paths replace them. RAM: a template clone's ``memory_file`` names
        the template's ``memory.ram`` on the saving host; a resume restores a full
        stream (every page), so it needs no template file on this host: it maps this
        host's template of the same key if there is one (fetched or built here: pages
        equal to it stay shared, :meth:`_template_here`), else a sparse file of its own
        (:func:`_private_memory`)."""
        p = self.paths(rec.id)
        cfg = read_config(p.vm_json)
        if cfg is None:
            raise VmError(f"sandbox {rec.id}: fetched VM configuration {p.vm_json} unusable")
        if cfg.volumes:
            raise VmError(f"sandbox {rec.id} has volumes attached; it cannot move to another host")
        memory = self._template_here(cfg.memory_file)
        if memory is not None and not memory.resolve().is_relative_to(
            self.settings.state_dir.resolve()
        ):
            memory = p.state / MEMORY_FILE
        cfg = dataclasses.replace(
            p.relocate(cfg), tap=self.tap_of(rec) if cfg.tap else None, memory_file=memory
        )
        write_config(p.vm_json, cfg)

    def _template_here(self, memory_file: Path | None) -> Path | None:
        """``memory_file`` as this host's: a template's ``memory.ram`` that another host
        named (a config fetched with a pause or a snapshot) becomes this host's template
        of the same key when there is one (its directory's name ends in the key, and its
        ``template.json`` must name that key), else stays as it is."""
        if memory_file is None or memory_file.parent.parent.name != "templates":
            return memory_file
        d = self.layout.templates_root / memory_file.parent.name
        kept = read_key_file(d)
        if kept is None or not d.name.endswith(kept.key[:16]) or not keyed_complete(d, kept.key):
            return memory_file
        return d / MEMORY_FILE if (d / MEMORY_FILE).is_file() else memory_file

    def share_socket(self, sandbox_id: str, slot: int) -> Path:
        return self.paths(sandbox_id).share_socket(slot)

    def fork_dir(self, snapshot_id: str) -> Path:
        return self.layout.fork_dir(snapshot_id)

    def vm_config(self, rec: SandboxRecord, image: ImageArtifacts) -> VmConfig:
        cfg = self.booter.vm_config(
            self.paths(rec.id), rec.id, rec.shape, image, rec.name or rec.id
        )
        return dataclasses.replace(cfg, tap=self.tap_of(rec))

    def _runtime(self, rec: SandboxRecord, vm: QemuVm, agent: AgentClient) -> QemuRuntime:
        return QemuRuntime(
            rec.id, vm, agent, self.paths(rec.id), self.booter, self.pause_dir(rec.id)
        )

    # -- making a runtime ----------------------------------------------------------------

    async def start(
        self,
        rec: SandboxRecord,
        image: ImageArtifacts,
        volumes: Sequence[VolumeDrive] = (),
        shares: Sequence[int] = (),
    ) -> QemuRuntime:
        p = self.paths(rec.id)
        p.state.mkdir(parents=True, mode=0o700)
        p.run.mkdir(parents=True, mode=0o700)
        await asyncio.to_thread(
            create_overlay, image.rootfs, p.disk, rec.shape.disk_gib, image.rootfs_format
        )
        cfg = dataclasses.replace(
            self.vm_config(rec, image),
            volumes=tuple(volumes),
            shares=tuple(SharePort(slot, p.share_socket(slot)) for slot in shares),
        )
        write_config(p.vm_json, cfg)
        vm, agent = await self.booter.boot(cfg, p, rec.name or rec.id)
        return self._runtime(rec, vm, agent)

    async def resume(
        self, rec: SandboxRecord, resume_from: str | None, *, clone: bool
    ) -> QemuRuntime:
        """Start a paused sandbox again: restore its memory, or boot its disk.

        ``clone``: the sandbox is paused on a frozen fork or snapshot directory (a fork
        or snapshot that could not bring it back, or was cut short by a daemon stop);
        it comes back as one more clone of it, on a fresh overlay.
        """
        if clone and resume_from is not None:
            return await self.start_clone(rec, Path(resume_from))
        p = self.paths(rec.id)
        cfg = read_config(p.vm_json)
        if cfg is None:
            raise VmError(f"sandbox {rec.id} has no VM configuration at {p.vm_json}")
        # incoming=False: a vm.json recorded from a restored VM's config (before that was
        # cleared) must not make a disk-mode boot wait for a migration stream forever.
        cfg = dataclasses.replace(
            cfg,
            run_as=self.booter.run_as,
            console_log_bytes=self.settings.console_log_bytes,
            incoming=False,
            tcg_tb_mib=self.booter.tb_mib,
        )
        if not cfg.memory_shared and cfg.memory_file is not None:
            # A template clone. Restored from a full stream: its private RAM file (see
            # _private_memory). Booted from its disk: zeros of its own, not the
            # template's old RAM (the RAM object stays, so a later memory pause's stream
            # names the block a restore from vm.json expects).
            own = p.state / MEMORY_FILE
            memory = own if resume_from is None else _private_memory(cfg.memory_file, p)
            cfg = dataclasses.replace(cfg, memory_file=memory)
        p.run.mkdir(parents=True, exist_ok=True, mode=0o700)
        hostname = rec.name or rec.id
        if resume_from is None:
            vm, agent = await self.booter.boot(cfg, p, hostname)
        else:
            vm, agent = await self.booter.restore(cfg, Path(resume_from), p, hostname, clone=clone)
        crash_point("resume.agent")
        if resume_from is not None and not clone:
            # The consumed pause snapshot can never be restored again: free its space.
            await asyncio.to_thread(shutil.rmtree, resume_from, True)
        crash_point("resume.cleaned")
        return await self._restored(rec, vm, agent)

    async def start_clone(self, rec: SandboxRecord, snapshot_dir: Path) -> QemuRuntime:
        """Start ``rec`` as a copy-on-write clone of the frozen ``snapshot_dir``.

        The snapshot's VM configuration (``vm.json`` beside it) is reused with ``rec``'s
        own names, sockets and disk.
        """
        p = self.paths(rec.id)
        template_cfg = read_config(snapshot_dir / "vm.json")
        if template_cfg is None:
            # The daemon stopped between a fork's save and its disk move.
            manifest = load_manifest(snapshot_dir)
            source = read_config(Path(manifest.disk.path).parent / "vm.json")
            if source is None:
                raise VmError(f"snapshot {snapshot_dir} has no VM configuration to clone")
            await asyncio.to_thread(finish_template, snapshot_dir, source)
            template_cfg = source
        p.state.mkdir(parents=True, exist_ok=True, mode=0o700)
        p.run.mkdir(parents=True, exist_ok=True, mode=0o700)
        p.disk.unlink(missing_ok=True)
        await asyncio.to_thread(create_clone_disk, snapshot_dir, p.disk)
        cfg = dataclasses.replace(
            # Its own files; the same share ports (the device set), each on its own socket.
            p.relocate(template_cfg),
            run_as=self.booter.run_as,
            console_log_bytes=self.settings.console_log_bytes,
            incoming=False,
            tcg_tb_mib=self.booter.tb_mib,
            name=rec.id,
            # A snapshot from before NICs existed restores without one: no network.
            tap=self.tap_of(rec) if template_cfg.nic else None,
            # RAM: a template's memory.ram, mapped copy-on-write; a clone of a clone (a
            # fork child, a resume from a full-stream pause) maps that same file
            # privately again: the stream then rewrites every page (zero pages too), so
            # what the file holds does not matter, while pages equal to it stay shared
            # page cache. The file lives as long as the template, like the template's
            # disk under the clone's overlay (ARCHITECTURE.md, "Copy-on-write memory").
            memory_file=(
                snapshot_dir / MEMORY_FILE
                if (snapshot_dir / MEMORY_FILE).is_file()
                else _private_memory(self._template_here(template_cfg.memory_file), p)
            ),
            memory_shared=False,
        )
        write_config(p.vm_json, cfg)
        crash_point("clone.disk")
        vm, agent = await self.booter.restore(cfg, snapshot_dir, p, rec.name or rec.id, clone=True)
        return await self._restored(rec, vm, agent)

    async def _restored(self, rec: SandboxRecord, vm: QemuVm, agent: AgentClient) -> QemuRuntime:
        """The runtime of a VM just restored; a disk chain grown deep by forks and
        snapshots starts compacting in the background (see hutch.vm.disk_chain)."""
        await compact_if_deep(vm, self.settings.max_disk_layers)
        return self._runtime(rec, vm, agent)

    async def adopt(self, rec: SandboxRecord) -> QemuRuntime | None:
        p = self.paths(rec.id)
        cfg = read_config(p.vm_json)
        if cfg is None:
            return None
        vm = await QemuVm.adopt(cfg)
        if vm is None:
            return None
        try:
            status = await vm.query_status()
        except HutchError as exc:
            log.warning("sandbox %s: cannot query its VM's status: %s", rec.id, exc)
            status = "unknown"
        if status == "inmigrate":
            # A restore cut short before its state loaded: the guest has not run from
            # the snapshot, which stays whole (restore consumes it only before ``cont``).
            # Waiting for an agent that cannot answer would only delay the restart.
            log.info("sandbox %s: its restore had not loaded; ended the VM", rec.id)
            await vm.kill(grace_s=0)
            return None
        if rec.state is SandboxState.PAUSING and save_written(rec.resume_from):
            # A save cut short after its state was written and hashed, with QEMU not yet
            # ended (or ending): ending it now lets reconcile finish the pause (or fork,
            # or snapshot) as it would have finished.
            log.info("sandbox %s: its save was written; ending the VM to finish it", rec.id)
            await vm.kill()
            return None
        # The VM runs on, so what was being saved of it, or the pause snapshot it was
        # restored from, can never be restored: removed before the guest runs again
        # (a restore of it later would pair that memory with a disk that moved on).
        await asyncio.to_thread(discard_stale_saves, self.layout, rec)
        await undo_interrupted_pause(vm)
        try:
            agent = await self.booter.reconnect(p, rec.id, rec.name or rec.id)
        except (GuestError, Timeout) as exc:
            log.warning("sandbox %s: VM alive but its agent does not answer: %s", rec.id, exc)
            await vm.kill()
            return None
        return self._runtime(rec, vm, agent)

    # -- the host side -------------------------------------------------------------------

    async def kill_vm(self, sandbox_id: str) -> None:
        """SIGKILL the sandbox's QEMU, if its pidfile still names one of ours (checked
        against /proc, also with a pidfile and no vm.json: a crash between the two)."""
        p = self.paths(sandbox_id)
        await asyncio.to_thread(kill_verified, p.pidfile, str(p.run))
        await asyncio.to_thread(self.booter.cgroups.release, sandbox_id, record_path(p.pidfile))

    async def cleanup(self, sandbox_id: str) -> None:
        p = self.paths(sandbox_id)
        # Everything of the sandbox goes, so QEMU is SIGKILLed rather than asked to quit:
        # one that does not answer QMP must not hold up a restart.
        await self.kill_vm(sandbox_id)
        await asyncio.to_thread(shutil.rmtree, p.run, True)
        await asyncio.to_thread(shutil.rmtree, p.state, True)

    def close(self) -> None:
        self.booter.cgroups.close()

    def leftover_ids(self) -> set[str]:
        # A group with no directory: a crash between making the group and the sandbox.
        groups = {n for n in self.booter.cgroups.group_names() if SANDBOX_ID_RE.match(n)}
        return self.layout.leftover_ids() | groups


def _private_memory(memory_file: Path | None, p: SandboxPaths) -> Path | None:
    """The file a template clone's RAM maps privately when its stream carries every page:
    the template's ``memory.ram`` while it exists on this host (pages equal to it stay
    shared page cache; a snapshot or pause from another host names this host's
    template of the same key by then, ``QemuBackend._template_here``), else a sparse
    file of the sandbox's own (the template was removed, or this host has none of that
    key: another host's file is not this host's to map even where the path resolves,
    as for workers sharing one machine): the stream's content is the same either way."""
    if memory_file is None:
        return None
    state_root = p.state.parent.parent.resolve()  # <state>/sandboxes/<id> -> <state>
    if memory_file.is_file() and memory_file.resolve().is_relative_to(state_root):
        return memory_file
    return p.state / MEMORY_FILE
