"""Getting a QEMU guest to the point where its agent answers: the VM configuration of a
sandbox or template, the gated cold boot, a restore, and the agent connection that gives
the guest its identity."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path

from hutch.config import Settings
from hutch.errors import HutchError, Timeout, VmError
from hutch.guest.client import AgentClient, GuestIdentity
from hutch.images.build import ImageArtifacts
from hutch.models import Shape
from hutch.runtime.qemu.host import SandboxPaths
from hutch.vm.accel import detect_accel, host_tsc_khz
from hutch.vm.argv import VmConfig
from hutch.vm.cgroup_driver import CgroupDriver
from hutch.vm.cgroups import Policy
from hutch.vm.console import console_tail
from hutch.vm.process import QemuVm, log_tail
from hutch.vm.runas import qemu_runas
from hutch.vm.snapshot import restore

__all__ = ["ADOPT_AGENT_TIMEOUT_S", "Booter", "GuestNetwork", "identity_of"]

#: Seconds a restarted daemon waits for the agent of a running VM it adopts. A live
#: agent answers hello in milliseconds; VMs are checked concurrently, so this bounds the
#: whole check, and the API serves meanwhile (ARCHITECTURE.md, "Crash safety").
ADOPT_AGENT_TIMEOUT_S = 5.0

#: What a guest is told about its network in ``hello`` (see ``GuestIdentity.net``).
GuestNetwork = Callable[[str], "dict[str, str] | None"]


def identity_of(
    sandbox_id: str, hostname: str, net: dict[str, str] | None = None, *, aslr: bool = False
) -> GuestIdentity:
    """A sandbox's guest identity: stable for its lifetime, distinct from every other."""
    machine_id = hashlib.sha256(f"hutch-machine-id:{sandbox_id}".encode()).hexdigest()[:32]
    return GuestIdentity(hostname=hostname, machine_id=machine_id, net=net, aslr=aslr)


class Booter:
    def __init__(self, settings: Settings, guest_network: GuestNetwork | None = None) -> None:
        self.settings = settings
        self.accel = detect_accel(settings.accel)
        # Under TCG the guest's TSC is the host's; telling the kernel its rate avoids a
        # calibration that hangs boot at random (ARCHITECTURE.md, vm/). A template
        # records it (and its key covers it): read once.
        self.tsc_khz = host_tsc_khz() if self.accel == "tcg" else None
        self.run_as = qemu_runas(settings)
        # Every QEMU started here (boots, restores) runs in its own cgroup (hutch.vm.cgroups).
        policy = Policy(settings.cgroup_memory_overhead_mib, settings.cgroup_cpu_quota_pct)
        self.cgroups = CgroupDriver.detect(settings.cgroups, settings.daemon_tag, policy)
        self._boot_gate = asyncio.Semaphore(max(1, os.cpu_count() or 1))
        # The network layer owns addresses; the backend only passes them on to the guest.
        self.guest_network: GuestNetwork = guest_network or (lambda _sandbox_id: None)

    def vm_config(
        self, p: SandboxPaths, name: str, shape: Shape, image: ImageArtifacts, hostname: str
    ) -> VmConfig:
        """A fresh VM of ``image`` at ``shape`` with its files under ``p``. Its NIC sits on
        a hub port (no ``tap``): a sandbox sets its tap, a template's clones plug the NIC
        into their own taps."""
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
            tsc_khz=self.tsc_khz,
            nic=True,
            run_as=self.run_as,
            runtime_disk=image.runtime_disk,
            console_log_bytes=self.settings.console_log_bytes,
            tcg_tb_mib=self.tb_mib,
        )

    @property
    def tb_mib(self) -> int | None:
        """TCG's translation cache per VM (``HUTCH_TCG_TB_MIB``); None under KVM."""
        return self.settings.tcg_tb_mib if self.accel == "tcg" else None

    async def boot(
        self, cfg: VmConfig, p: SandboxPaths, hostname: str
    ) -> tuple[QemuVm, AgentClient]:
        """Cold boot ``cfg`` and connect its agent, at most one boot per host CPU at a
        time: a boot is CPU-bound (~12 s of a core under TCG), and a storm of them on a
        few cores pushes every one past the agent timeout; queued boots wait instead."""
        async with self._boot_gate:
            vm = await QemuVm.launch(cfg, cgroup=self.cgroups.for_vm(p.run.name, cfg))
            try:
                agent = await self.connect(vm, p, hostname=hostname)
            except BaseException:
                await vm.kill()
                raise
        return vm, agent

    async def restore(
        self, cfg: VmConfig, snapshot_dir: Path, p: SandboxPaths, hostname: str, *, clone: bool
    ) -> tuple[QemuVm, AgentClient]:
        """Restore ``cfg`` from ``snapshot_dir`` and connect its agent (the hello gives
        the guest its identity before user code runs again). Restores are not gated."""
        cgroup = self.cgroups.for_vm(p.run.name, cfg)
        vm = await restore(cfg, snapshot_dir, clone=clone, cgroup=cgroup)
        try:
            agent = await self.connect(vm, p, hostname=hostname)
        except BaseException:
            await vm.kill()
            raise
        return vm, agent

    def identity(self, vm: QemuVm, hostname: str | None = None) -> GuestIdentity:
        """The identity of ``vm``'s sandbox (hostname defaults to its id)."""
        name = vm.cfg.name
        return identity_of(
            name, hostname or name, self.guest_network(name), aslr=self.settings.guest_aslr
        )

    async def connect(
        self, vm: QemuVm, p: SandboxPaths, hostname: str | None = None
    ) -> AgentClient:
        """Wait for the guest agent, failing fast if the VM dies while booting.

        The hello gives the guest its identity (hostname, machine-id), the time and fresh
        entropy: a clone restored from a snapshot takes them before user code runs.
        """
        started = time.monotonic()
        connect = asyncio.ensure_future(
            AgentClient.connect(
                p.agent_socket,
                timeout_s=self.settings.boot_timeout_s,
                identity=self.identity(vm, hostname),
            )
        )
        died = asyncio.ensure_future(vm.wait_exited())
        try:
            done, _ = await asyncio.wait({connect, died}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            died.cancel()
        if connect in done:
            try:
                return connect.result()
            except Timeout as exc:
                report = await _silent_guest_report(vm, p, time.monotonic() - started)
                raise Timeout(f"{exc}\n{report}") from exc
        connect.cancel()
        with contextlib.suppress(BaseException):
            await connect
        raise VmError(
            "the VM stopped while booting; console tail:\n" + console_tail(p.console_log, 3000),
            stderr=log_tail(p.qemu_log, 2000),
        )

    async def reconnect(self, p: SandboxPaths, sandbox_id: str, hostname: str) -> AgentClient:
        """The agent of a VM found running after a daemon restart (a short wait: a live
        agent answers at once)."""
        return await AgentClient.connect(
            p.agent_socket,
            timeout_s=ADOPT_AGENT_TIMEOUT_S,
            identity=identity_of(
                sandbox_id,
                hostname,
                self.guest_network(sandbox_id),
                aslr=self.settings.guest_aslr,
            ),
        )


async def _silent_guest_report(vm: QemuVm, p: SandboxPaths, waited_s: float) -> str:
    """What a guest whose agent never answered was doing, for the error (the run
    directory with its console log may be gone by the time anyone reads it): QEMU's
    run state, the CPU it has used since it started, against how long hutch waited
    (busy: a slow boot; next to none: a guest halted waiting for an interrupt), and the
    console's last lines."""
    try:
        async with asyncio.timeout(2):
            status = await vm.query_status()
    except (HutchError, TimeoutError) as exc:
        status = f"unknown ({exc or 'no QMP answer in 2 s'})"
    cpu = vm.cpu_seconds()
    used = "unknown" if cpu is None else f"{cpu:.1f} s"
    return (
        f"QEMU {vm.pid}: {status}, {used} of CPU used, {waited_s:.0f} s waited for the "
        f"agent; console tail:\n{console_tail(p.console_log, 3000)}"
    )
