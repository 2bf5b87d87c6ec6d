"""Calls in flight across pause, snapshot, fork and delete, through the REST API with the
real agent (in bubblewrap; the fake pause SIGSTOPs it and drops its connection, as a
memory pause drops the agent's). Real VMs and the daemon: tests/e2e/test_inflight_auth.py.

The promise: a lifecycle call waits for calls in flight (bounded; then 409 busy naming
them) and never cuts them; what it does end (open-ended streams: terminals), and what a
delete cuts, ends with an error the client sees, never with a silent short answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import replace
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from hutch.config import Settings
from hutch.services.composed import Services
from tests.component.conftest import API_KEY, until

pytestmark = pytest.mark.timeout(120)

WAIT_S = 3.0
BIG = 8 << 20


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return replace(settings, lifecycle_wait_s=WAIT_S)


async def create(api: httpx.AsyncClient, **body: object) -> str:
    r = await api.post("/v1/sandboxes", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def big_file(api: httpx.AsyncClient, sid: str) -> str:
    r = await api.post(
        f"/v1/sandboxes/{sid}/exec",
        json={"cmd": f"head -c {BIG} /dev/urandom > /root/big && sha256sum /root/big"},
    )
    assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
    return str(r.json()["stdout"].split()[0])


class InFlight:
    """Three calls held in flight on a sandbox: a collected exec, a streamed exec and a
    download read slowly."""

    def __init__(self, api: httpx.AsyncClient, service: Services, sid: str) -> None:
        self.api, self.service, self.sid = api, service, sid
        self._streaming = asyncio.Event()
        self._downloading = asyncio.Event()

    async def collected(self) -> dict[str, Any]:
        r = await self.api.post(
            f"/v1/sandboxes/{self.sid}/exec", json={"cmd": "sleep 1.2; echo collected"}
        )
        assert r.status_code == 200, r.text
        return dict(r.json())

    async def streamed(self) -> list[dict[str, Any]]:
        events = []
        cmd = "for i in 1 2 3 4 5 6; do echo tick $i; sleep 0.2; done"
        async with self.api.stream(
            "POST", f"/v1/sandboxes/{self.sid}/exec", json={"cmd": cmd, "stream": True}
        ) as r:
            async for line in r.aiter_lines():
                if line:
                    events.append(json.loads(line))
                    self._streaming.set()
        return events

    async def download(self) -> str:
        digest = hashlib.sha256()
        async with self.api.stream(
            "GET", f"/v1/sandboxes/{self.sid}/files", params={"path": "/root/big"}
        ) as r:
            assert r.status_code == 200
            async for chunk in r.aiter_bytes():
                digest.update(chunk)
                self._downloading.set()
                await asyncio.sleep(0.004)  # a slow reader: the download stays in flight
        return digest.hexdigest()

    async def start(self) -> asyncio.Future[Any]:
        """Start the three calls; return (their gathered results) once all are in flight."""
        calls = asyncio.gather(self.collected(), self.streamed(), self.download())
        await self._streaming.wait()
        await self._downloading.wait()
        # The collected exec shows nothing until it ends: it is in flight once the
        # service has it inside (a sleep standing for that raced on a busy host).
        await until(
            lambda: any(
                "collected" in work.what
                for work in self.service.core.activity.inflight.inside(self.sid)
            ),
            "the collected exec never got inside",
        )
        return calls


@pytest.mark.parametrize("op", ["pause", "snapshot", "fork"])
async def test_lifecycle_calls_wait_for_calls_in_flight(
    api: httpx.AsyncClient, service: Services, op: str
) -> None:
    sid = await create(api)
    want = await big_file(api, sid)
    results = await InFlight(api, service, sid).start()
    path, body = {
        "pause": ("pause", {"mode": "memory"}),
        "snapshot": ("snapshots", {"name": "mid-flight"}),
        "fork": ("fork", {"count": 1}),
    }[op]
    r = await api.post(f"/v1/sandboxes/{sid}/{path}", json=body)
    assert r.is_success, r.text
    collected, streamed, digest = await results
    # Each call, in flight when the lifecycle call came, got its whole answer (today's
    # alternative: 502 "the VM may have stopped", or a download cut short).
    assert collected["exit_code"] == 0 and collected["stdout"] == "collected\n"
    assert [e["data"] for e in streamed if e["type"] == "stdout"] == [
        f"tick {i}\n" for i in range(1, 7)
    ]
    assert streamed[-1]["type"] == "exit" and streamed[-1]["exit_code"] == 0
    assert digest == want
    if op == "pause":
        assert (await api.post(f"/v1/sandboxes/{sid}/resume")).is_success


async def test_calls_outlasting_the_wait_make_it_busy_and_are_not_cut(
    api: httpx.AsyncClient,
) -> None:
    sid = await create(api)
    async with api.stream(
        "POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo up; sleep 60", "stream": True}
    ) as stream:
        lines = stream.aiter_lines()
        assert json.loads(await anext(lines))["data"] == "up\n"
        started = time.monotonic()
        for path, body in (("pause", {}), ("snapshots", {"name": "s"}), ("fork", {"count": 1})):
            r = await api.post(f"/v1/sandboxes/{sid}/{path}", json=body)
            assert r.status_code == 409, r.text
            err = r.json()["error"]
            assert err["code"] == "busy"
            assert "exec 'echo up; sleep 60' (running" in err["message"]
            assert f"waited {WAIT_S:g} s" in err["message"]
        assert time.monotonic() - started >= 3 * WAIT_S
        assert (await api.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"
        # The exec was not cut: its stream is still open and the sandbox answers.
        r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo still"})
        assert r.json()["stdout"] == "still\n"
    # The client gave up on the stream: that call is over, so a pause goes through now.
    assert (await api.post(f"/v1/sandboxes/{sid}/pause", json={})).is_success


async def test_a_call_during_a_lifecycle_call_runs_after_it(
    api: httpx.AsyncClient, service: Services
) -> None:
    sid = await create(api, auto_resume=True)
    lock = service.core.lock(sid)
    await lock.acquire()  # stands for a pause being under way: it holds the lock...
    pause = asyncio.create_task(api.post(f"/v1/sandboxes/{sid}/pause", json={}))
    await asyncio.sleep(0.2)
    lock.release()  # ... and now quiesces; an exec arriving meanwhile waits, then resumes
    r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo after"})
    assert (await pause).is_success
    assert r.status_code == 200 and r.json()["stdout"] == "after\n"


async def test_auto_pause_never_pauses_over_a_call_that_just_started(
    api: httpx.AsyncClient, service: Services
) -> None:
    sid = await create(api, auto_pause_s=60)
    service.core.clock = lambda: time.time() + 61  # idle long enough ...
    lock = service.core.lock(sid)
    await lock.acquire()
    # No sleeps stand for "has got there" (they raced on a busy host, the PostgreSQL
    # pass's lookups in the exec's way): the reaper's pause runs on without a pause of
    # its own from the call seen here to waiting for the lock, so once this task runs
    # again it waits there.
    pause, pausing = service.reaper.lifecycle.pause, asyncio.Event()

    async def seen_pause(*args: Any, **kwargs: Any) -> Any:
        pausing.set()
        return await pause(*args, **kwargs)

    service.reaper.lifecycle.pause = seen_pause  # type: ignore[method-assign]
    policies = asyncio.create_task(service.reaper.apply_policies())
    await asyncio.wait_for(pausing.wait(), 30)  # ... the reaper decided to pause
    assert not policies.done()
    exec_call = asyncio.create_task(
        api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 1; echo kept"})
    )
    await until(  # the exec is inside (it holds a lease) ...
        lambda: service.core.activity.idle_for(service.core.get(sid), service.core.clock()) == 0,
        "the exec never took its lease",
    )
    lock.release()
    await policies
    assert (await api.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"
    r = await exec_call
    assert r.status_code == 200 and r.json()["stdout"] == "kept\n"
    service.core.clock = lambda: time.time() + 200
    await service.reaper.apply_policies()  # idle again: now it pauses
    assert (await api.get(f"/v1/sandboxes/{sid}")).json()["state"] == "paused"


async def test_delete_cuts_streams_with_an_error_the_client_sees(api: httpx.AsyncClient) -> None:
    sid = await create(api)
    await big_file(api, sid)
    events: list[dict[str, Any]] = []
    got = 0
    streaming, downloading = asyncio.Event(), asyncio.Event()

    async def streamed() -> None:
        async with api.stream(
            "POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo a; sleep 30", "stream": True}
        ) as r:
            async for line in r.aiter_lines():
                if line:
                    events.append(json.loads(line))
                    streaming.set()

    async def download() -> None:
        nonlocal got
        async with api.stream(
            "GET", f"/v1/sandboxes/{sid}/files", params={"path": "/root/big"}
        ) as r:
            async for chunk in r.aiter_bytes():
                got += len(chunk)
                downloading.set()
                await asyncio.sleep(0.02)

    s, d = asyncio.create_task(streamed()), asyncio.create_task(download())
    await streaming.wait()
    await downloading.wait()
    assert (await api.delete(f"/v1/sandboxes/{sid}")).status_code == 204
    await s
    assert events[-1]["type"] == "error", events
    assert f"sandbox {sid} was deleted while this call ran" in events[-1]["message"]
    # A raw download has no error event: it is aborted, never ended cleanly short.
    with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
        await d
    assert 0 < got < BIG


async def test_a_terminal_across_a_pause_ends_with_the_reason_and_reattaches(
    api: httpx.AsyncClient,
) -> None:
    sid = await create(api)
    base = str(api.base_url).replace("http://", "ws://")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with connect(f"{base}/v1/sandboxes/{sid}/pty?cmd=cat", additional_headers=headers) as ws:
        ready = json.loads(await ws.recv())
        assert ready["type"] == "ready"
        r = await api.post(f"/v1/sandboxes/{sid}/pause", json={})
        assert r.is_success  # a terminal is open ended: it does not hold a pause up
        frames = []
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                message = await ws.recv()
                if isinstance(message, str):
                    frames.append(json.loads(message))
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4502
    err = frames[-1]
    assert err["type"] == "error" and f"sandbox {sid} was paused" in err["message"]
    assert "keeps running" in err["message"]
    assert (await api.post(f"/v1/sandboxes/{sid}/resume")).is_success
    url = f"{base}/v1/sandboxes/{sid}/pty?pty_id={ready['pty_id']}"
    async with connect(url, additional_headers=headers) as ws:
        assert json.loads(await ws.recv())["type"] == "ready"  # the terminal lived on
