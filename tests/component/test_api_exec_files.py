"""exec and files through the REST API, against the real guest agent."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import AsyncIterator

import httpx
import pytest

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def sid(api: httpx.AsyncClient) -> str:
    r = await api.post("/v1/sandboxes", json={"env": {"FROM_SANDBOX": "yes"}})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def test_exec_argv_shell_env_stdin(api: httpx.AsyncClient, sid: str) -> None:
    r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["echo", "a b"]})
    body = r.json()
    assert (body["exit_code"], body["stdout"], body["stderr"]) == (0, "a b\n", "")
    assert isinstance(body["duration_ms"], int)

    r = await api.post(
        f"/v1/sandboxes/{sid}/exec",
        json={
            "cmd": "echo $FROM_SANDBOX $FROM_EXEC; echo err >&2; exit 3",
            "env": {"FROM_EXEC": "too"},
        },
    )
    body = r.json()
    assert (body["exit_code"], body["stdout"], body["stderr"]) == (3, "yes too\n", "err\n")

    r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["cat"], "stdin": "piped"})
    assert r.json()["stdout"] == "piped"

    r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "pwd", "cwd": "/tmp"})
    assert r.json()["stdout"] == "/tmp\n"


async def test_exec_errors_leave_the_sandbox_usable(api: httpx.AsyncClient, sid: str) -> None:
    r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["no-such-command-xyz"]})
    assert r.status_code == 400
    assert "no-such-command-xyz" in r.json()["error"]["message"]

    r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["true"], "cwd": "/nope"})
    assert r.status_code in (400, 404)

    start = time.monotonic()
    r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["sleep", "30"], "timeout_s": 0.5})
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert "timeout_s=0.5" in r.json()["error"]["message"]
    assert time.monotonic() - start < 10

    r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": []})
    assert r.status_code == 400
    r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["true"], "timeout_s": -1})
    assert r.status_code == 400

    r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["echo", "ok"]})
    assert r.json()["stdout"] == "ok\n"


async def test_exec_stream_arrives_while_running(api: httpx.AsyncClient, sid: str) -> None:
    cmd = "for i in 1 2 3; do echo line$i; sleep 1; done; echo bye >&2"
    arrivals: list[tuple[float, dict[str, object]]] = []
    start = time.monotonic()
    async with api.stream(
        "POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, "stream": True}
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        async for line in r.aiter_lines():
            if line:
                arrivals.append((time.monotonic() - start, json.loads(line)))
    events = [e for _, e in arrivals]
    out = "".join(str(e["data"]) for e in events if e["type"] == "stdout")
    assert out == "line1\nline2\nline3\n"
    assert events[-1]["type"] == "exit" and events[-1]["exit_code"] == 0
    first_stdout = next(t for t, e in arrivals if e["type"] == "stdout")
    assert first_stdout < arrivals[-1][0] - 1.5, "output was not streamed as it happened"


async def test_exec_stream_timeout_ends_with_error_event(api: httpx.AsyncClient, sid: str) -> None:
    async with api.stream(
        "POST",
        f"/v1/sandboxes/{sid}/exec",
        json={"cmd": "echo start; sleep 30", "stream": True, "timeout_s": 0.5},
    ) as r:
        lines = [json.loads(x) async for x in r.aiter_lines() if x]
    assert lines[0] == {"type": "stdout", "data": "start\n"}
    assert lines[-1]["type"] == "error" and lines[-1]["code"] == "timeout"


async def test_files_round_trip_and_listing(api: httpx.AsyncClient, sid: str) -> None:
    base = f"/v1/sandboxes/{sid}/files"
    r = await api.put(base, params={"path": "/root/dir/a.txt", "mode": "0600"}, content=b"hello")
    assert r.status_code == 200 and r.json() == {"path": "/root/dir/a.txt", "size": 5}
    r = await api.get(base, params={"path": "/root/dir/a.txt"})
    assert r.status_code == 200 and r.content == b"hello"
    r = await api.get(base, params={"path": "dir/a.txt"})  # relative to /root
    assert r.content == b"hello"

    r = await api.get(f"{base}/stat", params={"path": "/root/dir/a.txt"})
    assert r.json()["mode"] == "0600" and r.json()["type"] == "file" and r.json()["size"] == 5
    r = await api.post(f"{base}/mkdir", json={"path": "/root/dir/sub"})
    assert r.status_code == 200 and r.json()["type"] == "dir"
    r = await api.post(
        f"{base}/rename", json={"source": "/root/dir/a.txt", "destination": "/root/dir/b.txt"}
    )
    assert r.json()["path"] == "/root/dir/b.txt"
    r = await api.get(f"{base}/list", params={"path": "/root/dir"})
    assert sorted((e["name"], e["type"]) for e in r.json()["entries"]) == [
        ("b.txt", "file"),
        ("sub", "dir"),
    ]

    r = await api.delete(base, params={"path": "/root/dir"})
    assert r.status_code == 409  # not empty
    r = await api.delete(base, params={"path": "/root/dir", "recursive": "true"})
    assert r.status_code == 204
    r = await api.get(base, params={"path": "/root/dir/b.txt"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    "path", ["/proc/self/environ", "/dev/zero", "/sys/kernel", "../etc", "a\x00b"]
)
async def test_paths_outside_what_is_allowed(api: httpx.AsyncClient, sid: str, path: str) -> None:
    r = await api.get(f"/v1/sandboxes/{sid}/files", params={"path": path})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_argument"
    r = await api.put(f"/v1/sandboxes/{sid}/files", params={"path": path}, content=b"x")
    assert r.status_code == 400


async def test_bad_mode_is_rejected(api: httpx.AsyncClient, sid: str) -> None:
    r = await api.put(
        f"/v1/sandboxes/{sid}/files", params={"path": "x", "mode": "999"}, content=b"x"
    )
    assert r.status_code == 400


async def test_large_file_streams_both_ways(api: httpx.AsyncClient, sid: str) -> None:
    size = 32 * 1024 * 1024
    digest = hashlib.sha256()

    async def body() -> AsyncIterator[bytes]:
        for _ in range(size // (1 << 20)):
            chunk = os.urandom(1 << 20)
            digest.update(chunk)
            yield chunk

    r = await api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/big"}, content=body())
    assert r.status_code == 200 and r.json()["size"] == size
    back = hashlib.sha256()
    async with api.stream("GET", f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/big"}) as r:
        async for chunk in r.aiter_bytes():
            back.update(chunk)
    assert back.hexdigest() == digest.hexdigest()
