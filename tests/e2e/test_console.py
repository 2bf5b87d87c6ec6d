"""The web console (/ui) in a real headless Chromium (Debian's, driven by Playwright)
against the real daemon and a real QEMU guest: sign in with the key, create a sandbox
from the page and see it appear, run a command in its terminal and see the output in
xterm.js, see its events and the usage chart; a viewer sees no create or delete button
and the API refuses them anyway; the key never appears in the page, its URL or any URL
it asked for. One sandbox, shared by the module's tests. A failing test saves a
screenshot under test-artifacts/console/ (the path is printed).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import BrowserContext, ConsoleMessage, Page, expect

from tests.browser import chromium
from tests.e2e.conftest import Daemon

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "console"
NAME = "console-e2e"
BOOT_TIMEOUT_MS = 180_000


class Watched:
    """A page with every URL it asked for and every console error it logged."""

    def __init__(self, page: Page, origin: str) -> None:
        self.page = page
        self.origin = origin
        self.urls: list[str] = []
        self.errors: list[str] = []
        page.on("request", lambda r: self.urls.append(r.url))
        page.on("websocket", lambda ws: self.urls.append(ws.url))
        page.on("console", self._console)
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))

    def _console(self, msg: ConsoleMessage) -> None:
        if msg.type == "error":
            self.errors.append(msg.text)

    def foreign(self) -> list[str]:
        mine = (self.origin + "/", self.origin.replace("http://", "ws://") + "/")
        return [u for u in self.urls if not u.startswith(mine) and not u.startswith("data:")]

    def sign_in(self, key: str) -> None:
        self.page.goto(self.origin + "/ui")
        self.page.fill("#api-key", key)
        self.page.click("#sign-in-button")
        expect(self.page.locator("#nav")).to_be_visible()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrowserContext]:
    with chromium(tmp_path_factory.mktemp("console") / "chromium-profile") as context:
        yield context


@pytest.fixture
def console(
    browser: BrowserContext, daemon: Daemon, request: pytest.FixtureRequest
) -> Iterator[Watched]:
    page = browser.new_page()
    watched = Watched(page, daemon.url)
    yield watched
    report = getattr(request.node, "rep_call", None)
    if report is None or report.failed:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{request.node.name}.png"
        page.screenshot(path=str(path), full_page=True)
        print(f"console screenshot: {path}")
    page.close()


@pytest.fixture(scope="module")
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=daemon.url, headers={"Authorization": f"Bearer {daemon.api_key}"}, timeout=120
    ) as client:
        yield client


@pytest.fixture(scope="module")
def sandbox_id(daemon: Daemon, http: httpx.Client) -> Iterator[dict[str, str]]:
    """Filled by the first test (which creates the sandbox from the page); deleted after."""
    made: dict[str, str] = {}
    yield made
    if "id" in made:
        http.delete(f"/v1/sandboxes/{made['id']}")


def test_sign_in_create_and_run_a_command_in_the_terminal(
    console: Watched, daemon: Daemon, http: httpx.Client, sandbox_id: dict[str, str]
) -> None:
    page = console.page
    console.sign_in(daemon.api_key)
    expect(page.locator("#who")).to_contain_text("admin")
    # Create from the page; the sandbox appears in the list, running, with its shape.
    page.fill("#create-name", NAME)
    page.click("#create-submit")
    row = page.locator("tr.sandbox-row", has_text=NAME)
    expect(row).to_have_attribute("data-state", "running", timeout=BOOT_TIMEOUT_MS)
    sandbox_id["id"] = sid = row.get_attribute("data-id") or ""
    assert re.fullmatch(r"sb-[0-9a-f]{12}", sid), sid
    assert http.get(f"/v1/sandboxes/{sid}").json()["name"] == NAME
    expect(row).to_contain_text("1 vCPU")
    expect(row.locator("td.uptime")).not_to_have_text("—")

    row.locator("a.sandbox-link").click()
    expect(page.locator("#sandbox-state")).to_contain_text("running")
    page.click("#open-terminal")
    expect(page.locator("#terminal-status")).to_contain_text("connected", timeout=60_000)
    page.locator("#terminal .xterm").click()
    page.keyboard.type("echo console-$((6*7)) && uname -s\n")
    rows = page.locator("#terminal .xterm-rows")
    expect(rows).to_contain_text("console-42", timeout=60_000)
    expect(rows).to_contain_text("Linux")

    # The files browser lists /root; the egress counters are the daemon's.
    expect(page.locator("#files-path")).to_contain_text("root", timeout=30_000)
    expect(page.locator("#egress-mode")).to_have_text("open", timeout=30_000)

    key = daemon.api_key
    assert key not in page.content()
    assert key not in page.url
    assert [u for u in console.urls if key in u] == []
    sockets = [u for u in console.urls if u.startswith("ws://")]
    assert [u for u in sockets if f"/v1/sandboxes/{sid}/pty?" in u], console.urls
    assert console.foreign() == [], f"the console asked for other origins: {console.foreign()}"
    refused = [e for e in console.errors if "Content Security Policy" in e]
    assert refused == [], refused


def test_events_and_usage_chart(
    console: Watched, daemon: Daemon, http: httpx.Client, sandbox_id: dict[str, str]
) -> None:
    """The sandbox's events timeline and the usage charts (platform-meter's endpoints);
    on a daemon without them, each page says so instead of breaking."""
    sid = sandbox_id.get("id")
    assert sid, "the first test creates the sandbox"
    page = console.page
    console.sign_in(daemon.api_key)
    page.goto(f"{daemon.url}/ui/#/sandboxes/{sid}")
    events = http.get(f"/v1/sandboxes/{sid}/events")
    card = page.locator("#events-card")
    if events.status_code == 404:
        expect(card).to_contain_text("not available on this daemon", timeout=30_000)
    else:
        assert events.status_code == 200, events.text
        expect(card.locator("li.event[data-type='sandbox.created']")).to_be_visible(timeout=30_000)

    page.click("#nav a[data-page='usage']")
    usage = http.get("/v1/usage", params={"group_by": "day"})
    day = page.locator("#usage-day")
    if usage.status_code == 404:
        expect(day).to_contain_text("not available on this daemon", timeout=30_000)
    else:
        assert usage.status_code == 200, usage.text
        expect(day.locator("svg.chart g.bar")).not_to_have_count(0, timeout=30_000)
        expect(page.locator("#usage-sandbox svg.chart")).to_be_visible()

    # The project's audit trail: who created the sandbox, from where.
    page.click("#nav a[data-page='events']")
    audit = page.locator("#page-events")
    if events.status_code == 404:
        expect(audit).to_contain_text("not available on this daemon", timeout=30_000)
    else:
        created = audit.locator("tr.audit-row[data-type='sandbox.created']", has_text=sid)
        expect(created).to_contain_text("admin", timeout=30_000)
        expect(created).to_contain_text("127.0.0.1")
    assert console.errors == [] or all("404" in e for e in console.errors), console.errors


def test_viewer_sees_no_create_or_delete_and_the_api_refuses(
    console: Watched, daemon: Daemon, http: httpx.Client, sandbox_id: dict[str, str]
) -> None:
    """The admin makes a viewer key on the Keys page (its secret shown once, never in the
    page's HTML); signed in with it, the console offers no create, delete or terminal,
    and the API refuses create and delete to it anyway."""
    sid = sandbox_id.get("id")
    assert sid, "the first test creates the sandbox"
    if http.get("/v1/projects/default/keys").status_code == 404:
        pytest.skip("this daemon has no project keys yet (GET /v1/projects/{p}/keys is 404)")
    page = console.page
    console.sign_in(daemon.api_key)
    page.click("#nav a[data-page='keys']")
    page.fill("#key-name", "console-viewer")
    page.select_option("#key-role", "viewer")
    page.click("#key-form button[type=submit]")
    secret_box = page.locator("#new-secret")
    expect(secret_box).to_be_visible(timeout=30_000)
    secret = secret_box.input_value()
    assert secret.startswith("hk_"), secret
    expect(page.locator("tr.key-row", has_text="console-viewer")).to_contain_text("viewer")
    assert secret not in page.content(), "a key's secret is in the page's HTML"

    page.click("#sign-out")
    console.sign_in(secret)
    expect(page.locator("#who")).to_contain_text("viewer")
    row = page.locator(f"tr.sandbox-row[data-id='{sid}']")
    expect(row).to_be_visible(timeout=30_000)
    expect(page.locator("#create-form")).to_have_count(0)
    expect(page.locator("button.delete-sandbox")).to_have_count(0)
    expect(page.locator("#nav-keys")).to_be_hidden()
    row.locator("a.sandbox-link").click()
    expect(page.locator("#sandbox-state")).to_contain_text("running")
    expect(page.locator("#action-delete")).to_have_count(0)
    expect(page.locator("#open-terminal")).to_have_count(0)
    # The API refuses what the page does not offer.
    as_viewer = {"Authorization": f"Bearer {secret}"}
    created = httpx.post(f"{daemon.url}/v1/sandboxes", json={"image": "base"}, headers=as_viewer)
    assert created.status_code == 403, created.text
    deleted = httpx.delete(f"{daemon.url}/v1/sandboxes/{sid}", headers=as_viewer)
    assert deleted.status_code == 403, deleted.text
    assert http.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
    assert secret not in page.content() and secret not in page.url
    assert [u for u in console.urls if secret in u] == []
