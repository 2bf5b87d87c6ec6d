"""A private hutchd for one benchmark run: own state directory, own port, shared images.

``PrivateDaemon`` starts ``python -m hutch daemon`` as a subprocess, waits for
``/healthz``, and on ``stop()`` deletes every sandbox it still has, stops the daemon and
verifies that no QEMU process of its state directory survived (killing and reporting any
that did). ``stop()`` is safe to call twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

import httpx

from hutch.config import Settings
from hutch.sdk import Client

__all__ = ["DaemonFailed", "PrivateDaemon", "free_port", "qemu_pids_of"]


class DaemonFailed(RuntimeError):
    """The private daemon would not start or answer."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run_dir_of(state_dir: Path) -> Path:
    """Where the daemon puts its sockets (the daemon's own rule, not a copy of it)."""
    return Settings(state_dir=state_dir.resolve()).run_dir


def qemu_pids_of(markers: list[str]) -> list[int]:
    """PIDs of QEMU processes whose command line names any of ``markers`` (paths that
    only this daemon's sandboxes use)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmdline.startswith("qemu-system") and any(m in cmdline for m in markers):
            pids.append(int(proc.name))
    return pids


class PrivateDaemon:
    """One hutchd subprocess with its state in ``work_dir/state``.

    ``images_dir`` is shared (built images are read-only); ``accel`` None inherits
    ``HUTCH_ACCEL`` from the environment (the daemon's default is ``auto``); ``env``
    adds ``HUTCH_*`` settings of this daemon only (e.g. ``{"HUTCH_TEMPLATES": "0"}``).
    """

    def __init__(
        self,
        repo: Path,
        work_dir: Path,
        images_dir: Path,
        accel: str | None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.repo = repo
        self.env = dict(env or {})
        self.state_dir = (work_dir / "state").resolve()
        self.images_dir = images_dir.resolve()
        self.accel = accel
        self.port = 0
        self.api_key = ""
        self.accel_in_use: str | None = None
        self.leaked_qemu: list[int] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = self.state_dir.parent / "hutchd.out"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The daemon process (None when it is not running)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def markers(self) -> list[str]:
        return [str(self.state_dir), str(run_dir_of(self.state_dir))]

    def client(self, timeout: float | None = None) -> Client:
        return Client(base_url=self.base_url, api_key=self.api_key, timeout=timeout)

    def start(self, ready_timeout_s: float = 60.0) -> None:
        """Start the daemon and wait until ``/healthz`` answers. Raises ``DaemonFailed``
        with the tail of its output when it exits or stays silent (and stops it)."""
        try:
            self._start(ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, ready_timeout_s: float) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        env = dict(os.environ)
        for name in ("HUTCH_CONFIG", "HUTCH_URL", "HUTCH_API_KEY"):
            env.pop(name, None)  # a user's setup must not leak into the measured daemon
        env["HUTCH_STATE_DIR"] = str(self.state_dir)
        env["HUTCH_LISTEN"] = f"127.0.0.1:{self.port}"
        env["HUTCH_IMAGES_DIR"] = str(self.images_dir)
        # Side-by-side daemons need their own sandbox address pools, and no benchmark
        # sends DNS beyond this machine (the net case points its daemon at a fake one).
        digest = hashlib.sha256(str(self.state_dir.resolve()).encode()).digest()
        # A /22: 255 sandboxes of one /30 each (the density case runs 100 at once).
        env["HUTCH_NET_POOL"] = f"10.{208 + digest[0] % 8}.{digest[1] & 0xFC}.0/22"
        env["HUTCH_DNS_UPSTREAM"] = "127.0.0.1:1"
        if self.accel:
            env["HUTCH_ACCEL"] = self.accel
        env.update(self.env)
        src = str(self.repo / "src")
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "hutch", "daemon"],
                cwd=self.repo,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C of the harness reaches us, not it
            )
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise DaemonFailed(
                    f"hutchd exited with status {self._proc.returncode} before answering; "
                    f"its output:\n{self.log_tail()}"
                )
            try:
                answer = httpx.get(f"{self.base_url}/healthz", timeout=2.0, trust_env=False)
                # "reconciling" until the VMs a restart found are checked.
                if answer.status_code == 200 and answer.json().get("status") == "ok":
                    self.accel_in_use = answer.json().get("accel")
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise DaemonFailed(
                f"hutchd did not answer on {self.base_url}/healthz within "
                f"{ready_timeout_s:.0f} s; its output:\n{self.log_tail()}"
            )
        self.api_key = (self.state_dir / "api-key").read_text().strip()

    @property
    def log_path(self) -> Path:
        """The daemon's own log file (what it logs at INFO and above)."""
        return Settings(state_dir=self.state_dir).logs_dir / "hutchd.log"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no output)"

    def delete_all_sandboxes(self) -> list[str]:
        """Delete every sandbox the daemon still lists; returns their ids."""
        if not self.api_key or self._proc is None or self._proc.poll() is not None:
            return []
        deleted = []
        with self.client(timeout=120.0) as client:
            for info in client.list_sandboxes():
                with contextlib.suppress(Exception):
                    client.delete_sandbox(info.id)
                    deleted.append(info.id)
        return deleted

    def stop(self) -> None:
        """Delete leftovers, stop the daemon, kill and record any QEMU it left behind,
        then remove the state directory. Idempotent."""
        try:
            with contextlib.suppress(Exception):
                self.delete_all_sandboxes()
        finally:
            self._stop_process()
            self._reap_qemu()
            with contextlib.suppress(OSError):
                shutil.rmtree(run_dir_of(self.state_dir), ignore_errors=True)

    def _stop_process(self) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def _reap_qemu(self) -> None:
        # Sandboxes outlive hutchd by design, so a sandbox that failed to delete would
        # keep burning a core; kill it (our own, named by our state dir) and say so.
        for pid in qemu_pids_of(self.markers):
            self.leaked_qemu.append(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while qemu_pids_of(self.markers) and time.monotonic() < deadline:
            time.sleep(0.1)

    def remaining_qemu(self) -> list[int]:
        return qemu_pids_of(self.markers)

    def __enter__(self) -> PrivateDaemon:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
