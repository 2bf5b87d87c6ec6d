"""Fixtures shared by every tier.

Built guest images are shared by all tests (and with `make up`): they live in
``$HUTCH_TEST_IMAGES_DIR`` or ``./var/images``. A missing image is built (cached by content
hash), never skipped: `make test` builds them first so the time shows up there.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests import pgserver

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def pg_session() -> Iterator[None]:
    """The shared PostgreSQL server (``tests/pgserver.py``) is started by the first test
    that needs it and stopped, its directory removed, when the session ends."""
    yield
    pgserver.close_shared_server()


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
        if self.database_url is not None:
            return self.database_url
        if self.cluster.shared_db is not None:
            return self.cluster.shared_db
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


# The time each test module takes (setup, calls and teardown of its tests, module and
# session fixtures included where they run), summed by module and by tier at the end of
# the run: CI's whole run has a budget, and --durations names single phases only.
_module_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = report.nodeid.split("::", 1)[0]
    _module_seconds[module] = _module_seconds.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _module_seconds:
        return
    tiers: dict[str, float] = {}
    for module, seconds in _module_seconds.items():
        tier = "/".join(module.split("/")[:2])
        tiers[tier] = tiers.get(tier, 0.0) + seconds
    terminalreporter.section("time per tier and per module (tests/conftest.py)")
    for name, seconds in sorted(tiers.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f}s  {name}")
    slowest = sorted(_module_seconds.items(), key=lambda kv: -kv[1])[:40]
    for name, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f}s  {name}")
