"""The real guest agent, run on the host with ``--listen-unix``, driven by the real client.

The agent runs as root on the real filesystem here, so every test touches only its own
temporary directory and runs harmless commands. In this mode the agent leaves the clock
and the entropy pool alone (it only does that as the VM's agent).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import hutch.guest.commands as commands_module
import hutch.guest.connection as connection_module
from hutch.errors import (
    AgentVersionMismatch,
    Conflict,
    GuestError,
    InvalidArgument,
    NotFound,
    Timeout,
)
from hutch.guest import AgentClient
from hutch.guest.client import GuestIdentity
from hutch.guest.protocol import MAGIC, Decoder, Frame, FrameType, encode_frame

AGENT = Path(__file__).resolve().parents[2] / "guest_agent" / "agent.py"


@dataclass
class LocalAgent:
    proc: subprocess.Popen[bytes]
    socket: Path
    log: Path

    def vm_hwm_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise AssertionError("no VmHWM in /proc/<pid>/status")


#: The signals a command must meet with their default action however the agent was started.
COMMAND_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM)


def _ignore_command_signals() -> None:
    for signum in COMMAND_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def _start_agent(workdir: Path, *, ignoring: bool = False) -> LocalAgent:
    """``ignoring``: start it as ``nohup`` or a background job of a script would, with
    :data:`COMMAND_SIGNALS` ignored."""
    sock = workdir / "agent.sock"  # short: sun_path holds 107 bytes
    log = workdir / "agent.log"
    with log.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-I", str(AGENT), "--listen-unix", str(sock)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            preexec_fn=_ignore_command_signals if ignoring else None,
        )
    return LocalAgent(proc, sock, log)


def _stop_agent(agent: LocalAgent) -> None:
    if agent.proc.poll() is None:
        agent.proc.kill()
    agent.proc.wait()


@contextlib.contextmanager
def _agent_in_tmp(*, ignoring: bool = False) -> Iterator[LocalAgent]:
    workdir = Path(tempfile.mkdtemp(prefix="hutch-agent-"))
    agent = _start_agent(workdir, ignoring=ignoring)
    try:
        yield agent
    finally:
        _stop_agent(agent)
        if agent.proc.returncode not in (0, -signal.SIGKILL):
            print(agent.log.read_text(errors="replace"))
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def shared_agent() -> Iterator[LocalAgent]:
    with _agent_in_tmp() as agent:
        yield agent


@pytest.fixture
def own_agent() -> Iterator[LocalAgent]:
    with _agent_in_tmp() as agent:
        yield agent


@pytest.fixture
async def client(shared_agent: LocalAgent) -> AsyncIterator[AgentClient]:
    c = await AgentClient.connect(shared_agent.socket, timeout_s=10)
    try:
        yield c
    finally:
        await c.close()
    assert shared_agent.proc.poll() is None, shared_agent.log.read_text(errors="replace")


@pytest.fixture
def work(tmp_path: Path) -> Path:
    return tmp_path


# -- handshake ------------------------------------------------------------------------
async def test_hello_reports_the_agent(client: AgentClient, shared_agent: LocalAgent) -> None:
    assert client.info.protocol == (1, 0)
    assert client.info.pid == shared_agent.proc.pid
    assert client.info.kernel_release == os.uname().release
    assert client.info.hostname == socket.gethostname()
    assert 0 < await client.ping() < 5


async def test_identity_takes_one_request_and_keeps_the_session(client: AgentClient) -> None:
    """A pool hand-out renames the guest with one ``identity`` request on the open
    connection: a stream already running on it goes on (a hello would reset it). Here,
    on the host, the agent applies nothing and answers the hostname it has."""
    running = await client.exec(["sh", "-c", "sleep 0.3; echo still here"])
    identity = GuestIdentity(hostname="renamed", machine_id="a" * 32, net=None)
    assert await client.take_identity(identity) == socket.gethostname()
    result = await running.collect()
    assert (result.exit_code, result.stdout) == (0, b"still here\n")


async def test_version_mismatch_is_refused(
    shared_agent: LocalAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection_module, "PROTOCOL_VERSION", (2, 0))
    with pytest.raises(AgentVersionMismatch) as info:
        await AgentClient.connect(shared_agent.socket, timeout_s=10)
    assert "1.0" in info.value.message and "2.0" in info.value.message


async def test_connect_times_out_when_nobody_listens(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(Timeout, match=r"did not answer within 0\.3"):
        await AgentClient.connect(tmp_path / "absent.sock", timeout_s=0.3)
    assert time.monotonic() - started < 2


async def test_connect_waits_for_a_late_agent(tmp_path: Path) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="hutch-agent-"))
    connect = asyncio.create_task(AgentClient.connect(workdir / "agent.sock", timeout_s=20))
    await asyncio.sleep(0.5)  # the socket does not exist yet, like a booting VM
    agent = _start_agent(workdir)
    try:
        c = await connect
        assert (await c.run(["true"])).exit_code == 0
        await c.close()
    finally:
        _stop_agent(agent)
        shutil.rmtree(workdir, ignore_errors=True)


# -- exec -----------------------------------------------------------------------------
async def test_exec_argv_env_cwd(client: AgentClient, work: Path) -> None:
    r = await client.run(
        ["sh", "-c", 'echo "$FOO|$LANG|$HOME"; pwd; echo oops >&2; exit 3'],
        env={"FOO": "bar baz"},
        cwd=str(work),
    )
    assert r.stdout.decode().splitlines() == ["bar baz|C.UTF-8|/root", str(work)]
    assert r.stderr == b"oops\n"
    assert (r.exit_code, r.signal, r.timed_out) == (3, None, False)


async def test_an_agent_started_ignoring_signals_gives_its_commands_the_defaults() -> None:
    """Started under ``nohup`` (SIGHUP, SIGINT, SIGQUIT, SIGTERM ignored), the agent once
    passed the ignoring on to every command (``execve`` keeps ``SIG_IGN``): a terminal's
    close then found its program deaf to SIGHUP and had to SIGKILL it. Its commands get
    the default actions; the agent itself still ignores them."""
    with _agent_in_tmp(ignoring=True) as agent:
        c = await AgentClient.connect(agent.socket, timeout_s=10)
        try:
            r = await c.run(["grep", "^SigIgn:", "/proc/self/status"])
            ignored = int(r.stdout.decode().split()[1], 16)
            assert [s for s in COMMAND_SIGNALS if ignored & (1 << (s - 1))] == []
            r = await c.run(shell="kill -HUP $$; echo survived")
            assert (r.signal, r.stdout) == (signal.SIGHUP, b"")
            for signum in COMMAND_SIGNALS:
                agent.proc.send_signal(signum)
            assert (await c.run(["echo", "agent still here"])).stdout == b"agent still here\n"
        finally:
            await c.close()
        assert agent.proc.poll() is None, agent.log.read_text(errors="replace")


async def test_exec_shell_and_default_cwd(client: AgentClient) -> None:
    r = await client.run(shell="pwd; echo $PATH")
    lines = r.stdout.decode().splitlines()
    assert lines[0] == "/root" and "/usr/bin" in lines[1] and r.exit_code == 0


async def test_exec_stdin_bytes_iterable_and_none(client: AgentClient) -> None:
    r = await client.run(["cat"], stdin=b"hello\x00world")
    assert r.stdout == b"hello\x00world"

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(50):
            yield f"line {i}\n".encode() * 1000

    r = await client.run(["sha256sum"], stdin=chunks())
    expected = hashlib.sha256(b"".join(f"line {i}\n".encode() * 1000 for i in range(50)))
    assert r.stdout.split()[0].decode() == expected.hexdigest()
    r = await client.run(["cat"], timeout_s=10)  # no stdin: /dev/null, so cat ends at once
    assert (r.stdout, r.exit_code) == (b"", 0)


async def test_exec_command_not_found(client: AgentClient) -> None:
    with pytest.raises(InvalidArgument, match="command not found in the sandbox: 'nosuchcmd'"):
        await client.exec(["nosuchcmd", "--flag"])


async def test_exec_missing_cwd_and_unknown_user(client: AgentClient, work: Path) -> None:
    with pytest.raises(NotFound, match="does not exist"):
        await client.exec(["true"], cwd=str(work / "missing"))
    with pytest.raises(InvalidArgument, match="no-such-user"):
        await client.exec(["true"], user="no-such-user")


async def test_exec_as_another_user(client: AgentClient, work: Path) -> None:
    r = await client.run(["id", "-u"], user="nobody", cwd="/")
    assert r.stdout.strip() == b"65534"


async def test_exec_timeout_kills_the_process_group(client: AgentClient, work: Path) -> None:
    pidfile = work / "bg.pid"
    r = await client.run(shell=f"sleep 60 & echo $! > {pidfile}; sleep 60", timeout_s=0.5)
    assert r.timed_out and r.signal == signal.SIGKILL and r.exit_code is None
    assert 400 <= r.duration_ms < 5000
    background = int(pidfile.read_text())
    for _ in range(50):  # the background sleep was in the group: it must be gone
        if _is_gone(background):
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail(f"background process {background} survived the timeout")


def _is_gone(pid: int) -> bool:
    """No such process, or only a zombie waiting for its reaper."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (OSError, IndexError):
        return True


async def test_exec_signal(client: AgentClient) -> None:
    stream = await client.exec(["sleep", "60"])
    assert stream.pid > 0
    await stream.signal(signal.SIGTERM)
    exit_ = await stream.wait()
    assert exit_.signal == signal.SIGTERM and exit_.exit_code is None and not exit_.timed_out
    with pytest.raises(NotFound):
        await stream.signal(signal.SIGTERM)


@pytest.mark.slow
async def test_output_streams_as_produced(client: AgentClient) -> None:
    started = time.monotonic()
    stream = await client.exec(shell="for i in 1 2 3; do echo $i; sleep 1; done")
    arrivals: list[tuple[float, bytes]] = []
    async for out in stream:
        arrivals.append((time.monotonic() - started, out.data))
    exit_ = await stream.wait()
    assert b"".join(d for _, d in arrivals) == b"1\n2\n3\n"
    assert exit_.exit_code == 0 and exit_.duration_ms >= 2900
    assert len(arrivals) == 3
    # Each line arrives about when it is printed, not all at the end.
    assert arrivals[0][0] < 1.0
    assert 0.7 < arrivals[1][0] - arrivals[0][0] < 1.5
    assert 0.7 < arrivals[2][0] - arrivals[1][0] < 1.5


async def test_200_concurrent_execs(client: AgentClient) -> None:
    results = await asyncio.gather(
        *(client.run(["sh", "-c", 'echo "$0"; echo "e$0" >&2', str(i)]) for i in range(200))
    )
    for i, r in enumerate(results):
        assert (r.stdout, r.stderr, r.exit_code) == (f"{i}\n".encode(), f"e{i}\n".encode(), 0)


async def test_concurrent_streams_do_not_block_each_other(client: AgentClient) -> None:
    # A stream nobody reads fills its window; others must still flow.
    stuck = await client.exec(shell="yes | head -c 50000000")
    for _ in range(5):
        assert (await client.run(["echo", "ok"])).stdout == b"ok\n"
    await stuck.kill()
    assert (await stuck.wait()).signal is not None


# -- files ----------------------------------------------------------------------------
async def test_file_operations(client: AgentClient, work: Path) -> None:
    target = work / "a" / "b" / "f.txt"
    entry = await client.write_file(str(target), b"content", mode=0o600)
    assert (entry.name, entry.type, entry.size, entry.mode) == ("f.txt", "file", 7, 0o600)
    assert target.read_bytes() == b"content"
    assert abs(entry.mtime - time.time()) < 60
    assert b"".join([c async for c in client.read_file(str(target))]) == b"content"
    d = await client.mkdir(str(work / "a" / "c" / "d"))
    assert d.type == "dir" and (work / "a/c/d").is_dir()
    assert (await client.mkdir(str(work / "a" / "c" / "d"))).type == "dir"  # idempotent
    os.symlink("b/f.txt", work / "a" / "link")
    names = {(e.name, e.type) for e in await client.list_dir(str(work / "a"))}
    assert names == {("b", "dir"), ("c", "dir"), ("link", "symlink")}
    assert (await client.stat(str(work / "a" / "b"))).type == "dir"
    moved = await client.rename(str(target), str(work / "a" / "g.txt"))
    assert moved.path == str(work / "a" / "g.txt") and not target.exists()
    with pytest.raises(Conflict, match="not empty"):
        await client.remove(str(work / "a"))
    await client.remove(str(work / "a" / "g.txt"))
    await client.remove(str(work / "a"), recursive=True)
    assert not (work / "a").exists()


async def test_file_errors(client: AgentClient, work: Path) -> None:
    with pytest.raises(NotFound):
        await client.stat(str(work / "missing"))
    with pytest.raises(NotFound):
        async for _ in client.read_file(str(work / "missing")):
            pass
    with pytest.raises(InvalidArgument, match="directory"):
        async for _ in client.read_file(str(work)):
            pass
    (work / "file").write_text("x")
    with pytest.raises(InvalidArgument):
        await client.list_dir(str(work / "file"))
    with pytest.raises(Conflict):
        await client.mkdir(str(work / "file"))
    with pytest.raises(InvalidArgument):
        await client.write_file(str(work / "file" / "under"), b"x")
    with pytest.raises(InvalidArgument, match="/proc"):
        await client.stat("/proc/self/status")
    # A symlink into /proc is refused by the agent itself.
    os.symlink("/proc/self/status", work / "sneaky")
    with pytest.raises(InvalidArgument, match="/proc"):
        async for _ in client.read_file(str(work / "sneaky")):
            pass


async def test_failed_upload_leaves_no_partial_file(
    client: AgentClient, work: Path, shared_agent: LocalAgent
) -> None:
    target = work / "kept.txt"
    target.write_bytes(b"original")

    def temp_files() -> list[str]:
        return [n for n in os.listdir(work) if n.startswith(".hutch-upload-")]

    async def broken() -> AsyncIterator[bytes]:
        yield b"x" * 200_000
        # Fail only once the agent is inside the write (its temp file exists): checking
        # for leftovers earlier can race the agent's own start and see a file it makes
        # a moment later (the intermittent failure this test used to have).
        for _ in range(1500):
            if temp_files():
                break
            await asyncio.sleep(0.02)
        assert temp_files(), ("the agent never started the upload", os.listdir(work))
        raise RuntimeError("upload source failed")

    with pytest.raises(RuntimeError, match="upload source failed"):
        await client.write_file(str(target), broken())
    for _ in range(1500):  # the agent removes its temp file when it sees the CANCEL
        if not temp_files():
            break
        await asyncio.sleep(0.02)
    left = os.listdir(work)
    assert left == ["kept.txt"], (left, shared_agent.log.read_text(errors="replace")[-4000:])
    assert target.read_bytes() == b"original"


async def test_reading_part_of_a_file_then_stopping(client: AgentClient, work: Path) -> None:
    big = work / "big"
    big.write_bytes(os.urandom(5 << 20))
    async for chunk in client.read_file(str(big)):
        assert chunk
        break
    assert (await client.run(["echo", "still fine"])).stdout == b"still fine\n"


@pytest.mark.slow
async def test_100_mib_round_trip_with_bounded_memory(own_agent: LocalAgent, work: Path) -> None:
    size, piece = 100 << 20, 1 << 20
    block = os.urandom(piece)
    sent = hashlib.sha256()

    async def source() -> AsyncIterator[bytes]:
        for i in range(size // piece):
            data = i.to_bytes(8, "big") + block[8:]
            sent.update(data)
            yield data

    c = await AgentClient.connect(own_agent.socket, timeout_s=10)
    try:
        target = work / "big.bin"
        entry = await c.write_file(str(target), source())
        assert entry.size == size
        assert hashlib.sha256(target.read_bytes()).hexdigest() == sent.hexdigest()
        received = hashlib.sha256()
        total = 0
        async for chunk in c.read_file(str(target)):
            received.update(chunk)
            total += len(chunk)
        assert total == size and received.hexdigest() == sent.hexdigest()
    finally:
        await c.close()
    # Streaming, not buffering: the agent's peak RSS stays far below the file size.
    hwm = own_agent.vm_hwm_kib()
    print(f"agent VmHWM after 2 x 100 MiB: {hwm} KiB")
    assert hwm < 50 * 1024


# -- connection -----------------------------------------------------------------------
async def test_reconnect_after_dropping_mid_stream(own_agent: LocalAgent) -> None:
    c = await AgentClient.connect(own_agent.socket, timeout_s=10)
    stream = await c.exec(shell="while true; do echo tick; sleep 0.05; done", timeout_s=30)
    async for _ in stream:
        break
    await c.close()
    assert c.closed
    with pytest.raises(GuestError, match="connection closed"):
        await stream.wait()
    c2 = await AgentClient.connect(own_agent.socket, timeout_s=10)
    try:
        assert (await c2.run(["echo", "again"])).stdout == b"again\n"
    finally:
        await c2.close()
    assert own_agent.proc.poll() is None


async def test_agent_death_fails_pending_calls(own_agent: LocalAgent) -> None:
    c = await AgentClient.connect(own_agent.socket, timeout_s=10)
    try:
        stream = await c.exec(["sleep", "30"])
        pending = asyncio.create_task(stream.wait())
        await asyncio.sleep(0.1)
        own_agent.proc.kill()
        with pytest.raises(GuestError, match="the VM may have stopped"):
            await asyncio.wait_for(pending, 5)
        await asyncio.wait_for(c.wait_closed(), 5)
        with pytest.raises(GuestError, match="connection closed"):
            await c.ping()
    finally:
        await c.close()


async def test_a_command_the_agent_never_reports_ends_with_a_timeout_on_the_host(
    own_agent: LocalAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent stopped (SIGSTOP: a stalled or hostile guest) after a command with a
    timeout started: past ``timeout_s`` + the host's grace the call ends with Timeout
    naming why, instead of waiting for ever; the agent, continued, still serves and
    the command is gone."""
    monkeypatch.setattr(commands_module, "HOST_GRACE_S", 0.5)
    c = await AgentClient.connect(own_agent.socket, timeout_s=10)
    try:
        stream = await c.exec(["sleep", "30"], timeout_s=0.5)
        os.kill(own_agent.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(
                Timeout,
                match=r"did not report the end of a command \(timeout_s=0\.5\) within 0\.5 s",
            ):
                await asyncio.wait_for(stream.wait(), 10)
            assert time.monotonic() - t0 < 5
        finally:
            os.kill(own_agent.proc.pid, signal.SIGCONT)
        assert (await c.run(["echo", "ok"], timeout_s=5)).stdout == b"ok\n"
        # Not answering the start is bounded the same way.
        os.kill(own_agent.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(Timeout, match="did not report the start of a command"):
                await asyncio.wait_for(c.exec(["true"], timeout_s=0.5), 10)
        finally:
            os.kill(own_agent.proc.pid, signal.SIGCONT)
        assert (await c.run(["echo", "again"], timeout_s=5)).stdout == b"again\n"
        assert not _children_named(own_agent.proc.pid, "sleep")
    finally:
        await c.close()


def _children_named(pid: int, name: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                comm, rest = stat.split("(", 1)[1].split(") ", 1)
                if comm == name and int(rest.split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def _raw_frame(ftype: int, stream: int, head: bytes, payload_len: int) -> bytes:
    """A frame header with a valid CRC but whatever lengths we like."""
    prefix = struct.pack(">4sBBHIII", MAGIC, ftype, 0, 0, stream, len(head), payload_len)
    return prefix + struct.pack(">I", zlib.crc32(prefix)) + head


async def test_bad_frames_do_not_kill_the_agent(own_agent: LocalAgent) -> None:
    for _ in range(100):
        if own_agent.socket.exists():
            break
        await asyncio.sleep(0.05)
    reader, writer = await asyncio.open_unix_connection(str(own_agent.socket))
    decoder = Decoder()
    try:
        writer.write(os.urandom(5000))  # garbage first: the agent must resync
        writer.write(_raw_frame(FrameType.REQUEST, 12, b"", 5 << 20))  # oversize
        writer.write(_raw_frame(FrameType.REQUEST, 13, b"{nope", 0))  # header not JSON
        for sid, header in [
            (14, {"op": "format-disk"}),
            (15, {"op": "read", "path": "/dev/zero"}),  # the agent enforces the path policy
            (16, {"op": "exec", "argv": "ls"}),
            (17, {"op": "ping"}),
        ]:
            writer.write(encode_frame(Frame(FrameType.REQUEST, sid, header)))
        await writer.drain()
        seen: dict[int, Frame] = {}
        async with asyncio.timeout(10):
            # Wait for every answer: streams are independent, so exec's ERROR (from its
            # worker thread) may come after ping's END (answered inline).
            while not {12, 13, 14, 15, 16, 17} <= seen.keys():
                data = await reader.read(65536)
                assert data, "the agent closed the connection"
                seen.update({f.stream: f for f in decoder.feed(data)})
        for sid in (12, 13, 14, 15, 16):
            assert seen[sid].type is FrameType.ERROR, (sid, seen.get(sid))
            expected = "unknown_operation" if sid == 14 else "invalid_argument"
            assert seen[sid].header["code"] == expected, (sid, seen[sid].header)
        assert seen[17].type is FrameType.END
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    c = await AgentClient.connect(own_agent.socket, timeout_s=10)
    try:
        assert (await c.run(["echo", "alive"])).stdout == b"alive\n"
    finally:
        await c.close()
    assert own_agent.proc.poll() is None
