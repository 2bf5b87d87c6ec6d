"""Fixtures shared by every tier.

Built guest images are shared by all tests (and with `make up`): they live in
``$HUTCH_TEST_IMAGES_DIR`` or ``./var/images``. A missing image is built (cached by content
hash), never skipped: `make test` builds them first so the time shows up there.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import shutil
import signal
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import uvloop

from tests import pgserver

if TYPE_CHECKING:
    from hutch.config import Settings
    from hutch.services.composed import Services

REPO = Path(__file__).resolve().parents[1]
# Marks every process this run starts (inherited by each hutchd, QEMU and server): the
# QEMU census (tests/vm/qemu_census.py) counts only this run's, not those of a run beside
# it (`make test` runs two lanes side by side, see the Makefile).
os.environ["HUTCH_TEST_RUN"] = f"{os.getpid()}-{secrets.token_hex(4)}"
# `make test`'s lane this process is (scripts/lanes.sh), "" outside one.
LANE = os.environ.get("HUTCH_TEST_LANE", "")


@pytest.fixture(scope="session", autouse=True)
def _sweep_run_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """When the session ends (after every other session fixture: this one is set up
    first), remove the run dirs under /run/hutch of this session's state dirs that are
    still there (the e2e tier's finalizer removes each daemon's; the VM tier's
    in-process services and SIGKILLed daemons leave theirs), and only those: another
    run's may be in use. A QEMU still using one is a leak: killed and named."""
    basetemp = tmp_path_factory.getbasetemp()
    yield
    for d in own_run_dirs(basetemp):
        for pid in qemu_pids_mentioning(str(d)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _leaked.append(f"QEMU {pid} was left running on {d}: killed")
        shutil.rmtree(d, ignore_errors=True)
        _swept.append(d)


@pytest.fixture(scope="session", autouse=True)
def pg_session() -> Iterator[None]:
    """The shared PostgreSQL server (``tests/pgserver.py``) is started by the first test
    that needs it and stopped, its directory removed, when the session ends."""
    yield
    pgserver.close_shared_server()


def named_database(settings: Settings) -> Path | str | None:
    """The database ``settings`` names itself (a ``database_url``, or a cluster's shared
    SQLite file); None when it would open Settings' own default."""
    if settings.database_url is not None:
        return settings.database_url
    return settings.cluster.shared_db


async def delete_live_sandboxes(svc: Services) -> None:
    """Delete every sandbox of ``svc`` that is still live (a service fixture's teardown,
    before it closes the service and checks nothing was left behind)."""
    for rec in svc.sandboxes.list_sandboxes():
        if rec.state.is_live:
            await svc.sandboxes.delete(rec.id)


@pytest.fixture(autouse=True)
def _test_database(monkeypatch: pytest.MonkeyPatch) -> None:
    """``HUTCH_TEST_DATABASE=postgres``: every Settings without a database of its own
    choosing (a ``database_url``, or a cluster's shared SQLite file, which a test names
    on purpose) keeps its state in a database of the shared server, one per state
    directory (opened again by a restart in the same directory, fresh for each test's
    tmp_path), so the component tier's daemons and stores run on PostgreSQL unchanged."""
    if pgserver.test_database() != "postgres":
        return
    from hutch.config import Settings

    def database(self: Settings) -> Path | str:
        named = named_database(self)
        if named is not None:
            return named
        url = pgserver.database_url_for(self.state_dir)
        assert url is not None
        return url

    monkeypatch.setattr(Settings, "database", property(database))


@pytest.fixture(params=["sqlite", "postgres"])
def db_target(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    """What a store test opens, once per backend: an SQLite file, or a fresh database on
    the shared PostgreSQL server. Opening it again reopens the same database."""
    if request.param == "sqlite":
        return tmp_path / "hutch.db"
    return pgserver.shared_server().fresh_database()


def test_images_dir() -> Path:
    return Path(os.environ.get("HUTCH_TEST_IMAGES_DIR", REPO / "var" / "images")).resolve()


test_images_dir.__test__ = False  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def images_dir() -> Path:
    return test_images_dir()


_built: dict[str, object] = {}


def ensure_image(name: str) -> object:
    """The current build of image ``name`` (built or refreshed if its inputs changed)."""
    from hutch.images.build import build_image

    if name not in _built:
        _built[name] = build_image(name, test_images_dir())
    return _built[name]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep each phase's report on the item (``item.rep_setup``, ``rep_call``), so a
    fixture's teardown can tell whether its test failed (the console tests save a
    screenshot then)."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Tests marked ``datapath_loop`` run on the loop the daemon's data path runs
    (uvloop, ``hutch.net.datapath``): the proxy, resolver and relay code they drive
    meets the same transports there as in hutchd. Every other test: the standard loop."""
    if item.get_closest_marker("datapath_loop") is not None:
        return {"uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


# The time each test module takes (setup, calls and teardown of its tests, module and
# session fixtures included where they run), summed by module and by tier at the end of
# the run: CI's whole run has a budget, and --durations names single phases only.
_module_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = report.nodeid.split("::", 1)[0]
    _module_seconds[module] = _module_seconds.get(module, 0.0) + report.duration


# Where a daemon keeps its sockets: /run/hutch/<10 hex of its state dir>
# (Settings.run_dir). A test that SIGKILLs a daemon or a QEMU can leave one behind.
RUN_ROOT = Path("/run/hutch")
_swept: list[Path] = []
_leaked: list[str] = []


def qemu_pids_mentioning(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "qemu-system" in cmdline and marker in cmdline:
            pids.append(int(entry.name))
    return pids


def own_run_dirs(basetemp: Path, depth: int = 4) -> list[Path]:
    """The run dirs on this host of the state dirs under ``basetemp`` (this session's
    tmp_path root), down to ``depth`` levels: only those, never another run's."""
    if not RUN_ROOT.is_dir():
        return []
    existing = {d.name for d in RUN_ROOT.iterdir()}
    found: list[Path] = []
    level = [basetemp.resolve()]
    for _ in range(depth):
        below: list[Path] = []
        for d in level:
            try:
                below += [c for c in d.iterdir() if c.is_dir() and not c.is_symlink()]
            except OSError:
                continue
        for d in below:
            digest = hashlib.sha256(str(d).encode()).hexdigest()[:10]
            if digest in existing:
                found.append(RUN_ROOT / digest)
        level = below
    return found


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _swept:
        terminalreporter.section("run dirs of this run, swept (tests/conftest.py)")
        terminalreporter.write_line(f"{len(_swept)} left under {RUN_ROOT}, removed")
        for line in _leaked:
            terminalreporter.write_line(line, red=True)
    if not _module_seconds:
        return
    tiers: dict[str, float] = {}
    for module, seconds in _module_seconds.items():
        tier = "/".join(module.split("/")[:2])
        tiers[tier] = tiers.get(tier, 0.0) + seconds
    lane = f", lane {LANE}" if LANE else ""
    terminalreporter.section(f"time per tier and per module (tests/conftest.py{lane})")
    for name, seconds in sorted(tiers.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f}s  {name}")
    slowest = sorted(_module_seconds.items(), key=lambda kv: -kv[1])[:40]
    for name, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f}s  {name}")
