"""One QEMU process per sandbox, controlled over QMP.

QEMU runs detached from the daemon (own session, no inherited fds, output to
``qemu.log``), so a daemon restart or SIGKILL leaves guests running; a new daemon
re-attaches with :meth:`QemuVm.adopt`. The serial console goes through a FIFO that a
:class:`~hutch.vm.console.ConsolePump` of the VM drains into a capped, rotated log.
Process liveness is tracked through a pidfd, which also works for a process that is not
our child and can never name a reused pid.

With a :class:`~hutch.vm.cgroup_driver.SandboxCgroup` QEMU runs in its own cgroup:
created with its limits before QEMU starts, joined between fork and exec, recorded in
``cgroup.json`` beside the pidfile (so :meth:`QemuVm.adopt` finds it again), consulted
when QEMU exits (an OOM kill makes ``exit_reason`` say "out of memory") and removed once
QEMU is gone (:meth:`QemuVm.kill`).

States (``VmState``)::

    RUNNING ──kill()──► STOPPING ──► EXITED
       └──── QEMU exits on its own ───► EXITED
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient
from qemu.qmp import QMPError as _QMPError

from hutch.errors import StateError, VmError
from hutch.vm.argv import VmConfig, build_argv, in_cgroups
from hutch.vm.cgroup_driver import SandboxCgroup, record_path
from hutch.vm.console import ConsolePump

__all__ = ["OUT_OF_MEMORY", "QemuVm", "VmState", "cmdline_names", "kill_verified", "log_tail"]

log = logging.getLogger(__name__)

_LOG_TAIL_BYTES = 4000
_KILL_WAIT_S = 5.0

#: How ``exit_reason`` starts when the kernel's OOM killer ended QEMU.
OUT_OF_MEMORY = "out of memory"


class VmState(enum.StrEnum):
    RUNNING = "running"
    STOPPING = "stopping"
    EXITED = "exited"


def log_tail(path: Path, limit: int = _LOG_TAIL_BYTES) -> str:
    """The last ``limit`` bytes of a log file as text ("" if it cannot be read)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def cmdline_names(pid: int, needle: str) -> bool:
    """True when ``/proc/<pid>/cmdline`` has an argument containing ``needle``."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return any(needle in arg for arg in raw.decode(errors="replace").split("\0"))


def kill_verified(pidfile: Path, marker: str, wait_s: float = _KILL_WAIT_S) -> None:
    """SIGKILL the process ``pidfile`` names if one of its arguments contains ``marker``
    (a path only our QEMU has on its command line: a reused pid is left alone), and
    wait until it is really gone (up to ``wait_s``): files it held (disk, sockets) are
    only safe to touch then. Nothing to kill is fine."""
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return
    if not cmdline_names(pid, marker):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return
        if stat.rpartition(")")[2].split()[0] in ("Z", "X"):
            return
        time.sleep(0.01)
    log.warning("QEMU pid %d did not exit %.0f s after SIGKILL", pid, wait_s)


def _pidfd_exited(pidfd: int) -> bool:
    """A pidfd polls readable once its process has exited."""
    import select

    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


class QemuVm:
    """A running (or exited) QEMU. Create with :meth:`launch` or :meth:`adopt`."""

    def __init__(
        self,
        cfg: VmConfig,
        argv: list[str],
        pid: int,
        pidfd: int,
        proc: subprocess.Popen[bytes] | None,
        console: ConsolePump | None = None,
        cgroup: SandboxCgroup | None = None,
    ) -> None:
        self.cfg = cfg
        #: The cgroup QEMU runs in (None: none, cgroups off or a VM launched before).
        self.cgroup = cgroup
        self._console = console
        self.argv = argv
        self._pid = pid
        self._pidfd: int | None = pidfd
        # Set only when we started QEMU: we must reap our own child (no zombie).
        self._proc = proc
        self._qmp: QMPClient | None = None
        self._state = VmState.RUNNING
        self._exited = asyncio.Event()
        self._kill_task: asyncio.Task[None] | None = None
        self.returncode: int | None = None
        #: Why QEMU exited, when known: "killed by hutch", "exit status N", "signal SIGx",
        #: "out of memory: ..." (the OOM killer ended it; see ``OUT_OF_MEMORY``).
        self.exit_reason: str | None = None
        asyncio.get_running_loop().add_reader(pidfd, self._on_exit)

    # ------------------------------------------------------------------ creation
    @classmethod
    async def launch(
        cls,
        cfg: VmConfig,
        *,
        cgroup: SandboxCgroup | None = None,
        ready_timeout_s: float = 10.0,
    ) -> QemuVm:
        """Start QEMU for ``cfg`` and wait until QMP answers ``query-status``.

        ``cgroup`` (not yet created): QEMU's group, made with its limits and joined
        before QEMU runs; the VM owns it from then on.

        Raises ``VmError`` (with argv and the tail of ``qemu.log``) when QEMU exits or
        QMP does not answer within ``ready_timeout_s`` seconds; QEMU is killed and its
        sockets, pidfile and cgroup removed first, so nothing is left behind.
        """
        argv = build_argv(cfg)
        for stale in (cfg.qmp_socket, cfg.agent_socket, cfg.pidfile):
            _unlink(stale)
        spawn = argv
        if cgroup is not None:
            # Recorded before it exists: a daemon killed in between still finds it.
            cgroup.save(record_path(cfg.pidfile))
            try:
                cgroup.create()
            except VmError:
                _unlink(record_path(cfg.pidfile))
                raise
            spawn = in_cgroups(cgroup.procs_files(), argv)
        # Before QEMU starts: it opens the console FIFOs the pump creates.
        try:
            console = ConsolePump.for_launch(cfg.console_log, cfg.console_log_bytes)
        except OSError as exc:
            _release(cgroup, cfg)
            raise VmError(f"cannot set up the console of {cfg.name}: {exc}", argv=argv) from exc
        try:
            with cfg.qemu_log.open("wb") as out:
                # Popen, not asyncio's subprocess: we reap through the pidfd ourselves
                # (asyncio's child watcher would need the loop for the VM's whole life),
                # and fork+exec blocks only for milliseconds.
                proc = subprocess.Popen(  # noqa: ASYNC220
                    spawn,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    close_fds=True,
                    # Own session: no SIGINT/SIGHUP from the daemon's terminal or group,
                    # and the daemon may die without taking QEMU along.
                    start_new_session=True,
                )
        except OSError as exc:
            console.close()
            _release(cgroup, cfg)
            raise VmError(f"cannot start QEMU: {exc}", argv=argv) from exc
        pidfd = os.pidfd_open(proc.pid)
        vm = cls(cfg, argv, proc.pid, pidfd, proc, console, cgroup)
        started = time.monotonic()
        try:
            await vm._connect_qmp(ready_timeout_s)
            status = await vm.query_status()
        except BaseException as exc:
            await vm.kill(grace_s=0)
            if isinstance(exc, VmError | asyncio.CancelledError):
                raise
            raise VmError(
                f"QEMU did not become ready: {exc}", argv=argv, stderr=log_tail(cfg.qemu_log)
            ) from exc
        log.info(
            "vm %s: pid %d, QMP ready in %.3fs, status %s",
            cfg.name,
            vm.pid,
            time.monotonic() - started,
            status,
        )
        return vm

    @classmethod
    async def adopt(cls, cfg: VmConfig, *, connect_timeout_s: float = 5.0) -> QemuVm | None:
        """Re-attach to a QEMU started by an earlier daemon, via ``cfg.pidfile``.

        Returns None when the process is gone or the pid now belongs to another program
        (its cmdline must name ``cfg.qmp_socket``; a reused pid is never signalled).
        Raises ``VmError`` when the process is ours but QMP does not answer.
        """
        try:
            pid = int(cfg.pidfile.read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            # Open the pidfd first and check the cmdline after: the pidfd then refers to
            # exactly the process we checked, even if the pid is reused later.
            pidfd = os.pidfd_open(pid)
        except OSError:
            return None
        if not cmdline_names(pid, str(cfg.qmp_socket)) or _pidfd_exited(pidfd):
            os.close(pidfd)
            return None
        try:
            console = ConsolePump.for_adopt(cfg.console_log, cfg.console_log_bytes)
        except OSError as exc:
            log.warning("vm %s: its console is not logged: %s", cfg.name, exc)
            console = None
        # The group its launcher made (None for a VM launched without one).
        cgroup = SandboxCgroup.load(record_path(cfg.pidfile))
        vm = cls(cfg, build_argv(cfg), pid, pidfd, None, console, cgroup)
        try:
            await vm._connect_qmp(connect_timeout_s)
        except VmError:
            vm._close_fds()
            vm._close_console()
            raise
        return vm

    async def _connect_qmp(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while True:
            if self._exited.is_set() or (self._pidfd is not None and _pidfd_exited(self._pidfd)):
                self._on_exit()
                raise VmError(
                    f"QEMU exited during start-up ({self.exit_reason})",
                    argv=self.argv,
                    stderr=log_tail(self.cfg.qemu_log),
                )
            if self.cfg.qmp_socket.exists():
                client = QMPClient(self.cfg.name)
                try:
                    await asyncio.wait_for(client.connect(str(self.cfg.qmp_socket)), 2.0)
                except (_QMPError, OSError, TimeoutError) as exc:
                    last = exc
                    with contextlib.suppress(Exception):
                        await client.disconnect()
                else:
                    self._qmp = client
                    return
            if time.monotonic() >= deadline:
                raise VmError(
                    f"QMP socket {self.cfg.qmp_socket} did not answer within {timeout_s}s"
                    + (f" (last error: {last})" if last else ""),
                    argv=self.argv,
                    stderr=log_tail(self.cfg.qemu_log),
                )
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------------ queries
    @property
    def pid(self) -> int:
        return self._pid

    @property
    def state(self) -> VmState:
        return self._state

    def is_alive(self) -> bool:
        """True until QEMU has exited (checked now, not cached)."""
        if self._pidfd is None:
            return False
        if _pidfd_exited(self._pidfd):
            self._on_exit()
            return False
        return True

    async def wait_exited(self) -> None:
        """Return once QEMU has exited, however it happened."""
        await self._exited.wait()

    def cpu_seconds(self) -> float | None:
        """CPU time QEMU has used so far, every thread's (user + system; None once it has
        gone). A guest still booting burns CPU; one waiting for an interrupt that never
        comes uses next to none: a failure report tells the two apart with it."""
        try:
            fields = Path(f"/proc/{self._pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            return None
        # utime and stime are the 14th and 15th fields, 12th and 13th after the name.
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    async def query_status(self) -> str:
        """QMP ``query-status`` → ``running``, ``paused``, ``shutdown``, ..."""
        result = await self.qmp("query-status")
        if not isinstance(result, dict) or not isinstance(result.get("status"), str):
            raise VmError(f"unexpected query-status reply: {result!r}")
        status: str = result["status"]
        return status

    async def qmp(self, cmd: str, **args: Any) -> object:
        """Run one QMP command; raises ``StateError`` unless running, ``VmError`` when
        QEMU answers with an error or the connection fails."""
        if self._state is not VmState.RUNNING or self._qmp is None:
            raise StateError(f"VM {self.cfg.name}", self._state.value, [VmState.RUNNING.value])
        try:
            return await self._qmp.execute(cmd, args or None)
        except _QMPError as exc:
            raise VmError(f"QMP {cmd} failed: {exc}") from exc

    async def send_fd(self, name: str, fd: int) -> None:
        """Pass ``fd`` to QEMU as ``name`` (SCM_RIGHTS + QMP ``getfd``), e.g. for a
        ``migrate``/``migrate-incoming`` URI ``fd:<name>``. QEMU gets its own copy; the
        caller still owns (and closes) ``fd``. A name already in use is replaced.

        This is how QEMU reads or writes snapshot files it could not open itself (and
        must not spawn a helper for: ``-sandbox spawn=deny``). Raises like :meth:`qmp`.
        """
        if self._state is not VmState.RUNNING or self._qmp is None:
            raise StateError(f"VM {self.cfg.name}", self._state.value, [VmState.RUNNING.value])
        try:
            # The fd rides on a byte sent just before the command; QEMU attaches it to
            # the next command it reads, which must therefore be this getfd.
            self._qmp.send_fd_scm(fd)
            await self._qmp.execute("getfd", {"fdname": name})
        except (_QMPError, OSError) as exc:
            raise VmError(f"passing fd {name!r} to QEMU failed: {exc}") from exc

    # ------------------------------------------------------------------ teardown
    async def kill(self, grace_s: float = 2.0) -> None:
        """Stop QEMU: QMP ``quit``, then SIGTERM, then SIGKILL, each after ``grace_s``.

        Idempotent and safe to call concurrently, after a crash, or on a VM that is
        already gone; never raises for that. Leaves the VM EXITED with its QMP and
        agent sockets, pidfile and cgroup removed.
        """
        if self._kill_task is None:
            self._kill_task = asyncio.get_running_loop().create_task(self._kill(grace_s))
        # shield: a cancelled caller must not leave QEMU half-killed.
        await asyncio.shield(self._kill_task)

    async def _kill(self, grace_s: float) -> None:
        was_alive = self.is_alive()
        if self._state is VmState.RUNNING:
            self._state = VmState.STOPPING
        if was_alive and self._qmp is not None and grace_s > 0:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._qmp.execute("quit"), grace_s)
            await self._wait_for(grace_s)
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            if not self.is_alive():
                break
            self._signal(sig)
            await self._wait_for(wait_s)
        if self.is_alive():
            log.error("vm %s: pid %d survived SIGKILL", self.cfg.name, self._pid)
        if was_alive:
            self.exit_reason = "killed by hutch"
        await self._disconnect_qmp()
        self._close_fds()
        if not self.is_alive():
            self._close_console()
            for path in (self.cfg.qmp_socket, self.cfg.agent_socket, self.cfg.pidfile):
                _unlink(path)
            # After the exit was recorded: ``_on_exit`` read its OOM count first.
            await asyncio.to_thread(_release, self.cgroup, self.cfg)

    def _signal(self, sig: signal.Signals) -> None:
        if self._pidfd is None:
            return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, sig)

    async def _wait_for(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._exited.wait(), timeout_s)

    async def _disconnect_qmp(self) -> None:
        client, self._qmp = self._qmp, None
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.disconnect(), 1.0)

    def _close_fds(self) -> None:
        if self._pidfd is not None and self._exited.is_set():
            with contextlib.suppress(ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def _close_console(self) -> None:
        console, self._console = self._console, None
        if console is not None:
            console.close()

    def _on_exit(self) -> None:
        """pidfd readable: QEMU is gone. Reap our child and record why; the console is
        drained first, so whoever learns of the exit finds the guest's last output."""
        if self._exited.is_set():
            return
        if self._proc is not None:
            try:
                self.returncode = self._proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                return
            if self.returncode < 0:
                reason = f"signal {signal.Signals(-self.returncode).name}"
            else:
                reason = f"exit status {self.returncode}"
        else:
            reason = "exited (not our child: status unknown)"
        if self.exit_reason is None and self.cgroup is not None and self.cgroup.oom_kills():
            limit = self.cgroup.limits.memory_bytes >> 20
            reason = (
                f"{OUT_OF_MEMORY}: QEMU used all of its {limit} MiB of host memory (guest "
                f"RAM {self.cfg.memory_mib} MiB + overhead) and the kernel killed it"
            )
        if self.exit_reason is None:
            self.exit_reason = reason
        self._close_console()
        self._state = VmState.EXITED
        if self._pidfd is not None:
            with contextlib.suppress(ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(self._pidfd)
        self._exited.set()

    def __repr__(self) -> str:
        return f"<QemuVm {self.cfg.name} pid={self._pid} {self._state.value}>"


def _release(cgroup: SandboxCgroup | None, cfg: VmConfig) -> None:
    """Remove QEMU's cgroup and its record (QEMU must be gone). Never raises: a group
    that stays busy is logged and reclaimed by the next start."""
    if cgroup is None:
        return
    try:
        cgroup.remove()
    except VmError as exc:
        log.warning("vm %s: %s", cfg.name, exc)
        return
    _unlink(record_path(cfg.pidfile))
