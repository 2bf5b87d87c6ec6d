"""The web console at ``/ui``: static files from :mod:`hutch.ui`, no key needed to fetch
them (they hold no data; every datum comes from ``/v1`` with the signed-in key).

Every answer carries a strict Content-Security-Policy: scripts only from this origin (no
inline script, no ``eval``), connections only to this origin (REST and the PTY
WebSocket), nothing framed, no third-party URL anywhere. ``style-src`` also allows
inline styles because xterm.js's DOM renderer writes its theme and cell-size rules into
``<style>`` elements it creates; a style cannot run code, and script stays 'self' only.

A request names a file from the index built at app start (:func:`hutch.ui.static_files`),
so no path from a URL is ever joined to a directory.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response

from hutch.errors import NotFound
from hutch.ui import CONTENT_TYPES, STATIC_DIR, static_files

__all__ = ["CSP", "SECURITY_HEADERS", "router"]

CSP = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data:",
        "font-src 'self'",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)

SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    # Revalidate every time: a daemon upgrade must not leave an old app in a browser.
    "Cache-Control": "no-cache",
}


def router(root: Path = STATIC_DIR) -> APIRouter:
    files = static_files(root)
    ui = APIRouter(include_in_schema=False)

    def serve(name: str) -> Response:
        path = files.get(name)
        if path is None:
            raise NotFound(f"no console file {name!r} (the console is at /ui/)")
        return Response(
            path.read_bytes(),
            media_type=CONTENT_TYPES[path.suffix],
            headers=SECURITY_HEADERS,
        )

    @ui.get("/ui")
    async def ui_root() -> Response:
        return RedirectResponse("/ui/", status_code=308, headers=SECURITY_HEADERS)

    @ui.get("/ui/")
    async def ui_index() -> Response:
        return serve("index.html")

    @ui.get("/ui/{name:path}")
    async def ui_file(name: str) -> Response:
        return serve(name)

    return ui
