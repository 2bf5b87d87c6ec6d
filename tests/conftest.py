"""Fixtures shared by every tier.

Built guest images are shared by all tests (and with `make up`): they live in
``$HUTCH_TEST_IMAGES_DIR`` or ``./var/images``. A missing image is built (cached by content
hash), never skipped: `make test` builds them first so the time shows up there.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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
