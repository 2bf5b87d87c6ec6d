"""The web console's static files and the route that serves them: a strict CSP on every
answer, no inline script, no third-party URL, nothing outside the shipped files, and the
vendored npm files exactly what the lock and the manifest say."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from hutch.api import errors
from hutch.api.routes import ui as ui_routes
from hutch.errors import HutchError
from hutch.ui import STATIC_DIR, static_files

REPO = Path(__file__).resolve().parents[2]
VENDOR = STATIC_DIR / "vendor"
OWN = [p for p in static_files().values() if VENDOR not in p.parents]


@pytest.fixture
def client() -> TestClient:
    app = FastAPI()
    app.include_router(ui_routes.router())
    app.add_exception_handler(HutchError, errors.handle_hutch_error)
    return TestClient(app)


def test_index_is_served_with_a_strict_csp(client: TestClient) -> None:
    answer = client.get("/ui/")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/html")
    csp = answer.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    assert "unsafe-eval" not in csp and "script-src 'self' 'unsafe-inline'" not in csp
    assert "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert answer.headers["x-content-type-options"] == "nosniff"
    assert answer.headers["referrer-policy"] == "no-referrer"


def test_ui_redirects_to_the_index(client: TestClient) -> None:
    answer = client.get("/ui", follow_redirects=False)
    assert answer.status_code == 308 and answer.headers["location"] == "/ui/"


@pytest.mark.parametrize(
    "name", ["js/app.js", "style.css", "vendor/xterm/xterm.mjs", "vendor/xterm/xterm.css"]
)
def test_each_file_has_its_type_and_the_csp(client: TestClient, name: str) -> None:
    answer = client.get(f"/ui/{name}")
    assert answer.status_code == 200
    assert answer.headers["content-security-policy"] == ui_routes.CSP
    kind = "text/css" if name.endswith(".css") else "text/javascript"
    assert answer.headers["content-type"].startswith(kind)


@pytest.mark.parametrize(
    "name",
    ["../__init__.py", "..%2F__init__.py", "%2e%2e/%2e%2e/api/app.py", "nope.js", "/etc/passwd"],
)
def test_only_shipped_files_are_served(client: TestClient, name: str) -> None:
    answer = client.get(f"/ui/{name}")
    assert answer.status_code == 404, answer.text
    assert "import" not in answer.text


def test_no_inline_script_and_no_third_party_url() -> None:
    index = (STATIC_DIR / "index.html").read_text()
    for tag in re.findall(r"<script\b[^>]*>(.*?)</script>", index, re.S):
        assert tag.strip() == "", "inline script in index.html"
    assert re.findall(r"<script\b[^>]*>", index) == ['<script type="module" src="js/app.js">']
    assert " on" not in re.sub(r"\s+", " ", index).replace(" one", ""), "inline handler"
    svg_ns = "http://www.w3.org/2000/svg"
    for path in OWN:
        text = path.read_text().replace(svg_ns, "")
        assert not re.search(r"\b(?:https?|wss?):/", text), f"{path.name} names a URL"
        assert "innerHTML" not in text, f"{path.name}: data goes in as text, never as HTML"
        assert "eval(" not in text and "new Function" not in text


def test_every_module_import_resolves_to_a_shipped_file() -> None:
    files = static_files()
    for path in OWN:
        if path.suffix != ".js":
            continue
        for spec in re.findall(r'^import .* from "([^"]+)";$', path.read_text(), re.M):
            target = (path.parent / spec).resolve().relative_to(STATIC_DIR).as_posix()
            assert target in files, f"{path.name} imports {spec}, which is not shipped"


def test_vendored_files_match_the_manifest_and_the_lock() -> None:
    manifest = json.loads((VENDOR / "manifest.json").read_text())
    lock = json.loads((REPO / "ui" / "package-lock.json").read_text())
    wanted = json.loads((REPO / "ui" / "package.json").read_text())["dependencies"]
    assert manifest["files"], "nothing vendored"
    for name, entry in manifest["files"].items():
        data = (VENDOR / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], f"{name} was edited"
        locked = lock["packages"][f"node_modules/{entry['package']}"]["version"]
        assert entry["version"] == locked == wanted[entry["package"]], name
    shipped = {p.relative_to(VENDOR).as_posix() for p in VENDOR.rglob("*") if p.is_file()}
    assert shipped == set(manifest["files"]) | {"manifest.json"}
