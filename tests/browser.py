"""A real headless Chromium for the console tests: Debian's ``chromium`` (installed with
apt when missing, like the other test-only services), driven by Playwright's Python
package through ``executable_path``; Playwright's own browser download is never used.

Each browser gets a fresh ``--user-data-dir`` (``launch_persistent_context`` on a new
directory) and the flags that keep it quiet and offline: no GPU, no QUIC, no first-run,
no background networking, no component updates, no sync.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from playwright.async_api import BrowserContext as AsyncBrowserContext
from playwright.async_api import async_playwright
from playwright.sync_api import BrowserContext, ViewportSize, sync_playwright

CHROMIUM = "/usr/bin/chromium"
PACKAGE = "chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

VIEWPORT: ViewportSize = {"width": 1280, "height": 900}


def ensure_chromium() -> str:
    """The Chromium binary, installed with apt first if it is not there."""
    if os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    apt = ["apt-get", "install", "-y", "-q", "--no-install-recommends", PACKAGE]
    if subprocess.run(apt, env=env, stdout=subprocess.DEVNULL, check=False).returncode != 0:
        # The package lists may be missing or stale on a fresh machine.
        subprocess.run(["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL, check=True)
        subprocess.run(apt, env=env, stdout=subprocess.DEVNULL, check=True)
    assert os.access(CHROMIUM, os.X_OK), f"apt-get installed {PACKAGE} but {CHROMIUM} is missing"
    return CHROMIUM


@contextmanager
def chromium(user_data_dir: Path) -> Iterator[BrowserContext]:
    """A headless Chromium on a fresh profile in ``user_data_dir`` (must not exist yet,
    or be empty), closed and its profile removed after."""
    binary = ensure_chromium()
    user_data_dir.mkdir(parents=True, exist_ok=False)
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(user_data_dir),
            executable_path=binary,
            headless=True,
            args=FLAGS,
            viewport=VIEWPORT,
            chromium_sandbox=False,  # our flags are the whole list (above)
        )
        try:
            yield context
        finally:
            context.close()
            shutil.rmtree(user_data_dir, ignore_errors=True)


@asynccontextmanager
async def async_chromium(user_data_dir: Path) -> AsyncIterator[AsyncBrowserContext]:
    """:func:`chromium` for asyncio tests (the component tier serves the app in-loop)."""
    binary = ensure_chromium()
    os.makedirs(user_data_dir)  # fresh: fails if it exists
    async with async_playwright() as pw:
        context = await pw.chromium.launch_persistent_context(
            str(user_data_dir),
            executable_path=binary,
            headless=True,
            args=FLAGS,
            viewport=VIEWPORT,
            chromium_sandbox=False,
        )
        try:
            yield context
        finally:
            await context.close()
            shutil.rmtree(user_data_dir, ignore_errors=True)
