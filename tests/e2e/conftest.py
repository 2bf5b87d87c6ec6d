"""End-to-end tier: the real ``hutch daemon`` as a subprocess, real QEMU guests, driven
through the CLI (subprocess) and the SDK.

- ``base_image`` (session): the built ``base`` image; built here if missing (fails loudly
  when it cannot be).
- ``Daemon``: one ``python -m hutch daemon`` on a free loopback port with its own state dir.
  ``start()``, ``stop()`` (SIGTERM), ``kill9()``; ``url``, ``api_key``, ``state_dir``,
  ``run_dir``, ``env`` (for CLI subprocesses), ``client()`` (SDK), ``cli(...)``.
  ``warm_restarts = True``: each start after the first takes an interpreter spawned
  ahead with hutch imported (``tests/e2e/warm_start.py``), for labs that restart often.
- ``daemon`` (session): a daemon shared by the tests that only need *a* daemon.
- ``make_daemon``: private daemons for tests that kill, restart or compare daemons.
- Every daemon is finalized by :func:`finalize_daemon`: all its sandboxes are deleted
  through the API, the daemon is stopped, and no QEMU process, socket or sandbox directory
  of its state may be left (leftovers are killed and removed first, then the test fails).
- When a test fails, the sandboxes, the daemon log tail and each sandbox's console tail of
  every daemon alive are attached to the report.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import httpx
import pytest

from hutch.config import load_settings
from hutch.images.build import ImageArtifacts, build_image, find_image
from hutch.models import SANDBOX_ID_RE
from hutch.sdk import Client
from tests import pgserver
from tests.leases import Lease, claim, own_tag_state_dir, release_tag
from tests.leases import free_port as free_port  # re-exported: e2e modules import it here

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
IMAGES_DIR = Path(os.environ.get("HUTCH_TEST_IMAGES_DIR") or REPO / "var" / "images").resolve()
# Seconds a daemon has to answer /healthz with "ok" after start (it serves while reconcile
# checks the VMs it finds, concurrently, up to ~5 s for one whose agent does not answer).
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Every test in this directory drives a real daemon that boots real guests.
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.vm)


def qemu_pids(*markers: str) -> dict[int, str]:
    """QEMU processes whose command line mentions any of ``markers``: pid -> cmdline."""
    found: dict[int, str] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "qemu-system" in cmdline and any(m in cmdline for m in markers):
            found[int(proc.name)] = cmdline
    return found


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def tail(path: Path, max_bytes: int = 4000) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode(errors="replace")
    except OSError as exc:
        return f"<{exc}>"


_POOLS: dict[Path, Lease] = {}


def daemon_net_pool(state_dir: Path) -> str:
    """A /24 of 10.200.0.0/13 for one test daemon's sandboxes: the first, from a place
    its state dir picks, that no other daemon holds, of this run or of another on this
    machine (`make test`'s other lane): two daemons on one pool would route each other's
    sandbox addresses. Claimed for this process's life (tests/leases.py); a daemon started
    again on the same state dir gets the same pool."""
    if state_dir not in _POOLS:
        digest = hashlib.sha256(str(state_dir).encode()).digest()
        start = (digest[0] % 8) * 256 + digest[1]
        blocks = ((start + k) % 2048 for k in range(2048))
        lease = claim("net-pool", (f"10.{200 + b // 256}.{b % 256}.0" for b in blocks))
        if lease is None:
            raise RuntimeError("every /24 of 10.200.0.0/13 is claimed by a test daemon")
        _POOLS[state_dir] = lease
    return f"{_POOLS[state_dir].name}/24"


class Daemon:
    """A real hutchd subprocess on its own state dir and loopback port."""

    def __init__(self, state_dir: Path, images_dir: Path = IMAGES_DIR) -> None:
        # Its tag (taps, nft table, cgroups) is no other live test daemon's on this host.
        self.state_dir = own_tag_state_dir(state_dir)
        self.images_dir = images_dir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._api_key: str | None = None
        self.starts = 0
        self.daemon_env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(SRC), str(REPO), os.environ.get("PYTHONPATH", "")) if p
            ),
            "HUTCH_STATE_DIR": str(self.state_dir),
            "HUTCH_LISTEN": f"127.0.0.1:{self.port}",
            "HUTCH_IMAGES_DIR": str(self.images_dir),
            # Its own sandbox addresses (daemons side by side must not share a pool), and
            # no DNS upstream beyond this machine unless a test points it at a fake one.
            "HUTCH_NET_POOL": daemon_net_pool(self.state_dir),
            "HUTCH_DNS_UPSTREAM": os.environ.get("HUTCH_TEST_DNS_UPSTREAM", "127.0.0.1:1"),
        }
        for leaked in ("HUTCH_URL", "HUTCH_API_KEY", "HUTCH_CONFIG", "HUTCH_DATABASE_URL"):
            self.daemon_env.pop(leaked, None)
        # HUTCH_TEST_DATABASE=postgres: its own database on the suite's server (the same
        # one again when a test restarts it on this state dir).
        database_url = pgserver.database_url_for(self.state_dir)
        if database_url is not None:
            self.daemon_env["HUTCH_DATABASE_URL"] = database_url
        self.settings = load_settings(self.daemon_env)
        #: Spawn the next start's interpreter ahead (see tests/e2e/warm_start.py).
        self.warm_restarts = False
        self._warm: subprocess.Popen[bytes] | None = None

    # -- where things are ---------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def run_dir(self) -> Path:
        return self.settings.run_dir

    @property
    def sandboxes_dir(self) -> Path:
        return self.settings.sandboxes_dir

    @property
    def log_path(self) -> Path:
        return self.state_dir / "logs" / "hutchd.log"

    @property
    def stderr_path(self) -> Path:
        return self.state_dir / "logs" / f"stderr.{self.starts}.log"

    @property
    def api_key(self) -> str:
        if self._api_key is None:
            self._api_key = (self.state_dir / "api-key").read_text().strip()
        return self._api_key

    @property
    def env(self) -> dict[str, str]:
        """Environment for a CLI subprocess talking to this daemon."""
        return {**self.daemon_env, "HUTCH_URL": self.url, "HUTCH_API_KEY": self.api_key}

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- lifecycle ----------------------------------------------------------------------

    def start(self, *, reconciled: bool = True) -> None:
        """Start (or restart, on the same state dir and port) and wait for /healthz: until
        it says "ok" (every sandbox found on the host checked), or with
        ``reconciled=False`` until it answers at all (it may still say "reconciling")."""
        assert not self.running, "daemon already running"
        self.starts += 1
        self.stderr_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = self._launch()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"hutchd exited with {self.proc.returncode} while starting:\n"
                    + tail(self.stderr_path)
                )
            try:
                answer = httpx.get(f"{self.url}/healthz", timeout=1)
                if answer.status_code == 200 and (
                    not reconciled or answer.json().get("status") == "ok"
                ):
                    if self.warm_restarts and self._warm is None:
                        self._warm = self._spawn(["-m", "tests.e2e.warm_start"], self.starts + 1)
                        assert self._warm.stdin is not None
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill9()
        raise RuntimeError(
            f"hutchd did not answer /healthz within {START_TIMEOUT_S} s:\n" + tail(self.stderr_path)
        )

    def _spawn(self, args: list[str], start: int) -> subprocess.Popen[bytes]:
        """A Python process for start number ``start`` (its output in that start's
        stderr log); ``-m tests.e2e.warm_start`` waits on stdin for its environment."""
        warm = args[-1] == "tests.e2e.warm_start"
        with (self.state_dir / "logs" / f"stderr.{start}.log").open("wb") as err:
            return subprocess.Popen(
                [sys.executable, *args],
                env=self.daemon_env,
                cwd=self.state_dir.parent,
                stdin=subprocess.PIPE if warm else subprocess.DEVNULL,
                stdout=err,
                stderr=err,
            )

    def _launch(self) -> subprocess.Popen[bytes]:
        """This start's daemon: the warm interpreter if one waits, told the environment
        as it is now, else a cold ``python -m hutch daemon``."""
        warm, self._warm = self._warm, None
        if warm is None or warm.poll() is not None:
            return self._spawn(["-m", "hutch", "daemon"], self.starts)
        assert warm.stdin is not None
        warm.stdin.write(json.dumps(dict(self.daemon_env)).encode() + b"\n")
        warm.stdin.close()
        return warm

    def discard_warm(self) -> None:
        """End the interpreter waiting for a next start, if any (EOF: it exits)."""
        warm, self._warm = self._warm, None
        if warm is not None and warm.stdin is not None:
            warm.stdin.close()
            try:
                warm.wait(10)
            except subprocess.TimeoutExpired:
                warm.kill()
                warm.wait()

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL after STOP_TIMEOUT_S). Sandboxes keep running."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"hutchd ignored SIGTERM for {STOP_TIMEOUT_S} s") from None
        self.proc = None

    def wait_exit(self, timeout_s: float) -> int | None:
        """Wait for the daemon to exit on its own (e.g. at a crash point); its return code
        (-9 for SIGKILL), or None if it is still running after ``timeout_s``."""
        if self.proc is None:
            return None
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None
        self.proc = None
        return code

    def kill9(self) -> None:
        """SIGKILL the daemon process only (its QEMU children are detached and live on)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()
        self.proc = None

    # -- talking to it -------------------------------------------------------------------

    def client(self, **kw: object) -> Client:
        return Client(base_url=self.url, api_key=self.api_key, **kw)  # type: ignore[arg-type]

    def cli(
        self, *args: str, timeout: float = 300.0, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``hutch ARGS`` against this daemon; never raises on a nonzero exit."""
        return subprocess.run(
            [sys.executable, "-m", "hutch", *args],
            env=self.env,
            capture_output=True,
            text=True,
            input=input,
            timeout=timeout,
            check=False,
        )

    def cli_bytes(
        self, *args: str, timeout: float = 300.0, input: bytes = b""
    ) -> subprocess.CompletedProcess[bytes]:
        """Like :meth:`cli` with binary stdin/stdout."""
        return subprocess.run(
            [sys.executable, "-m", "hutch", *args],
            env=self.env,
            capture_output=True,
            input=input,
            timeout=timeout,
            check=False,
        )

    def cli_popen(self, *args: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "hutch", *args],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )

    # -- what is on the host ---------------------------------------------------------------

    def qemu_pids(self) -> dict[int, str]:
        return qemu_pids(str(self.state_dir), str(self.run_dir))

    def sandbox_qemus(self) -> dict[str, int]:
        """Sandbox id -> QEMU pid, for this daemon's sandbox VMs (template builds, which
        the daemon runs in the background, are not sandboxes)."""
        found: dict[str, int] = {}
        for pid, cmdline in self.qemu_pids().items():
            match = _QEMU_NAME.search(cmdline)
            if match:
                found[match.group(1)] = pid
        return found

    def sandbox_dirs(self) -> set[str]:
        """Sandbox ids that have a directory in the state or run dir."""
        found: set[str] = set()
        for root in (self.sandboxes_dir, self.run_dir):
            if root.is_dir():
                found |= {d.name for d in root.iterdir() if SANDBOX_ID_RE.match(d.name)}
        return found

    def qemu_pid_of(self, sandbox_id: str) -> int:
        return int((self.sandboxes_dir / sandbox_id / "qemu.pid").read_text().strip())

    def diagnostics(self) -> str:
        lines = [f"daemon {self.url} state={self.state_dir} run={self.run_dir}"]
        if self.running:
            try:
                with self.client(timeout=5.0) as c:
                    for sb in c.list_sandboxes():
                        lines.append(f"  {sb.id} {sb.state} name={sb.name} error={sb.error}")
            except Exception as exc:  # diagnostics must never hide the real failure
                lines.append(f"  (could not list sandboxes: {exc})")
        lines.append(f"  qemu processes: {sorted(self.qemu_pids())}")
        lines.append(f"--- hutchd.log tail ({self.log_path})")
        lines.append(tail(self.log_path, 6000))
        if self.sandboxes_dir.is_dir():
            for d in sorted(self.sandboxes_dir.iterdir()):
                lines.append(f"--- {d.name} console.log tail")
                lines.append(tail(d / "console.log", 3000))
                qemu_log = tail(d / "qemu.log", 1000)
                if qemu_log.strip():
                    lines.append(f"--- {d.name} qemu.log tail")
                    lines.append(qemu_log)
        return "\n".join(lines)


_ENDED = ("destroyed", "failed")
_QEMU_NAME = re.compile(r"-name (sb-[0-9a-f]{12})\b")
# Daemons alive right now, for failure reports.
_LIVE: list[Daemon] = []


def reclaim_host_network(tag: str) -> list[str]:
    """After a daemon stopped with every sandbox deleted, nothing of its network may be
    left on the host: report (and remove) its taps and its nft table."""
    problems = []
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    for line in links.splitlines():
        name = line.split()[0].split("@")[0] if line.split() else ""
        if name.startswith(f"h{tag}"):
            problems.append(f"tap {name} left after every sandbox was deleted")
            subprocess.run(["ip", "link", "del", name], capture_output=True)
    tunnel = f"hx{tag}"  # the overlay between hosts (hutch.net.tunnel), workers only
    if subprocess.run(["ip", "link", "show", "dev", tunnel], capture_output=True).returncode == 0:
        problems.append(f"tunnel device {tunnel} left by a daemon that stopped")
        subprocess.run(["ip", "link", "del", "dev", tunnel], capture_output=True)
    mark = f"{0x68780000 | int(tag, 16):#x}"
    rules = subprocess.run(["ip", "rule", "show"], capture_output=True, text=True).stdout
    if f"fwmark {mark} " in rules:
        problems.append(f"ip rule for fwmark {mark} (the tunnel's) left by a daemon that stopped")
        subprocess.run(["ip", "rule", "del", "fwmark", mark], capture_output=True)
    table = f"hutch_{tag}"
    listed = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    if f"table inet {table}\n" in listed + "\n":
        problems.append(f"nft table inet {table} left by a daemon that stopped with no sandboxes")
        subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True)
    return problems


def finalize_daemon(d: Daemon) -> list[str]:
    """Delete every sandbox through the API, stop the daemon, then reclaim and report
    anything left on the host. Returns the problems found (empty: clean)."""
    problems: list[str] = []
    try:
        if not d.running and d.starts:
            # Killed by the test: bring it back so the API can delete what it owns.
            d.start()
        if d.running:
            with d.client(timeout=120.0) as admin:
                projects = [p.name for p in admin.projects.list()]
            for project in projects:  # every project's sandboxes, not only default's
                with d.client(timeout=120.0, project=project) as c:
                    for sb in c.list_sandboxes():
                        if sb.state not in _ENDED:
                            c.delete_sandbox(sb.id)
                    left = [sb for sb in c.list_sandboxes() if sb.state not in _ENDED]
                    if left:
                        problems.append(f"sandboxes still live after delete: {left}")
    except Exception as exc:
        problems.append(f"could not delete sandboxes through the API: {exc!r}")
    finally:
        try:
            d.stop()
        except RuntimeError as exc:
            problems.append(str(exc))
        d.discard_warm()
    pids = d.qemu_pids()
    for pid, cmdline in pids.items():
        problems.append(f"QEMU process left running: {pid} {cmdline[:200]}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    dirs = d.sandbox_dirs()
    if dirs:
        problems.append(f"sandbox directories left in {d.sandboxes_dir} / {d.run_dir}: {dirs}")
    if d.run_dir.is_dir():
        sockets = [p for p in d.run_dir.rglob("*") if p.is_socket()]
        if sockets:
            problems.append(f"sockets left: {sockets}")
    if d.starts:
        problems += reclaim_host_network(d.settings.daemon_tag)
    # /run is outside the test's tmp dir; never litter it, even when clean.
    shutil.rmtree(d.run_dir, ignore_errors=True)
    shutil.rmtree(d.sandboxes_dir, ignore_errors=True)
    if d in _LIVE:
        _LIVE.remove(d)
    release_tag(d.state_dir)
    return problems


@pytest.fixture(scope="session")
def base_image() -> ImageArtifacts:
    art = find_image("base", IMAGES_DIR)
    if art is not None:
        return art
    try:
        return build_image("base", IMAGES_DIR)
    except Exception as exc:
        pytest.fail(
            f"the e2e tests need the 'base' image in {IMAGES_DIR}; building it failed: {exc}"
        )


@pytest.fixture(scope="session")
def daemon(
    base_image: ImageArtifacts, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    """One daemon shared by tests that need nothing special of it. Tests on it must
    filter by their own metadata or ids, never assume they are alone."""
    d = Daemon(tmp_path_factory.mktemp("hutchd-shared") / "state")
    _LIVE.append(d)
    d.start()
    yield d
    problems = finalize_daemon(d)
    assert not problems, "\n".join(problems)


@pytest.fixture
def make_daemon(base_image: ImageArtifacts, tmp_path: Path) -> Iterator[Callable[[], Daemon]]:
    """``make_daemon()`` -> a started private daemon, finalized after the test."""
    made: list[Daemon] = []

    def make() -> Daemon:
        d = Daemon(tmp_path / f"state{len(made)}")
        made.append(d)
        _LIVE.append(d)
        d.start()
        return d

    yield make
    problems: list[str] = []
    for d in made:
        problems += finalize_daemon(d)
    assert not problems, "\n".join(problems)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        for d in _LIVE:
            report.sections.append((f"hutchd {d.url}", d.diagnostics()))
    return report
