"""The web console in a real headless Chromium against the in-process daemon (the real
service, store and app behind uvicorn; the guest agent in bubblewrap): the fast proof of
the console's pages. tests/e2e/test_console.py is the same against real QEMU guests.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from playwright.async_api import BrowserContext, ConsoleMessage, Page, Request, expect

from tests.browser import async_chromium
from tests.component.conftest import API_KEY

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "console"


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[BrowserContext]:
    async with async_chromium(tmp_path / "chromium-profile") as context:
        yield context


class Watched:
    """A page with everything it asked for and every console error recorded."""

    def __init__(self, page: Page, origin: str) -> None:
        self.page = page
        self.origin = origin
        self.requests: list[str] = []
        self.errors: list[str] = []
        page.on("request", self._request)
        page.on("console", self._console)
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))

    def _request(self, request: Request) -> None:
        self.requests.append(request.url)

    def _console(self, msg: ConsoleMessage) -> None:
        if msg.type == "error":
            self.errors.append(msg.text)

    def foreign(self) -> list[str]:
        ws_origin = self.origin.replace("http://", "ws://")
        return [
            u
            for u in self.requests
            if not (u.startswith(self.origin + "/") or u.startswith(ws_origin + "/"))
            and not u.startswith("data:")
        ]

    async def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        await self.page.screenshot(path=str(path), full_page=True)
        print(f"console screenshot: {path}")
        return path


@pytest.fixture
async def console(
    browser: BrowserContext, api: httpx.AsyncClient, request: pytest.FixtureRequest
) -> AsyncIterator[Watched]:
    page = await browser.new_page()
    watched = Watched(page, str(api.base_url).rstrip("/"))
    yield watched
    failed = getattr(request.node, "rep_call", None)
    if failed is None or failed.failed:
        await watched.screenshot(request.node.name)


async def sign_in(w: Watched, key: str = API_KEY) -> None:
    await w.page.goto(w.origin + "/ui")
    await w.page.fill("#api-key", key)
    await w.page.click("#sign-in-button")
    await expect(w.page.locator("#who")).to_contain_text("admin")


async def test_console_sign_in_sandbox_terminal(console: Watched, api: httpx.AsyncClient) -> None:
    w = console
    await sign_in(w)
    page = w.page
    # The key is in session storage and headers, never in the page or its URL.
    assert await page.evaluate("sessionStorage.getItem('hutch.key')") == API_KEY
    await expect(page.locator("#sandboxes")).to_be_visible()
    created = (await api.post("/v1/sandboxes", json={"image": "base", "name": "ui-one"})).json()
    sid = created["id"]
    put = await api.put(
        f"/v1/sandboxes/{sid}/files",
        params={"path": "/root/hello.txt"},
        content=b"hi from the console test\n",
    )
    assert put.status_code == 200, put.text
    row = page.locator(f"tr.sandbox-row[data-id='{sid}']")
    await expect(row).to_be_visible(timeout=15_000)
    await expect(row).to_contain_text("running")
    await expect(row).to_contain_text("1 vCPU")
    await expect(page.locator("#create-form")).to_be_visible()
    await expect(row.locator("button.delete-sandbox")).to_be_visible()

    await row.locator("a.sandbox-link").click()
    await expect(page.locator("#sandbox-state")).to_contain_text("running")
    await page.click("#open-terminal")
    await expect(page.locator("#terminal-status")).to_contain_text("connected", timeout=20_000)
    await page.locator("#terminal .xterm").click()
    await page.keyboard.type("echo console-$((6*7))\n")
    await expect(page.locator("#terminal .xterm-rows")).to_contain_text(
        "console-42", timeout=20_000
    )

    # Files: /root is listed and a file opens; egress says what it can (this tier runs
    # without host networking, so the daemon's own refusal is shown).
    await expect(page.locator("#files-path")).to_contain_text("root")
    await page.locator("tr.file[data-name='hello.txt'] a").click()
    await expect(page.locator("#file-view")).to_contain_text("hi from the console test")
    await expect(page.locator("#egress-card")).to_contain_text(re.compile("Mode|networking is off"))
    await expect(page.locator("#events-card")).to_contain_text(re.compile("not available|sandbox"))

    html = await page.content()
    assert API_KEY not in html
    assert API_KEY not in page.url
    assert all(API_KEY not in u for u in w.requests), "the key appeared in a URL"
    assert w.foreign() == [], f"the console asked for other origins: {w.foreign()}"
    csp = [e for e in w.errors if "Content Security Policy" in e or "Refused" in e]
    assert csp == [], csp


async def test_usage_and_audit_pages_show_the_meter_or_say_it_is_missing(
    console: Watched, api: httpx.AsyncClient
) -> None:
    """With the meter: the usage chart and the audit table; on a daemon without it
    (usage and events answer 404): each page says so instead of breaking."""
    w = console
    sid = (await api.post("/v1/sandboxes", json={"image": "base"})).json()["id"]
    await sign_in(w)
    await w.page.click("#nav a[data-page='usage']")
    day = w.page.locator("#usage-day")
    await expect(day).to_be_visible()
    if (await api.get("/v1/usage", params={"group_by": "day"})).status_code == 404:
        await expect(day.locator(".notice")).to_contain_text("not available on this daemon")
    else:
        await expect(day.locator("svg.chart")).to_be_visible()
        await expect(day.locator(".notice")).to_have_count(0)
    await w.page.click("#nav a[data-page='events']")
    if (await api.get("/v1/events")).status_code == 404:
        await expect(w.page.locator("#audit-status")).to_contain_text(
            "not available on this daemon"
        )
    else:
        created = w.page.locator("tr.audit-row[data-type='sandbox.created']", has_text=sid)
        await expect(created).to_contain_text("admin")
        await expect(w.page.locator("#audit-status .notice")).to_have_count(0)


async def test_console_refuses_a_wrong_key(console: Watched) -> None:
    await console.page.goto(console.origin + "/ui/")
    await console.page.fill("#api-key", "hk_wrong")
    await console.page.click("#sign-in-button")
    await expect(console.page.locator("#sign-in-error")).to_contain_text("refused")
    assert await console.page.evaluate("sessionStorage.getItem('hutch.key')") is None


async def test_whoami_names_the_key_its_project_and_role(api: httpx.AsyncClient) -> None:
    me = (await api.get("/v1/whoami")).json()
    assert me["key_id"] == "admin" and me["role"] == "admin" and me["project"] == "default"
    assert "sandbox.create" in me["permissions"] and "key.manage" in me["permissions"]
    # An admin key acts in the project it names (made first where projects exist).
    made = await api.post("/v1/projects", json={"name": "team-a"})
    assert made.status_code in (201, 404), made.text  # 404: no projects API here yet
    other = await api.get("/v1/whoami", headers={"Hutch-Project": "team-a"})
    assert other.json()["project"] == "team-a", other.text
    bad = await api.get("/v1/whoami", headers={"Hutch-Project": "Not A Name"})
    assert bad.status_code == 400 and "Hutch-Project" in bad.json()["error"]["message"]
    assert (
        await api.get("/v1/whoami", headers={"Authorization": "Bearer nope"})
    ).status_code == 401


async def test_names_from_the_sandbox_are_shown_as_text(
    console: Watched, api: httpx.AsyncClient
) -> None:
    """A file name is the guest's to choose (hostile): the files browser shows it as
    text, it never becomes markup or runs."""
    sid = (await api.post("/v1/sandboxes", json={"image": "base"})).json()["id"]
    evil = "<img src=x onerror=window.__pwned=1>.txt"
    put = await api.put(
        f"/v1/sandboxes/{sid}/files", params={"path": f"/root/{evil}"}, content=b"x"
    )
    assert put.status_code == 200, put.text
    dialogs: list[str] = []
    console.page.on("dialog", lambda d: dialogs.append(d.message))
    await sign_in(console)
    await console.page.goto(f"{console.origin}/ui/#/sandboxes/{sid}")
    cell = console.page.locator("#files-list tr.file a", has_text="onerror")
    await expect(cell).to_have_text(evil)
    assert await console.page.locator("#files-list img").count() == 0
    assert await console.page.evaluate("window.__pwned") is None
    assert dialogs == []


async def test_keys_page_lists_creates_and_revokes_or_says_it_is_missing(
    console: Watched, api: httpx.AsyncClient
) -> None:
    await sign_in(console)
    page = console.page
    await page.click("#nav a[data-page='keys']")
    if (await api.get("/v1/projects/default/keys")).status_code == 404:
        await expect(page.locator("#keys-status")).to_contain_text("not available on this daemon")
        return
    await page.fill("#key-name", "ui-dev")
    await page.select_option("#key-role", "developer")
    await page.click("#key-form button[type=submit]")
    secret = await page.locator("#new-secret").input_value()
    assert secret.startswith("hk_"), secret
    assert secret not in await page.content()
    row = page.locator("tr.key-row", has_text="ui-dev")
    await expect(row).to_contain_text("developer")
    await row.locator("button.revoke-key").click()
    await expect(row.locator("button.revoke-key")).to_have_count(0)
    answer = await api.get("/v1/whoami", headers={"Authorization": f"Bearer {secret}"})
    assert answer.status_code == 401, answer.text


async def test_usage_rows_of_the_meters_shape_become_bars(console: Watched) -> None:
    """The chart and row reader on the shape of platform-meter's UsageReport (rows with
    key, quantities and cost_usd), in the browser; the e2e test reads the real meter."""
    await console.page.goto(console.origin + "/ui/")
    report = {
        "group_by": "day",
        "rows": [
            {"key": "2026-11-30", "vcpu_seconds": 3600.0, "cost_usd": 0.0361},
            {"key": "2026-12-01", "vcpu_seconds": 1800.0, "cost_usd": 0.0180},
        ],
        "total": {"key": "total", "vcpu_seconds": 5400.0, "cost_usd": 0.0541},
    }
    bars = await console.page.evaluate(
        """async (report) => {
            const { barChart } = await import("./js/chart.js");
            const { rowsOf, groupKey, costOf } = await import("./js/usage_rows.js");
            const rows = rowsOf(report);
            const bars = rows.map((r) => ({ label: groupKey(r, "day"), value: costOf(r) }));
            const svg = barChart(bars);
            document.body.appendChild(svg);
            return [...svg.querySelectorAll("g.bar")].map((g) => [
                g.dataset.label, Number(g.dataset.value),
                Number(g.querySelector("rect").getAttribute("height")),
            ]);
        }""",
        report,
    )
    assert [b[:2] for b in bars] == [["2026-11-30", 0.0361], ["2026-12-01", 0.018]]
    assert bars[0][2] > bars[1][2] > 0, bars
