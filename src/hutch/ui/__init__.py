"""The web console's static files (``static/``), shipped as package data and served by
the daemon at ``/ui`` (:mod:`hutch.api.routes.ui`). Nothing here runs on the host: the
console is a small hand-written ES-module app that talks to the same REST API and PTY
WebSocket as every other client, with the key the user signs in with.

``static/vendor/`` holds the npm packages the console uses (xterm.js and its fit addon),
copied from ``ui/node_modules`` by ``make ui-vendor`` after ``npm ci`` on the committed
``ui/package-lock.json``; ``static/vendor/manifest.json`` records each copied file's
package, version and sha256 (a unit test checks the copies against it and the lock).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CONTENT_TYPES", "STATIC_DIR", "static_files"]

STATIC_DIR = Path(__file__).resolve().parent / "static"

#: What the console ships, by suffix; a file with another suffix is not served.
CONTENT_TYPES: dict[str, str] = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".json": "application/json",
    ".txt": "text/plain; charset=utf-8",
}


def static_files(root: Path = STATIC_DIR) -> dict[str, Path]:
    """Every servable file under ``root``: its path relative to ``root`` (``/``-separated)
    -> its absolute path. Read once at app start, so a request can name only one of
    these (no path is ever joined from a URL)."""
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix in CONTENT_TYPES:
            found[path.relative_to(root).as_posix()] = path
    return found
