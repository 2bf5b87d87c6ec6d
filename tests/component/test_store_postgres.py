"""The daemon (in process, fake VM driver) on a PostgreSQL server of this module's own
that is restarted and stopped under it: it keeps serving, answers a clear 500
``store_error`` while the server is down, and loses nothing stored."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hutch.config import Limits, Settings
from tests.pgserver import PgServer


@pytest.fixture(scope="module")
def own_server() -> Iterator[PgServer]:
    server = PgServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def settings(tmp_path: Path, own_server: PgServer) -> Settings:
    """The component tier's settings, with the state in this module's server."""
    return Settings(
        state_dir=tmp_path / "state",
        limits=Limits(max_sandboxes=40),
        database_url=own_server.fresh_database(),
    )


async def test_the_daemon_rides_out_a_database_restart_and_outage(
    api: httpx.AsyncClient, own_server: PgServer
) -> None:
    r = await api.post("/v1/sandboxes", json={"metadata": {"team": "a"}})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]

    await asyncio.to_thread(own_server.restart)
    r = await api.get(f"/v1/sandboxes/{sid}")  # reconnected, the row is there
    assert r.status_code == 200 and r.json()["metadata"] == {"team": "a"}, r.text

    await asyncio.to_thread(own_server.stop)
    try:
        r = await api.get("/v1/sandboxes")
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert error["code"] == "store_error"
        assert "cannot connect to the PostgreSQL database" in error["message"]
        assert "next call reconnects" in error["message"]
    finally:
        await asyncio.to_thread(own_server.start)

    other = await api.post("/v1/sandboxes", json={"metadata": {"team": "b"}})
    assert other.status_code == 201, other.text
    r = await api.get("/v1/sandboxes", params={"metadata": "team=a"})
    assert r.status_code == 200, r.text
    assert [s["id"] for s in r.json()["sandboxes"]] == [sid]
    r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo back"})
    assert r.status_code == 200 and r.json()["stdout"] == "back\n", r.text
