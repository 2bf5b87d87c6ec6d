"""Issue 17, items 3, 4 and 7, against the real daemon and real VMs (one daemon, one
sandbox and its fork child for the whole module, to keep boots few):

- calls in flight (a collected exec, a streamed exec, a download) across pause, snapshot
  and fork get their whole answer; a call outlasting the wait makes the lifecycle call
  fail with 409 busy naming it; a delete cuts streams with errors the SDK raises;
- after terminal sessions authenticated by header, by first message, by ``?token=`` and
  with wrong and foreign keys, no key is anywhere in the state dir or the daemon's
  stderr; a key with a trailing space is refused;
- a guest writing megabytes to its serial console leaves at most twice the cap on disk,
  also across a daemon that is down meanwhile, and the console tail still reaches the
  failure message.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from hutch.errors import Busy, GuestError, HutchError, InvalidArgument, StateError
from hutch.images.build import ImageArtifacts
from hutch.sdk import Client, DaemonUnreachable, ExecExit, ExecOutput, Sandbox
from tests.e2e.conftest import _LIVE, Daemon, finalize_daemon, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.vm, pytest.mark.timeout(900)]

WAIT_S = 8
CONSOLE_CAP = 256 * 1024
BIG_MIB = 24


@pytest.fixture(scope="module")
def daemon(
    base_image: ImageArtifacts, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("inflight") / "state")
    d.daemon_env.update(
        {
            # Fork and snapshot need no template; without it no second boot competes
            # for the two CPUs.
            "HUTCH_TEMPLATES": "0",
            "HUTCH_LIFECYCLE_WAIT_S": str(WAIT_S),
            "HUTCH_CONSOLE_LOG_BYTES": str(CONSOLE_CAP),
        }
    )
    _LIVE.append(d)
    d.start()
    yield d
    problems = finalize_daemon(d)
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[Client]:
    with daemon.client(timeout=120.0) as c:
        yield c


@pytest.fixture(scope="module")
def sandbox(client: Client) -> Sandbox:
    return Sandbox.create(memory_mib=256, client=client, metadata={"test": "inflight"})


@pytest.fixture(scope="module")
def big_sha(sandbox: Sandbox) -> str:
    """/root/big in the sandbox: random bytes a download takes a while to move."""
    result = sandbox.exec(f"head -c {BIG_MIB}M /dev/urandom > /root/big && sha256sum /root/big")
    assert result.exit_code == 0, result
    return result.stdout.split()[0]


def running(sb: Sandbox) -> Sandbox:
    """``sb``, resumed if a failed test before left it paused (no cascade of failures)."""
    if sb.refresh().state == "paused":
        sb.resume()
    return sb


#: Made by the collected exec's command as it starts (removed before each start).
COLLECTED_STARTED = "/tmp/collected.started"


class Calls:
    """A collected exec, a streamed exec and a slowly read download, in threads, held in
    flight on one sandbox; :meth:`results` joins them (each an answer or the error)."""

    def __init__(self, sb: Sandbox) -> None:
        self.sb = sb
        self._results: dict[str, Any] = {}
        self._streaming = threading.Event()
        self._downloading = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(name, fn), daemon=True)
            for name, fn in (
                ("collected", self._collected),
                ("streamed", self._streamed),
                ("download", self._download),
            )
        ]

    def _run(self, name: str, fn: Callable[[], Any]) -> None:
        try:
            self._results[name] = fn()
        except BaseException as exc:  # reported by results()
            self._results[name] = exc
        finally:
            self._streaming.set()
            self._downloading.set()

    def _collected(self) -> Any:
        return self.sb.exec(f"touch {COLLECTED_STARTED}; sleep 3; echo collected")

    def _streamed(self) -> list[Any]:
        events = []
        with self.sb.exec_stream("for i in 1 2 3 4 5 6; do echo tick $i; sleep 0.5; done") as s:
            for event in s:
                events.append(event)
                self._streaming.set()
        return events

    def _download(self) -> str:
        digest = hashlib.sha256()
        with self.sb.files.read_stream("/root/big") as chunks:
            for chunk in chunks:
                digest.update(chunk)
                self._downloading.set()
                time.sleep(0.005)  # a slow reader keeps the download in flight
        return digest.hexdigest()

    def start(self) -> None:
        self.sb.exec(f"rm -f {COLLECTED_STARTED}")
        for t in self._threads:
            t.start()
        assert self._streaming.wait(60) and self._downloading.wait(60)
        # The collected exec shows nothing until it ends: it is in flight once its
        # command runs in the guest (a sleep standing for that raced on a busy host).
        assert wait_for(lambda: self.sb.exec(f"test -e {COLLECTED_STARTED}").exit_code == 0, 60), (
            "the collected exec never started"
        )

    def results(self) -> dict[str, Any]:
        for t in self._threads:
            t.join(180)
            assert not t.is_alive(), "a call hung"
        return self._results


def check_whole(results: dict[str, Any], big_sha: str) -> None:
    failed: dict[str, object] = {n: v for n, v in results.items() if isinstance(v, BaseException)}
    if "download" not in failed and results["download"] != big_sha:
        failed["download"] = "a different file: the download was cut short without an error"
    assert not failed, f"calls in flight did not get their whole answer: {failed!r}"
    assert results["collected"].exit_code == 0
    assert results["collected"].stdout == "collected\n"
    events = results["streamed"]
    assert [e.data for e in events if isinstance(e, ExecOutput)] == [
        f"tick {i}\n" for i in range(1, 7)
    ]
    assert isinstance(events[-1], ExecExit) and events[-1].exit_code == 0
    assert results["download"] == big_sha


@pytest.mark.parametrize("op", ["pause", "snapshot", "fork"])
def test_calls_in_flight_get_their_whole_answer_across(
    sandbox: Sandbox, big_sha: str, op: str
) -> None:
    calls = Calls(running(sandbox))
    calls.start()
    if op == "pause":
        assert sandbox.pause().state == "paused"
    elif op == "snapshot":
        snap = sandbox.snapshot("mid-flight")
        assert snap.sandbox_id == sandbox.id
    else:
        (child,) = sandbox.fork(count=1)
        # The child is a copy of the parent at the fork: it has the file too.
        assert child.exec("sha256sum /root/big").stdout.split()[0] == big_sha
    check_whole(calls.results(), big_sha)
    if op == "pause":
        sandbox.resume()
    assert sandbox.exec("echo alive").stdout == "alive\n"


@pytest.fixture(scope="module")
def child(client: Client, sandbox: Sandbox) -> Sandbox:
    for info in client.list_sandboxes():
        if info.parent_id == sandbox.id and info.state == "running":
            return Sandbox.connect(info.id, client=client)
    pytest.fail("test_calls_in_flight_get_their_whole_answer_across[fork] left no child")


def test_a_call_outlasting_the_wait_makes_it_busy_and_is_not_cut(child: Sandbox) -> None:
    running(child)
    with child.exec_stream("echo up; sleep 600") as events:
        first = next(iter(events))
        assert isinstance(first, ExecOutput) and first.data == "up\n"
        started = time.monotonic()
        with pytest.raises(Busy) as caught:
            child.pause()
        assert time.monotonic() - started >= WAIT_S - 0.5
        assert "exec 'echo up; sleep 600' (running" in caught.value.message
        assert f"waited {WAIT_S} s" in caught.value.message
        assert child.refresh().state == "running"
        assert child.exec("echo still").stdout == "still\n"


def test_delete_cuts_streams_with_errors_the_sdk_raises(client: Client, child: Sandbox) -> None:
    running(child)
    outcomes: dict[str, Any] = {}
    streaming, downloading = threading.Event(), threading.Event()

    def streamed() -> None:
        try:
            with child.exec_stream("echo a; sleep 600") as events:
                for _ in events:
                    streaming.set()
            outcomes["streamed"] = "ended without an error"
        except HutchError as exc:
            outcomes["streamed"] = exc
        streaming.set()

    def download() -> None:
        got = 0
        try:
            with child.files.read_stream("/root/big") as chunks:
                for chunk in chunks:
                    got += len(chunk)
                    downloading.set()
                    time.sleep(0.05)
            outcomes["download"] = f"ended cleanly after {got} bytes"
        except HutchError as exc:
            outcomes["download"] = exc
        downloading.set()

    threads = [threading.Thread(target=f, daemon=True) for f in (streamed, download)]
    for t in threads:
        t.start()
    assert streaming.wait(60) and downloading.wait(60)
    client.delete_sandbox(child.id)
    for t in threads:
        t.join(60)
    streamed_error, download_error = outcomes["streamed"], outcomes["download"]
    assert isinstance(streamed_error, GuestError), streamed_error
    assert f"sandbox {child.id} was deleted while this call ran" in streamed_error.message
    assert isinstance(download_error, DaemonUnreachable), download_error
    assert "broke off before it was complete" in download_error.message


# -- item 4: the API key never reaches a log --------------------------------------------


def _ws_url(daemon: Daemon, sandbox_id: str, **query: str) -> str:
    params = httpx.QueryParams({"cmd": "cat", **query})
    return f"ws://127.0.0.1:{daemon.port}/v1/sandboxes/{sandbox_id}/pty?{params}"


def _session(url: str, headers: dict[str, str] | None, first: str | None) -> dict[str, Any]:
    """One WebSocket session; the control frames it got and how it closed."""
    frames: list[dict[str, Any]] = []
    with connect(url, additional_headers=headers or {}, open_timeout=30) as ws:
        try:
            if first is not None:
                ws.send(first)
            while True:
                message = ws.recv(30)
                if isinstance(message, str):
                    frames.append(json.loads(message))
                    if frames[-1]["type"] == "ready":
                        ws.send(b"typed-line\n")
                        ws.send(json.dumps({"type": "close"}))
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd else None
    return {"frames": frames, "code": code}


def test_no_key_in_any_log_after_websocket_sessions(daemon: Daemon, sandbox: Sandbox) -> None:
    right = daemon.api_key
    wrong = right[:-4] + ("AAAA" if not right.endswith("AAAA") else "BBBB")
    foreign = "hk_" + secrets.token_urlsafe(32)  # another daemon's key
    bearer = {"Authorization": f"Bearer {right}"}
    running(sandbox)

    # The SDK and the CLI send the header.
    term = sandbox.pty.open(cmd="cat")
    term.send("via-sdk\n")
    term.read_until("via-sdk", 30)
    term.kill()
    term.detach()
    # A browser sends the key as the first message.
    ok = _session(_ws_url(daemon, sandbox.id), None, json.dumps({"type": "auth", "token": right}))
    refused = [
        _session(_ws_url(daemon, sandbox.id), None, json.dumps({"type": "auth", "token": k}))
        for k in (wrong, foreign, right + " ", right + "\t")
    ]
    refused += [
        _session(_ws_url(daemon, sandbox.id, token=k), None, None) for k in (right, wrong, foreign)
    ]
    refused.append(_session(_ws_url(daemon, sandbox.id, token=right), bearer, None))
    refused += [
        _session(_ws_url(daemon, sandbox.id), {"Authorization": f"Bearer {k}"}, None)
        for k in (wrong, foreign)
    ]
    # REST: a key in the query string is no key; wrong and foreign ones are refused.
    rest = []
    for key in (right, wrong, foreign):
        r = httpx.get(f"{daemon.url}/v1/sandboxes", params={"token": key, "api_key": key})
        rest.append(r.status_code)
        r = httpx.get(f"{daemon.url}/v1/sandboxes", headers={"Authorization": f"Bearer {key}x"})
        rest.append(r.status_code)

    # Every file of the state dir (logs, the daemon's stderr, the database, sandbox and
    # snapshot files) but the key file itself; FIFOs and sockets are skipped.
    leaks = []
    for name, key in (("right", right), ("wrong", wrong), ("foreign", foreign)):
        found = subprocess.run(
            ["grep", "-r", "-l", "-F", "-a", "-D", "skip", "--exclude=api-key", "-e", key],
            cwd=daemon.state_dir,
            capture_output=True,
            text=True,
            check=False,
        )
        assert found.returncode in (0, 1), found.stderr
        leaks += [f"the {name} key is in {f}" for f in found.stdout.split()]
    assert not leaks, "\n".join(leaks)
    # The sessions were logged, with their queries redacted.
    assert "/pty?[redacted]" in daemon.log_path.read_text()
    assert ok["frames"][0]["type"] == "ready" and ok["frames"][-1]["type"] == "exit", ok
    for session in refused:
        assert session["code"] == 4401, session
        assert session["frames"][-1]["code"] == "unauthorized", session
    assert rest == [401] * 6


def test_a_key_with_a_trailing_space_is_refused(daemon: Daemon) -> None:
    right = daemon.api_key
    with pytest.raises(InvalidArgument, match="starts or ends with whitespace"):
        Client(base_url=daemon.url, api_key=right + " ")
    result = daemon.cli("ls", "--json")
    assert result.returncode == 0, result.stderr
    bad_env = {**daemon.env, "HUTCH_API_KEY": right + "\t"}
    result = subprocess.run(
        [sys.executable, "-m", "hutch", "ls"],
        env=bad_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "whitespace" in result.stderr
    # On the wire: "Bearer", one space, the key; an extra space is part of what was sent.
    for header in (f"Bearer  {right}", f"Bearer {right} x", f"Bearer \t{right}"):
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as s:
            s.sendall(
                f"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: {header}\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            status = s.recv(100).split(b"\r\n", 1)[0]
        assert status == b"HTTP/1.1 401 Unauthorized", (header, status)


# -- item 7: the serial console stays bounded -------------------------------------------


def _console_files(daemon: Daemon, sandbox_id: str) -> dict[str, int]:
    d = daemon.sandboxes_dir / sandbox_id
    return {p.name: p.stat().st_size for p in d.glob("console.log*")}


def _console_text(daemon: Daemon, sandbox_id: str) -> str:
    d = daemon.sandboxes_dir / sandbox_id
    return "".join(
        (d / name).read_text(errors="replace")
        for name in ("console.log.1", "console.log")
        if (d / name).exists()
    )


def _console_pipe_held(daemon: Daemon, sandbox_id: str) -> tuple[int, int]:
    """(bytes waiting in the sandbox's console pipe, the pipe's capacity), read from the
    FIFO without draining it (FIONREAD; QEMU holds it open read-write, so opening and
    closing a read end here changes nothing for it)."""
    fd = os.open(daemon.sandboxes_dir / sandbox_id / "console.out", os.O_RDONLY | os.O_NONBLOCK)
    try:
        held = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
        return held, fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
    finally:
        os.close(fd)


def test_console_log_stays_bounded_even_while_the_daemon_is_down(
    daemon: Daemon, client: Client, sandbox: Sandbox
) -> None:
    """The sizes are as small as still prove it (serial output under TCG costs about
    2 s per MiB): the first write is over ten times the cap, the one while the daemon is
    down more than the console pipe holds (so the guest's writer has to wait) and more
    than twice the cap (so the drain after the restart rotates the log again)."""
    # ~2.7 MiB of base64 through the serial port (the kernel console is ttyS0).
    result = running(sandbox).exec(
        "head -c 2M /dev/urandom | base64 > /dev/ttyS0; echo MARK-ONE > /dev/console",
        timeout_s=300,
    )
    assert result.exit_code == 0, result
    assert wait_for(lambda: "MARK-ONE" in _console_text(daemon, sandbox.id), 30)
    sizes = _console_files(daemon, sandbox.id)
    assert sizes["console.log.1"] == CONSOLE_CAP and sizes["console.log"] <= CONSOLE_CAP, sizes

    # The guest keeps writing while no daemon drains its console: QEMU's pipe holds up
    # to 1 MiB, then the writer waits; nothing lands on disk meanwhile. Waited for by
    # the pipe filling up (the writer is then blocked), not by a fixed sleep.
    sandbox.processes.start(
        "sleep 2; head -c 1536K /dev/urandom | base64 > /dev/ttyS0; echo MARK-TWO > /dev/ttyS0"
    )
    daemon.kill9()
    before = _console_files(daemon, sandbox.id)

    def pipe_full() -> bool:
        held, capacity = _console_pipe_held(daemon, sandbox.id)
        return held >= capacity - 4096

    assert wait_for(pipe_full, 120, 0.2), _console_pipe_held(daemon, sandbox.id)
    assert _console_files(daemon, sandbox.id) == before
    assert "MARK-TWO" not in _console_text(daemon, sandbox.id)
    daemon.start()  # adopts the VM and drains what waited
    assert wait_for(lambda: "MARK-TWO" in _console_text(daemon, sandbox.id), 120)
    sizes = _console_files(daemon, sandbox.id)
    assert sum(sizes.values()) <= 2 * CONSOLE_CAP, sizes
    assert sandbox.exec("echo back").stdout == "back\n"

    # The failure message still ends with the guest's last console output.
    sandbox.exec("echo LAST-WORDS-ON-THE-CONSOLE > /dev/ttyS0")
    assert wait_for(lambda: "LAST-WORDS" in _console_text(daemon, sandbox.id), 30)
    os.kill(daemon.qemu_pid_of(sandbox.id), signal.SIGKILL)
    assert wait_for(lambda: sandbox.refresh().state == "failed", 60, 0.5)
    tail_logged = daemon.log_path.read_text().rsplit("stopped on its own; console tail:", 1)
    assert len(tail_logged) == 2 and "LAST-WORDS-ON-THE-CONSOLE" in tail_logged[1][:4000]
    with pytest.raises(StateError):
        sandbox.exec("true")
