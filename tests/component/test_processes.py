"""Background processes and PTY terminals through the REST API and the WebSocket, against
the real guest agent (in bubblewrap; tests/vm and tests/e2e repeat the key ones on VMs)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from tests.component.conftest import API_KEY, until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def sid(api: httpx.AsyncClient) -> str:
    r = await api.post("/v1/sandboxes", json={"env": {"FROM_SANDBOX": "yes"}})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def _wait_exited(api: httpx.AsyncClient, sid: str, pid: int) -> dict[str, Any]:
    r = await api.post(f"/v1/sandboxes/{sid}/processes/{pid}/wait", params={"timeout_s": 30})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    assert body["state"] == "exited", body
    return body


async def test_background_process_lifecycle(api: httpx.AsyncClient, sid: str) -> None:
    base = f"/v1/sandboxes/{sid}/processes"
    r = await api.post(
        base, json={"cmd": "echo out $FROM_SANDBOX; echo err >&2; sleep 0.3; exit 3"}
    )
    assert r.status_code == 201, r.text
    proc = r.json()
    pid = proc["pid"]
    assert proc["state"] == "running" and proc["argv"][:2] == ["/bin/sh", "-c"]

    listed = (await api.get(base)).json()["processes"]
    assert pid in [p["pid"] for p in listed]

    done = await _wait_exited(api, sid, pid)
    assert done["exit_code"] == 3 and done["ended_at"] is not None

    r = await api.get(f"{base}/{pid}/output")
    out = r.json()
    assert (out["stdout"], out["stderr"]) == ("out yes\n", "err\n")
    assert out["next_offset"] == 12 and out["dropped_bytes"] == 0
    # From an offset: only what comes after it.
    r = await api.get(f"{base}/{pid}/output", params={"offset": 4})
    assert r.json()["stdout"] + r.json()["stderr"] in ("yes\nerr\n", "err\nyes\n")

    # Signal to a finished process: a clear 409.
    r = await api.post(f"{base}/{pid}/signal", json={"signal": "TERM"})
    assert r.status_code == 409, r.text
    assert r.json()["error"] == {
        "code": "conflict",
        "message": f"process {pid} already exited with code 3",
    }
    # Unknown pid: 404 saying so.
    r = await api.get(f"{base}/999999")
    assert r.status_code == 404
    assert "no background process 999999" in r.json()["error"]["message"]
    r = await api.post(f"{base}/999999/signal", json={"signal": 15})
    assert r.status_code == 404
    r = await api.post(f"{base}/{pid}/signal", json={"signal": "NOPE"})
    assert r.status_code == 400 and "NOPE" in r.json()["error"]["message"]

    # exec with background=true: the same, through the exec endpoint.
    r = await api.post(
        f"/v1/sandboxes/{sid}/exec", json={"cmd": "cat", "background": True, "stdin": "in"}
    )
    assert r.status_code == 201, r.text
    bg = r.json()["pid"]
    assert (await _wait_exited(api, sid, bg))["exit_code"] == 0
    assert (await api.get(f"{base}/{bg}/output")).json()["stdout"] == "in"
    r = await api.post(
        f"/v1/sandboxes/{sid}/exec", json={"cmd": "true", "background": True, "stream": True}
    )
    assert r.status_code == 400


async def test_follow_streams_live_until_exit(api: httpx.AsyncClient, sid: str) -> None:
    base = f"/v1/sandboxes/{sid}/processes"
    cmd = "for i in 1 2 3; do echo tick $i; sleep 0.2; done"
    pid = (await api.post(base, json={"cmd": cmd})).json()["pid"]
    events = []
    started = time.monotonic()
    async with api.stream("GET", f"{base}/{pid}/output", params={"follow": "true"}) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        async for line in r.aiter_lines():
            events.append((time.monotonic() - started, json.loads(line)))
    text = "".join(e["data"] for _, e in events if e["type"] == "stdout")
    assert text == "tick 1\ntick 2\ntick 3\n"
    end = events[-1][1]
    assert end["type"] == "end" and end["process"]["exit_code"] == 0
    assert end["next_offset"] == len(text)
    # Live: the first tick came well before the end.
    assert events[0][0] < events[-1][0] - 0.2


async def test_stdin_signal_kill_timeout(api: httpx.AsyncClient, sid: str) -> None:
    base = f"/v1/sandboxes/{sid}/processes"
    r = await api.post(base, json={"cmd": ["cat"], "stdin": "first ", "keep_stdin": True})
    pid = r.json()["pid"]
    assert r.json()["stdin_open"] is True
    r = await api.post(f"{base}/{pid}/stdin", content=b"second", params={"eof": "1"})
    assert r.status_code == 200, r.text
    assert (await _wait_exited(api, sid, pid))["exit_code"] == 0
    assert (await api.get(f"{base}/{pid}/output")).json()["stdout"] == "first second"
    r = await api.post(f"{base}/{pid}/stdin", content=b"more")
    assert r.status_code == 409

    # Without keep_stdin, stdin is /dev/null and cannot be written.
    pid = (await api.post(base, json={"cmd": ["sleep", "60"]})).json()["pid"]
    r = await api.post(f"{base}/{pid}/stdin", content=b"x")
    assert r.status_code == 400 and "without stdin" in r.json()["error"]["message"]
    r = await api.post(f"{base}/{pid}/signal", json={"signal": "SIGTERM"})
    assert r.status_code == 200, r.text
    done = await _wait_exited(api, sid, pid)
    assert (done["exit_code"], done["signal"]) == (None, 15)

    pid = (await api.post(base, json={"cmd": ["sleep", "60"]})).json()["pid"]
    r = await api.delete(f"{base}/{pid}")
    assert r.status_code == 200 and r.json()["signal"] == 9

    pid = (await api.post(base, json={"cmd": ["sleep", "60"], "timeout_s": 0.3})).json()["pid"]
    done = await _wait_exited(api, sid, pid)
    assert done["timed_out"] is True and done["signal"] == 9


async def test_output_ring_is_bounded(api: httpx.AsyncClient, sid: str) -> None:
    base = f"/v1/sandboxes/{sid}/processes"
    cmd = "head -c 3000000 /dev/zero | tr '\\0' a; echo; echo tail-marker"
    pid = (await api.post(base, json={"cmd": cmd})).json()["pid"]
    done = await _wait_exited(api, sid, pid)
    assert done["output_bytes"] == 3000000 + 1 + 12
    assert done["dropped_bytes"] == done["output_bytes"] - 2 * 1024 * 1024
    out = (await api.get(f"{base}/{pid}/output")).json()
    assert out["dropped_bytes"] == done["dropped_bytes"]
    assert len(out["stdout"]) == 2 * 1024 * 1024 and out["stdout"].endswith("tail-marker\n")


async def test_process_survives_pause_and_resume(api: httpx.AsyncClient, sid: str) -> None:
    """The fake pause stops the agent and drops its connection; resume reconnects with a
    new session. The process table lives outside sessions."""
    base = f"/v1/sandboxes/{sid}/processes"
    cmd = "i=0; while true; do i=$((i+1)); echo tick $i; sleep 0.1; done"
    pid = (await api.post(base, json={"cmd": cmd})).json()["pid"]
    await asyncio.sleep(0.5)
    assert (
        await api.post(f"/v1/sandboxes/{sid}/pause", json={"mode": "memory"})
    ).status_code == 200
    assert (await api.post(f"/v1/sandboxes/{sid}/resume")).status_code == 200
    before = (await api.get(f"{base}/{pid}")).json()
    assert before["state"] == "running"
    # It prints on after the resume, past its first two ticks (every 0.1 s: polled,
    # since a busy host may take longer).
    past = max(before["output_bytes"], len("tick 1\ntick 2\n") - 1)

    async def printed_past() -> bool:
        return bool((await api.get(f"{base}/{pid}")).json()["output_bytes"] > past)

    await until(printed_past, "the process printed nothing after the resume")
    out = (await api.get(f"{base}/{pid}/output")).json()["stdout"]
    assert out.startswith("tick 1\ntick 2\n")
    assert (await api.delete(f"{base}/{pid}")).json()["state"] == "exited"


# -- terminals ------------------------------------------------------------------------


def _ws_url(api: httpx.AsyncClient, sid: str, **query: str | int) -> str:
    params = httpx.QueryParams({k: str(v) for k, v in query.items()})
    base = str(api.base_url).replace("http://", "ws://")
    return f"{base}/v1/sandboxes/{sid}/pty?{params}"


class Term:
    """A WebSocket terminal client that collects the screen bytes and control frames."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.screen = b""
        self.controls: list[dict[str, Any]] = []

    async def expect(self, needle: bytes, within: float = 15) -> None:
        async with asyncio.timeout(within):
            while needle not in self.screen:
                await self.recv_one()

    async def control(self, kind: str, within: float = 15) -> dict[str, Any]:
        async with asyncio.timeout(within):
            while True:
                for c in self.controls:
                    if c["type"] == kind:
                        self.controls.remove(c)
                        return c
                await self.recv_one()

    async def recv_one(self) -> None:
        msg = await self.ws.recv()
        if isinstance(msg, bytes):
            self.screen += msg
        else:
            self.controls.append(json.loads(msg))

    async def type(self, text: str) -> None:
        await self.ws.send(text.encode())


async def _open(url: str) -> Term:
    ws = await connect(url, additional_headers={"Authorization": f"Bearer {API_KEY}"})
    return Term(ws)


async def test_pty_resize_signal_and_reattach(api: httpx.AsyncClient, sid: str) -> None:
    t = await _open(_ws_url(api, sid, rows=30, cols=100))
    try:
        ready = await t.control("ready")
        pty_id = ready["pty_id"]
        await t.type("export MARK=kept-$((40+2)); stty size; tty\n")
        await t.expect(b"30 100")
        await t.expect(b"/dev/pts/")
        await t.ws.send(json.dumps({"type": "resize", "rows": 40, "cols": 120}))
        await t.type("stty size\n")
        await t.expect(b"40 120")
        # Ctrl-C as a signal to the foreground job: the shell comes back.
        await t.type("sleep 100\n")
        await asyncio.sleep(0.5)
        await t.ws.send(json.dumps({"type": "signal", "signal": "INT"}))
        await t.type("echo after-$?\n")
        await t.expect(b"after-130")
        await t.ws.send(json.dumps({"type": "resize", "rows": 0, "cols": 5}))
        err = await t.control("error")
        assert err["code"] == "invalid_argument" and "rows=0" in err["message"]
    finally:
        await t.ws.close()  # a dropped connection: the terminal keeps running

    listed = (await api.get(f"/v1/sandboxes/{sid}/ptys")).json()["ptys"]
    assert [p["pty_id"] for p in listed] == [pty_id]

    t = await _open(_ws_url(api, sid, pty_id=pty_id))
    try:
        assert (await t.control("ready"))["pty_id"] == pty_id
        await t.expect(b"after-130")  # the scrollback is replayed
        t.screen = b""
        await t.type("echo value=$MARK\n")
        await t.expect(b"value=kept-42")
        await t.type("exit 7\n")
        assert (await t.control("exit"))["exit_code"] == 7
    finally:
        await t.ws.close()

    # Reattach to a terminal whose shell exited: a clear error, then the socket closes.
    t = await _open(_ws_url(api, sid, pty_id=pty_id))
    err = await t.control("error")
    assert err["code"] == "conflict" and "exited with code 7" in err["message"]
    with pytest.raises(ConnectionClosed) as closed:
        await t.recv_one()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4409


async def _refused(t: Term) -> str:
    """The session ends with an unauthorized error frame and close code 4401."""
    err = await t.control("error")
    assert err["code"] == "unauthorized", err
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            await t.recv_one()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401
    assert API_KEY not in err["message"]
    return str(err["message"])


@pytest.mark.parametrize(
    "first",
    [
        {"type": "auth", "token": "hk_wrong"},
        {"type": "auth", "token": API_KEY + " "},  # exact: no stripping
        {"type": "auth", "token": API_KEY + "\t"},
        {"type": "auth", "token": " " + API_KEY},
        {"type": "auth"},
        {"type": "resize", "rows": 3, "cols": 3},
        "not json",
    ],
)
async def test_pty_first_message_auth_is_exact(
    api: httpx.AsyncClient, sid: str, first: object
) -> None:
    t = Term(await connect(_ws_url(api, sid, cmd="cat")))  # no header
    await t.ws.send(first if isinstance(first, str) else json.dumps(first))
    await _refused(t)


async def test_pty_key_in_the_url_is_refused(api: httpx.AsyncClient, sid: str) -> None:
    """?token= (taken by earlier versions) is refused, with or without a valid header:
    a key in a URL ends up in logs, proxies and browser history."""
    url = _ws_url(api, sid, cmd="cat", token=API_KEY)
    message = await _refused(Term(await connect(url)))
    assert "not accepted in the URL" in message and '{"type": "auth"' in message
    await _refused(await _open(url))


async def test_pty_close_auth_and_unknown(api: httpx.AsyncClient, sid: str) -> None:
    url = _ws_url(api, sid, cmd="cat")
    ws = await connect(url, additional_headers={"Authorization": "Bearer hk_wrong"})
    assert "wrong API key" in await _refused(Term(ws))
    # No header: the first message carries the key (browsers cannot set headers).
    t = Term(await connect(url))
    await t.ws.send(json.dumps({"type": "auth", "token": API_KEY}))
    pty_id = (await t.control("ready"))["pty_id"]
    await t.type("typed\n")
    await t.expect(b"typed\r\ntyped\r\n")  # echo by the tty, then cat's copy
    await t.ws.send(json.dumps({"type": "close"}))
    assert (await t.control("exit"))["signal"] == 1  # SIGHUP
    await t.ws.close()

    t = await _open(_ws_url(api, sid, pty_id=pty_id))
    err = await t.control("error")
    assert err["code"] == "not_found" and pty_id in err["message"]
    await t.ws.close()
    r = await api.delete(f"/v1/sandboxes/{sid}/ptys/{pty_id}")
    assert r.status_code == 404

    t = await _open(_ws_url(api, "sb-nope"))
    assert (await t.control("error"))["code"] == "not_found"
    await t.ws.close()


# -- the SDK over the same daemon --------------------------------------------------------


async def test_sdk_processes_and_terminal(api: httpx.AsyncClient, sid: str) -> None:
    from hutch.errors import Conflict, NotFound
    from hutch.sdk import AsyncSandbox, ProcessChunk, ProcessEnd

    sb = await AsyncSandbox.connect(sid, base_url=str(api.base_url), api_key=API_KEY)
    try:
        p = await sb.processes.start(
            ["sh", "-c", "read x; echo got $x; echo e >&2"], keep_stdin=True
        )
        assert p.info.running and p.info.stdin_open
        await p.write_stdin("hi\n", eof=True)
        events = [e async for e in p.stream()]
        assert [e.data for e in events if isinstance(e, ProcessChunk)] in (
            ["got hi\n", "e\n"],
            ["e\n", "got hi\n"],
        )
        end = events[-1]
        assert isinstance(end, ProcessEnd) and end.process.exit_code == 0
        out = await p.output(offset=end.next_offset)
        assert (out.stdout, out.stderr, out.next_offset) == ("", "", end.next_offset)
        with pytest.raises(Conflict, match=f"process {p.pid} already exited with code 0"):
            await p.signal("TERM")
        assert p.pid in [q.pid for q in await sb.processes.list()]
        with pytest.raises(NotFound):
            await sb.processes.get(999999)

        slow = await sb.processes.start("sleep 30")
        assert (await slow.wait(timeout_s=0.2)).running
        assert (await slow.kill()).signal == 9

        term = await sb.pty.open(rows=10, cols=50)
        await term.send("X=persisted; stty size\n")
        seen = b""
        while b"10 50" not in seen:
            seen += await term.recv()
        pty_id = term.pty_id
        await term.detach()
        term = await sb.pty.attach(pty_id)
        await term.send("echo [$X]\n")
        seen = b""
        while b"[persisted]" not in seen:
            seen += await term.recv()
        await term.kill()
        while await term.recv():
            pass
        assert term.ended and term.state.signal == 1
        await term.detach()
        assert [t.pty_id for t in await sb.pty.list()] == []
    finally:
        await sb.close()


async def test_cli_shell_on_a_local_terminal(api: httpx.AsyncClient, sid: str) -> None:
    """``hutch shell`` on a real local pty: raw keys, exit status, terminal restored."""
    import os
    import select
    import subprocess
    import sys
    import termios

    def _read_pty(fd: int, needle: bytes, within: float) -> bytes:
        seen = b""
        deadline = time.monotonic() + within
        while needle not in seen:
            left = deadline - time.monotonic()
            assert left > 0, f"{needle!r} not seen; got {seen[-1500:]!r}"
            if select.select([fd], [], [], left)[0]:
                seen += os.read(fd, 65536)
        return seen

    env = {
        **os.environ,
        "HUTCH_URL": str(api.base_url),
        "HUTCH_API_KEY": API_KEY,
        "PYTHONPATH": os.pathsep.join(sys.path),
    }

    def drive() -> tuple[int, bool]:
        master, slave = os.openpty()
        saved = termios.tcgetattr(slave)
        proc = subprocess.Popen(
            [sys.executable, "-m", "hutch", "shell", sid],
            env=env,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
        )
        try:
            _read_pty(master, b"#", 30)
            os.write(master, b"sleep 100\r")
            time.sleep(0.5)
            os.write(master, b"\x03")  # Ctrl-C goes to the sandbox as a byte
            _read_pty(master, b"^C", 30)
            os.write(master, b"echo rc=$?; exit 5\r")
            _read_pty(master, b"rc=130", 30)
            return proc.wait(30), termios.tcgetattr(slave) == saved
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            os.close(slave)
            os.close(master)

    # In a thread: this event loop also serves the daemon the CLI talks to.
    assert await asyncio.to_thread(drive) == (5, True)
