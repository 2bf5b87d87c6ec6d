"""The production VM backend: one QEMU ``microvm`` per sandbox, a qcow2 overlay on the
image's read-only root filesystem, and the guest agent over virtio-serial.

Where things live is described in ARCHITECTURE.md ("State on disk"). ``vm.json`` in the
sandbox directory records the exact VM configuration so that a restarted daemon can adopt
the VM without guessing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

from hutch.config import Settings
from hutch.crashpoints import crash_point
from hutch.errors import GuestError, HutchError, NotFound, Timeout, VmError
from hutch.guest.client import AgentClient, GuestIdentity
from hutch.images.build import ImageArtifacts
from hutch.models import (
    SANDBOX_ID_RE,
    NetworkMode,
    PauseMode,
    SandboxRecord,
    SandboxState,
    Shape,
)
from hutch.net.addressing import tap_name
from hutch.services.qemu_host import (
    SandboxPaths,
    discard_template_build,
    finish_template,
    kill_verified,
    publish_template,
    read_config,
    save_written,
    tail,
    template_complete,
    write_config,
)
from hutch.storage.overlay import create_overlay
from hutch.vm.accel import detect_accel, host_tsc_khz
from hutch.vm.argv import VmConfig
from hutch.vm.cgroup_driver import CgroupDriver, record_path
from hutch.vm.cgroups import Policy
from hutch.vm.console import console_tail
from hutch.vm.disk_chain import compact_if_deep, disk_chain
from hutch.vm.process import QemuVm
from hutch.vm.runas import qemu_user
from hutch.vm.snapshot import (
    CONSUMED_MARKER,
    FROZEN_MARKER,
    MANIFEST_FILE,
    create_clone_disk,
    finish_interrupted_save,
    load_manifest,
    restore,
    save_snapshot,
)

log = logging.getLogger(__name__)

#: Seconds a restarted daemon waits for the agent of a running VM it adopts. A live
#: agent answers hello in milliseconds; VMs are checked concurrently, so this bounds the
#: whole check, and the API serves meanwhile (ARCHITECTURE.md, "Crash safety").
ADOPT_AGENT_TIMEOUT_S = 5.0


class QemuRuntime:
    def __init__(self, sandbox_id: str, vm: QemuVm, agent: AgentClient, paths: SandboxPaths):
        self.sandbox_id = sandbox_id
        self.vm = vm
        self.agent = agent
        self.paths = paths

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


#: What a guest is told about its network in ``hello`` (see ``GuestIdentity.net``).
GuestNetwork = Callable[[str], "dict[str, str] | None"]


class QemuBackend:
    def __init__(self, settings: Settings, guest_network: GuestNetwork | None = None) -> None:
        self.settings = settings
        self.accel = detect_accel(settings.accel)
        self.run_as = qemu_user(settings)
        policy = Policy(settings.cgroup_memory_overhead_mib, settings.cgroup_cpu_quota_pct)
        self.cgroups = CgroupDriver.detect(settings.cgroups, settings.daemon_tag, policy)
        self._boot_gate = asyncio.Semaphore(max(1, os.cpu_count() or 1))
        # The network layer owns addresses; the backend only passes them on to the guest.
        self.guest_network: GuestNetwork = guest_network or (lambda _sandbox_id: None)

    def tap_of(self, rec: SandboxRecord) -> str | None:
        """The host tap of ``rec``'s NIC (created by the network layer), None with no network."""
        if rec.network is NetworkMode.NONE:
            return None
        return tap_name(self.settings.daemon_tag, rec.id)

    def paths(self, sandbox_id: str) -> SandboxPaths:
        return SandboxPaths(
            state=self.settings.sandboxes_dir / sandbox_id,
            run=self.settings.run_dir / sandbox_id,
        )

    def vm_config(self, rec: SandboxRecord, image: ImageArtifacts) -> VmConfig:
        cfg = self._vm_config(self.paths(rec.id), rec.id, rec.shape, image, rec.name or rec.id)
        return dataclasses.replace(cfg, tap=self.tap_of(rec))

    def _vm_config(
        self, p: SandboxPaths, name: str, shape: Shape, image: ImageArtifacts, hostname: str
    ) -> VmConfig:
        """Templates get a NIC on a hub port: their clones plug it into their own taps."""
        return VmConfig(
            name=name,
            vcpus=shape.vcpus,
            memory_mib=shape.memory_mib,
            kernel=image.kernel,
            initrd=image.initrd,
            cmdline=f"{image.cmdline} hutch.hostname={hostname}",
            disk=p.disk,
            accel=self.accel,
            qmp_socket=p.qmp_socket,
            agent_socket=p.agent_socket,
            console_log=p.console_log,
            pidfile=p.pidfile,
            qemu_log=p.qemu_log,
            # Under TCG the guest's TSC is the host's; telling the kernel its rate avoids
            # a calibration that hangs boot at random (ARCHITECTURE.md, vm/).
            tsc_khz=host_tsc_khz() if self.accel == "tcg" else None,
            nic=True,
            run_as=self.run_as,
            runtime_disk=image.runtime_disk,
            console_log_bytes=self.settings.console_log_bytes,
            tcg_tb_mib=self._tb_mib,
        )

    @property
    def _tb_mib(self) -> int | None:
        return self.settings.tcg_tb_mib if self.accel == "tcg" else None

    async def start(self, rec: SandboxRecord, image: ImageArtifacts) -> QemuRuntime:
        p = self.paths(rec.id)
        p.state.mkdir(parents=True, mode=0o700)
        p.run.mkdir(parents=True, mode=0o700)
        await asyncio.to_thread(create_overlay, image.rootfs, p.disk, rec.shape.disk_gib)
        cfg = self.vm_config(rec, image)
        write_config(p.vm_json, cfg)
        vm, agent = await self._boot(cfg, p, rec.name or rec.id)
        return QemuRuntime(rec.id, vm, agent, p)

    async def _boot(
        self, cfg: VmConfig, p: SandboxPaths, hostname: str
    ) -> tuple[QemuVm, AgentClient]:
        """Cold boot ``cfg`` and connect its agent, at most one boot per host CPU at a
        time: a boot is CPU-bound (~12 s of a core under TCG), and a storm of them on a
        few cores pushes every one past the agent timeout; queued boots wait instead."""
        async with self._boot_gate:
            vm = await QemuVm.launch(cfg, cgroup=self.cgroups.for_vm(p.run.name, cfg))
            try:
                agent = await self._connect_agent(vm, p, hostname=hostname)
            except BaseException:
                await vm.kill()
                raise
        return vm, agent

    # -- pause / resume / fork ----------------------------------------------------------

    def pause_dir(self, sandbox_id: str) -> Path:
        return self.paths(sandbox_id).state / "pause"

    def fork_dir(self, snapshot_id: str) -> Path:
        return self.settings.state_dir / "snapshots" / snapshot_id

    async def pause(self, runtime: QemuRuntime, mode: PauseMode) -> str | None:
        """Stop the VM, keeping memory state (memory mode) or only the disk.

        Returns the snapshot directory a resume restores from (None in disk mode: the
        guest boots again). On failure the VM keeps running and ``runtime.agent`` is a
        fresh connection.
        """
        if mode is PauseMode.DISK:
            with contextlib.suppress(HutchError):
                await runtime.agent.run(["sync"], timeout_s=30)
            await runtime.agent.close()
            await runtime.vm.kill(grace_s=10.0)
            crash_point("pause.disk_quit")
            return None
        dest = self.pause_dir(runtime.sandbox_id)
        await asyncio.to_thread(shutil.rmtree, dest, True)
        await runtime.agent.close()
        try:
            await save_snapshot(runtime.vm, dest, ram_in_file=False)
        except BaseException:
            runtime.agent = await self._connect_agent(runtime.vm, runtime.paths)
            raise
        return str(dest)

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
            run_as=self.run_as,
            console_log_bytes=self.settings.console_log_bytes,
            incoming=False,
            tcg_tb_mib=self._tb_mib,
        )
        p.run.mkdir(parents=True, exist_ok=True, mode=0o700)
        if resume_from is None:
            vm, agent = await self._boot(cfg, p, rec.name or rec.id)
        else:
            cgroup = self.cgroups.for_vm(p.run.name, cfg)
            vm = await restore(cfg, Path(resume_from), clone=clone, cgroup=cgroup)
            try:
                agent = await self._connect_agent(vm, p, hostname=rec.name or rec.id)
            except BaseException:
                await vm.kill()
                raise
        crash_point("resume.agent")
        if resume_from is not None and not clone:
            # The consumed pause snapshot can never be restored again: free its space.
            await asyncio.to_thread(shutil.rmtree, resume_from, True)
        crash_point("resume.cleaned")
        return await self._running(rec, vm, agent)

    async def freeze_for_fork(self, runtime: QemuRuntime, snapshot_dir: Path) -> None:
        """Save the VM's state and take its disk into ``snapshot_dir``; QEMU exits.

        From then on the snapshot is the template of the parent and every child.
        """
        snapshot_dir.parent.mkdir(parents=True, exist_ok=True)
        await runtime.agent.close()
        try:
            await save_snapshot(runtime.vm, snapshot_dir, ram_in_file=False)
        except BaseException:
            runtime.agent = await self._connect_agent(runtime.vm, runtime.paths)
            raise
        # The running VM's config says incoming=True if it was itself restored; the
        # snapshot records the machine, which restore() starts -incoming anyway.
        cfg = dataclasses.replace(runtime.vm.cfg, incoming=False)
        await asyncio.to_thread(finish_template, snapshot_dir, cfg)
        crash_point("freeze.done")

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
            template_cfg,
            run_as=self.run_as,
            console_log_bytes=self.settings.console_log_bytes,
            incoming=False,
            tcg_tb_mib=self._tb_mib,
            name=rec.id,
            disk=p.disk,
            qmp_socket=p.qmp_socket,
            agent_socket=p.agent_socket,
            console_log=p.console_log,
            pidfile=p.pidfile,
            qemu_log=p.qemu_log,
            # A snapshot from before NICs existed restores without one: no network.
            tap=self.tap_of(rec) if template_cfg.nic else None,
        )
        write_config(p.vm_json, cfg)
        crash_point("clone.disk")
        vm = await restore(
            cfg, snapshot_dir, clone=True, cgroup=self.cgroups.for_vm(p.run.name, cfg)
        )
        try:
            agent = await self._connect_agent(vm, p, hostname=rec.name or rec.id)
        except BaseException:
            await vm.kill()
            raise
        return await self._running(rec, vm, agent)

    async def _running(self, rec: SandboxRecord, vm: QemuVm, agent: AgentClient) -> QemuRuntime:
        """The runtime of a VM just restored; a disk chain grown deep by forks and
        snapshots starts compacting in the background (see hutch.vm.disk_chain)."""
        await compact_if_deep(vm, self.settings.max_disk_layers)
        return QemuRuntime(rec.id, vm, agent, self.paths(rec.id))

    async def retake_identity(self, runtime: QemuRuntime, rec: SandboxRecord) -> None:
        await runtime.agent.close()
        runtime.agent = await self._connect_agent(runtime.vm, runtime.paths, rec.name or rec.id)

    # -- templates: create = restore a snapshot taken once per (image, shape) --------------

    def template_dir(self, image: ImageArtifacts, shape: Shape) -> Path:
        # "-n1": templates with a NIC (older ones cannot give their clones a network).
        key = f"{image.name}-{image.digest}-{shape.vcpus}c-{shape.memory_mib}m-{shape.disk_gib}g-n1"
        return self.settings.state_dir / "templates" / key

    def find_template(self, image: ImageArtifacts, shape: Shape) -> Path | None:
        d = self.template_dir(image, shape)
        return d if (d / "vm.json").is_file() and (d / MANIFEST_FILE).is_file() else None

    async def build_template(self, image: ImageArtifacts, shape: Shape) -> Path:
        """Boot ``image`` once at ``shape``, let it settle, and freeze it as the template
        every later create at that shape restores from (no cold boot on the hot path)."""
        final = self.template_dir(image, shape)
        if self.find_template(image, shape):
            return final
        work = SandboxPaths(
            state=final.parent / (final.name + ".build"),
            run=self.settings.run_dir / ("tpl-" + secrets.token_hex(4)),
        )
        await asyncio.to_thread(discard_template_build, work.state)
        work.state.mkdir(parents=True, mode=0o700)
        work.run.mkdir(parents=True, mode=0o700)
        try:
            await asyncio.to_thread(create_overlay, image.rootfs, work.disk, shape.disk_gib)
            cfg = self._vm_config(work, "template", shape, image, "hutch")
            write_config(work.vm_json, cfg)
            vm, agent = await self._boot(cfg, work, "hutch")
            try:
                # Let boot-time work finish so that no clone inherits it half-done.
                await _settle(agent, image)
                await agent.close()
                snap = work.state / "snapshot"
                await save_snapshot(vm, snap, ram_in_file=False)
            except BaseException:
                await vm.kill()
                raise
            await asyncio.to_thread(finish_template, snap, cfg)
            await asyncio.to_thread(publish_template, snap, final)
        finally:
            await asyncio.to_thread(shutil.rmtree, work.run, True)
            await asyncio.to_thread(discard_template_build, work.state)
        return final

    def remove_templates(self, image_name: str) -> list[str]:
        """Remove every template of image ``image_name`` (an imported image being
        deleted); return their directory names."""
        root = self.settings.state_dir / "templates"
        pattern = re.compile(rf"^{re.escape(image_name)}-[0-9a-f]{{16}}-\d+c-")
        removed = []
        for d in root.iterdir() if root.is_dir() else ():
            if pattern.match(d.name) and not d.name.endswith(".build"):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d.name)
        return removed

    def discard_unfinished_templates(self) -> None:
        root = self.settings.state_dir / "templates"
        if root.is_dir():
            for d in root.glob("*.build"):
                discard_template_build(d)
        run_root = self.settings.run_dir
        if run_root.is_dir():
            for d in run_root.glob("tpl-*"):
                shutil.rmtree(d, ignore_errors=True)
        self.cgroups.reclaim(lambda name: name.startswith("tpl-"))

    async def recover_snapshot(self, sandbox_id: str, snapshot_dir: str, *, clone: bool) -> bool:
        d = Path(snapshot_dir)
        p = self.paths(sandbox_id)
        if not (d / MANIFEST_FILE).is_file():
            # A save cut short after QEMU was told to end: make sure it has, then
            # finish the save the way it would have finished.
            await asyncio.to_thread(kill_verified, p.pidfile, str(p.run))
            if await asyncio.to_thread(finish_interrupted_save, d):
                log.info("sandbox %s: finished the interrupted save in %s", sandbox_id, d)
        if not (d / MANIFEST_FILE).is_file():
            return False
        if clone:
            # A fork or named snapshot cut short after its save: finish the freeze
            # (vm.json, then the disk taken in) as freeze_for_fork would have. Until the
            # disk has moved, the sandbox's own vm.json is the snapshot's configuration.
            source = read_config(d / "vm.json") or read_config(p.vm_json)
            if source is None:
                log.warning("sandbox %s: %s has no VM configuration to finish", sandbox_id, d)
                return False
            try:
                await asyncio.to_thread(finish_template, d, source)
            except (OSError, HutchError) as exc:
                log.warning("sandbox %s: cannot finish the snapshot %s: %s", sandbox_id, d, exc)
                return False
        return not (d / CONSUMED_MARKER).exists()

    def snapshot_complete(self, snapshot_dir: Path) -> bool:
        return template_complete(snapshot_dir)

    def snapshot_size(self, snapshot_dir: Path) -> int:
        """Bytes the snapshot holds on disk (allocated, not apparent: disks are sparse)."""
        return sum(f.stat().st_blocks * 512 for f in snapshot_dir.rglob("*") if f.is_file())

    def collect_snapshots(self, live_ids: set[str], keep: set[str]) -> list[str]:
        """Remove the snapshot directories nothing reaches; return their names.

        Reached: a directory in ``keep`` (a snapshot row, ready or being saved; a live
        sandbox's ``resume_from``), and every qcow2 layer under a live sandbox's disk,
        its pause snapshot's disk or a kept directory's disk. A chain that cannot be read
        stops the collection (nothing is removed on a guess).
        """
        root = self.settings.state_dir / "snapshots"
        if not root.is_dir():
            return []
        kept = {Path(k).resolve() for k in keep}
        try:
            used = self._disks_used_by(live_ids)
            for d in kept:
                used |= self._chain(d / "disk.qcow2")
        except HutchError as exc:
            log.warning("snapshot collection skipped: %s", exc)
            return []
        removed = []
        for snap in root.iterdir():
            if snap.resolve() in kept or (snap / "disk.qcow2").resolve() in used:
                continue
            shutil.rmtree(snap, ignore_errors=True)
            removed.append(snap.name)
        return removed

    def _chain(self, disk: Path | None) -> set[Path]:
        return {p.resolve() for p in disk_chain(disk)[0]} if disk is not None else set()

    def _disks_used_by(self, live_ids: set[str]) -> set[Path]:
        used: set[Path] = set()
        for sandbox_id in live_ids:
            used |= self._chain(self.paths(sandbox_id).disk)
            pause = self.pause_dir(sandbox_id)
            if (pause / MANIFEST_FILE).exists():
                with contextlib.suppress(HutchError):
                    used |= self._chain(Path(load_manifest(pause).disk.path))
        return used

    async def _connect_agent(
        self, vm: QemuVm, p: SandboxPaths, hostname: str | None = None
    ) -> AgentClient:
        """Wait for the guest agent, failing fast if the VM dies while booting.

        The hello gives the guest its identity (hostname, machine-id), the time and fresh
        entropy: a clone restored from a snapshot takes them before user code runs again.
        """
        connect = asyncio.ensure_future(
            AgentClient.connect(
                p.agent_socket,
                timeout_s=self.settings.boot_timeout_s,
                identity=identity_of(
                    vm.cfg.name, hostname or vm.cfg.name, self.guest_network(vm.cfg.name)
                ),
            )
        )
        died = asyncio.ensure_future(vm.wait_exited())
        try:
            done, _ = await asyncio.wait({connect, died}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            died.cancel()
        if connect in done:
            return connect.result()
        connect.cancel()
        with contextlib.suppress(BaseException):
            await connect
        raise VmError(
            "the VM stopped while booting; console tail:\n" + console_tail(p.console_log, 3000),
            stderr=tail(p.qemu_log, 2000),
        )

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
        await asyncio.to_thread(self._discard_stale_saves, rec)
        await _undo_interrupted_pause(vm)
        try:
            agent = await AgentClient.connect(
                p.agent_socket,
                timeout_s=ADOPT_AGENT_TIMEOUT_S,
                identity=identity_of(rec.id, rec.name or rec.id, self.guest_network(rec.id)),
            )
        except (GuestError, Timeout) as exc:
            log.warning("sandbox %s: VM alive but its agent does not answer: %s", rec.id, exc)
            await vm.kill()
            return None
        return QemuRuntime(rec.id, vm, agent, p)

    def _discard_stale_saves(self, rec: SandboxRecord) -> None:
        shutil.rmtree(self.pause_dir(rec.id), ignore_errors=True)
        snapshots = (self.settings.state_dir / "snapshots").resolve()
        if rec.state is SandboxState.PAUSING and rec.resume_from is not None:
            target = Path(rec.resume_from).resolve()
            # Only a fork or snapshot directory of this very save (never a frozen one:
            # a save in progress has not ended QEMU, so nothing was restored from it).
            if target.parent == snapshots and not (target / FROZEN_MARKER).exists():
                shutil.rmtree(target, ignore_errors=True)

    async def kill_vm(self, sandbox_id: str) -> None:
        """SIGKILL the sandbox's QEMU, if its pidfile still names one of ours (checked
        against /proc, also with a pidfile and no vm.json: a crash between the two)."""
        p = self.paths(sandbox_id)
        await asyncio.to_thread(kill_verified, p.pidfile, str(p.run))
        await asyncio.to_thread(self.cgroups.release, sandbox_id, record_path(p.pidfile))

    async def cleanup(self, sandbox_id: str) -> None:
        p = self.paths(sandbox_id)
        # Everything of the sandbox goes, so QEMU is SIGKILLed rather than asked to quit:
        # one that does not answer QMP must not hold up a restart.
        await self.kill_vm(sandbox_id)
        await asyncio.to_thread(shutil.rmtree, p.run, True)
        await asyncio.to_thread(shutil.rmtree, p.state, True)

    def close(self) -> None:
        self.cgroups.close()

    def leftover_ids(self) -> set[str]:
        found: set[str] = set()
        for root in (self.settings.sandboxes_dir, self.settings.run_dir):
            if root.is_dir():
                found.update(d.name for d in root.iterdir() if SANDBOX_ID_RE.match(d.name))
        found.update(n for n in self.cgroups.group_names() if SANDBOX_ID_RE.match(n))
        return found


async def _settle(agent: AgentClient, image: ImageArtifacts) -> None:
    """Wait for the guest's boot-time work (growing the root filesystem) to end. An
    imported image may have no shell or pgrep: there the agent itself does that work
    and marks it done (``hutch_agent.runtime.BOOT_DONE``)."""
    if image.runtime_disk is None:
        await agent.run(
            ["sh", "-c", "while pgrep -x resize2fs >/dev/null; do sleep 0.1; done; sync"],
            timeout_s=120,
        )
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 120
    while True:
        try:
            await agent.stat(RUNTIME_BOOT_DONE)
            return
        except NotFound:
            if loop.time() > deadline:
                raise Timeout("the guest did not finish growing its root filesystem") from None
            await asyncio.sleep(0.1)


#: Written by the agent on an imported image once boot-time work is done.
RUNTIME_BOOT_DONE = "/run/.hutch/boot-done"


async def _undo_interrupted_pause(vm: QemuVm) -> None:
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


def identity_of(sandbox_id: str, hostname: str, net: dict[str, str] | None = None) -> GuestIdentity:
    """A sandbox's guest identity: stable for its lifetime, distinct from every other."""
    machine_id = hashlib.sha256(f"hutch-machine-id:{sandbox_id}".encode()).hexdigest()[:32]
    return GuestIdentity(hostname=hostname, machine_id=machine_id, net=net)
