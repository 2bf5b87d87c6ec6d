"""The SDK's background-process and terminal cores (no I/O), and the CLI's ``ps``/``logs``/
``kill`` over a mock transport."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from hutch.cli._env import CliEnv
from hutch.cli.main import cli
from hutch.errors import Conflict, InvalidArgument, NotFound
from hutch.sdk import Client, ProcessChunk, ProcessDropped, ProcessEnd, Processes
from hutch.sdk._config import resolve_config
from hutch.sdk._core import ClientCore
from hutch.sdk._errors import ProtocolError
from hutch.sdk._processes import ProcessCalls, ProcessEventDecoder
from hutch.sdk._pty import TerminalState

KEY = "hk_unit"

PROC: dict[str, Any] = {
    "pid": 42,
    "argv": ["/bin/sh", "-c", "echo hi"],
    "state": "exited",
    "exit_code": 0,
    "signal": None,
    "timed_out": False,
    "started_at": "2026-01-01T00:00:00Z",
    "ended_at": "2026-01-01T00:00:01Z",
    "output_bytes": 3,
    "dropped_bytes": 0,
    "stdin_open": False,
}


def core() -> ClientCore:
    return ClientCore(resolve_config(base_url="http://127.0.0.1:7070", api_key=KEY))


def test_requests_are_built_and_checked() -> None:
    calls = ProcessCalls(core())
    req = calls.start(
        "sb-1", "sleep 1", {"env": {"A": "1"}, "timeout_s": 5}, keep_stdin=True
    ).request
    assert (req.method, req.url.path) == ("POST", "/v1/sandboxes/sb-1/processes")
    assert json.loads(req.content) == {
        "cmd": "sleep 1",
        "env": {"A": "1"},
        "keep_stdin": True,
        "timeout_s": 5,
    }
    req = calls.follow_request("sb-1", 42, offset=7)
    assert req.url.params["offset"] == "7" and req.url.params["follow"] == "true"
    req = calls.write_stdin("sb-1", 42, "x", eof=True).request
    assert (req.url.path, req.url.params["eof"], req.content) == (
        "/v1/sandboxes/sb-1/processes/42/stdin",
        "true",
        b"x",
    )
    assert json.loads(calls.signal("sb-1", 42, "TERM").request.content) == {"signal": "TERM"}
    for bad in (
        lambda: calls.get("sb-1", 0),
        lambda: calls.output("sb-1", 42, offset=-1),
        lambda: calls.signal("sb-1", 42, 0),
        lambda: calls.start("sb-1", [], {}),
        lambda: calls.start("sb-1", "x", {"timeout_s": 0}),
    ):
        with pytest.raises(InvalidArgument):
            bad()


def test_event_decoder() -> None:
    d = ProcessEventDecoder()
    lines = [
        {"type": "stdout", "offset": 0, "data": "a"},
        {"type": "dropped", "bytes": 5},
        {"type": "stderr", "offset": 6, "data": "b"},
        {"type": "end", "next_offset": 7, "process": PROC},
    ]
    raw = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    events = [*d.feed(raw[:10]), *d.feed(raw[10:]), *d.eof()]
    assert events[:3] == [
        ProcessChunk("stdout", 0, "a"),
        ProcessDropped(5),
        ProcessChunk("stderr", 6, "b"),
    ]
    assert isinstance(events[3], ProcessEnd) and events[3].process.pid == 42
    with pytest.raises(ProtocolError, match="ended before the process did"):
        ProcessEventDecoder().eof()
    err = json.dumps({"type": "error", "code": "not_found", "message": "gone"}).encode()
    with pytest.raises(NotFound, match="gone"):
        ProcessEventDecoder().feed(err + b"\n")


def test_terminal_state() -> None:
    url, headers = TerminalState.url(core(), "sb-1", rows=30, cols=100, cmd="top")
    assert url.startswith("ws://127.0.0.1:7070/v1/sandboxes/sb-1/pty?")
    assert "rows=30" in url and "cols=100" in url and "cmd=top" in url
    assert headers["Authorization"] == f"Bearer {KEY}"
    url, _ = TerminalState.url(core(), "sb-1", pty_id="pty-abc")
    assert url.endswith("/pty?pty_id=pty-abc")
    with pytest.raises(InvalidArgument, match="rows=0"):
        TerminalState.url(core(), "sb-1", rows=0)
    with pytest.raises(InvalidArgument):
        TerminalState.resize(24, 5000)

    st = TerminalState()
    assert st.receive(b"bytes") == b"bytes"
    assert st.receive(json.dumps({"type": "ready", "pty_id": "pty-1", "pid": 9})) is None
    assert (st.pty_id, st.pid, st.ended) == ("pty-1", 9, False)
    st.receive(json.dumps({"type": "exit", "exit_code": 2, "signal": None}))
    assert (st.ended, st.exit_code) == (True, 2)
    with pytest.raises(Conflict, match="closed"):
        st.receive(json.dumps({"type": "error", "code": "conflict", "message": "closed"}))
    with pytest.raises(ProtocolError):
        st.receive("not json")


def _transport(log: list[httpx.Request]) -> httpx.MockTransport:
    running = {**PROC, "state": "running", "exit_code": None, "ended_at": None}

    def handler(request: httpx.Request) -> httpx.Response:
        log.append(request)
        path = request.url.path
        if path == "/v1/sandboxes/sb-1/processes":
            return httpx.Response(200, json={"processes": [running]})
        if path == "/v1/sandboxes/sb-1/processes/42":
            if request.method == "DELETE":
                return httpx.Response(200, json={**PROC, "exit_code": None, "signal": 9})
            return httpx.Response(200, json=running)
        if path == "/v1/sandboxes/sb-1/processes/42/output":
            body = {
                "stdout": "hi\n",
                "stderr": "",
                "next_offset": 3,
                "dropped_bytes": 0,
                "process": PROC,
            }
            return httpx.Response(200, json=body)
        if path == "/v1/sandboxes/sb-1/processes/42/signal":
            message = "process 42 already exited with code 0"
            return httpx.Response(409, json={"error": {"code": "conflict", "message": message}})
        return httpx.Response(404, json={"error": {"code": "not_found", "message": path}})

    return httpx.MockTransport(handler)


def test_cli_ps_logs_kill() -> None:
    log: list[httpx.Request] = []
    env = CliEnv(api_key=KEY, transport=_transport(log))
    runner = CliRunner()
    r = runner.invoke(cli, ["ps", "sb-1", "--json"], obj=env)
    assert r.exit_code == 0, r.output
    assert [p["pid"] for p in json.loads(r.output)] == [42]
    r = runner.invoke(cli, ["ps", "sb-1"], obj=CliEnv(api_key=KEY, transport=_transport(log)))
    assert "42" in r.output and "running" in r.output and "/bin/sh -c echo hi" in r.output
    r = runner.invoke(
        cli, ["logs", "sb-1", "42"], obj=CliEnv(api_key=KEY, transport=_transport(log))
    )
    assert (r.exit_code, r.output) == (0, "hi\n")
    r = runner.invoke(
        cli, ["kill", "sb-1", "42"], obj=CliEnv(api_key=KEY, transport=_transport(log))
    )
    assert (r.exit_code, r.output) == (0, "42: killed (9)\n")
    r = runner.invoke(
        cli,
        ["kill", "sb-1", "42", "-s", "TERM"],
        obj=CliEnv(api_key=KEY, transport=_transport(log)),
    )
    assert r.exit_code == 1 and "already exited with code 0" in r.output


def test_sdk_process_handle_maps_errors() -> None:
    with Client(base_url="http://127.0.0.1:7070", api_key=KEY, transport=_transport([])) as c:
        p = Processes(c, "sb-1").get(42)
        assert p.info.running and p.output().stdout == "hi\n"
        assert not p.info.running  # refreshed from the answer
        with pytest.raises(Conflict, match="already exited"):
            p.signal(15)
        with pytest.raises(NotFound):
            Processes(c, "sb-1").get(7)


def test_agent_output_ring_bounds_merges_and_reads_by_offset() -> None:
    import sys
    from pathlib import Path

    agent_dir = Path(__file__).resolve().parents[2] / "guest_agent"
    sys.path.insert(0, str(agent_dir))
    try:
        from hutch_agent.ops_process import OutputRing
    finally:
        sys.path.remove(str(agent_dir))
    ring = OutputRing(10)
    for byte in b"abcd":
        ring.append(1, bytes([byte]))
    ring.append(2, b"EF")
    assert len(ring.chunks) == 2, "one-byte writes of a channel merge into one chunk"
    assert ring.read_from(0) == [(0, 1, b"abcd"), (4, 2, b"EF")]
    assert ring.read_from(5) == [(5, 2, b"F")]
    ring.append(1, b"ghijkl")
    assert (ring.start, ring.end) == (2, 12)
    assert ring.read_from(0) == [(2, 1, b"cd"), (4, 2, b"EF"), (6, 1, b"ghijkl")]
    ring.append(1, b"x" * 25)
    assert (ring.start, ring.end) == (27, 37)
    assert ring.read_from(3) == [(27, 1, b"x" * 10)]
