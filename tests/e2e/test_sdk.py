"""The Python SDK (sync and async) against a real daemon and real VMs, as in the README."""

from __future__ import annotations

import secrets
import time

import pytest

from hutch import errors
from hutch.sdk import AsyncSandbox, ExecExit, ExecOutput, Sandbox
from tests.e2e.conftest import Daemon, pid_alive, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.vm]

STREAM_SCRIPT = "echo first; sleep 2; echo second; echo oops >&2; sleep 1"


def test_sync_sandbox_lifecycle(daemon: Daemon) -> None:
    tag = secrets.token_hex(4)
    with daemon.client() as client:
        with Sandbox.create(
            memory_mib=256, metadata={"suite": f"sdk-{tag}"}, env={"A": "1"}, client=client
        ) as sb:
            assert sb.info.state == "running"
            pid = daemon.qemu_pid_of(sb.id)

            r = sb.exec("python3 -c 'print(6 * 7)'")
            assert (r.exit_code, r.stdout, r.stderr) == (0, "42\n", "")
            r = sb.exec(["sh", "-c", 'echo "$A$B" >&2; exit 3'], env={"B": "2"})
            assert (r.exit_code, r.stdout, r.stderr) == (3, "", "12\n")
            r = sb.exec(["cat"], stdin="piped in")
            assert r.stdout == "piped in"

            # Callbacks get output while the command runs, not after it.
            started = time.monotonic()
            seen: list[tuple[float, str, str]] = []
            r = sb.exec(
                ["sh", "-c", STREAM_SCRIPT],
                on_stdout=lambda s: seen.append((time.monotonic() - started, "out", s)),
                on_stderr=lambda s: seen.append((time.monotonic() - started, "err", s)),
            )
            ended = time.monotonic() - started
            assert r.exit_code == 0
            assert "".join(s for _, k, s in seen if k == "out") == "first\nsecond\n"
            assert "".join(s for _, k, s in seen if k == "err") == "oops\n"
            first_at = next(t for t, _, s in seen if "first" in s)
            assert ended - first_at > 2.0, seen

            events = list(sb.exec_stream("echo a; echo b >&2; exit 4"))
            assert isinstance(events[-1], ExecExit) and events[-1].exit_code == 4
            outputs = [e for e in events if isinstance(e, ExecOutput)]
            assert {(e.stream, e.data) for e in outputs} == {("stdout", "a\n"), ("stderr", "b\n")}

            # Files: write, read, list, stat, mkdir, rename, remove.
            payload = bytes(range(256)) * 4096  # 1 MiB, every byte value
            written = sb.files.write("/root/data.bin", payload, mode=0o600)
            assert (written.path, written.size) == ("/root/data.bin", len(payload))
            assert sb.files.read("/root/data.bin") == payload
            assert sb.files.stat("/root/data.bin").mode == 0o600
            sb.files.write("notes.txt", "relative to home")
            assert sb.exec("cat /root/notes.txt").stdout == "relative to home"
            sb.files.mkdir("/root/d/e")
            sb.files.rename("/root/notes.txt", "/root/d/e/notes.txt")
            listing = {e.name: e for e in sb.files.list("/root")}
            assert listing["data.bin"].type == "file" and listing["data.bin"].size == len(payload)
            assert listing["d"].is_dir and "notes.txt" not in listing
            assert [e.name for e in sb.files.list("/root/d/e")] == ["notes.txt"]
            sb.files.remove("/root/data.bin")
            with pytest.raises(errors.NotFound):
                sb.files.read("/root/data.bin")
            with pytest.raises(errors.Conflict):
                sb.files.remove("/root/d")  # not empty
            sb.files.remove("/root/d", recursive=True)
            assert sb.exec("ls /root").stdout == ""

            # list with a metadata filter finds it (and only it).
            found = Sandbox.list(metadata={"suite": f"sdk-{tag}"}, client=client)
            assert [s.id for s in found] == [sb.id]
            assert Sandbox.list(metadata={"suite": f"sdk-{tag}-x"}, client=client) == []

            # connect() attaches a second handle to the same VM.
            again = Sandbox.connect(sb.id, client=client)
            assert again.exec("hostname").stdout.strip() == sb.id
        # Leaving the block killed it; a second kill is not an error.
        sb.kill()
        info = client.get_sandbox(sb.id)
        assert info.state == "destroyed" and info.ended_at is not None
        assert wait_for(lambda: not pid_alive(pid), 10), "QEMU still runs after kill()"
        assert sb.id not in daemon.sandbox_dirs()
        assert Sandbox.list(metadata={"suite": f"sdk-{tag}"}, client=client) == []
        with pytest.raises(errors.StateError):
            sb.exec("true")


async def test_async_sandbox_lifecycle(daemon: Daemon) -> None:
    tag = secrets.token_hex(4)
    kw = {"base_url": daemon.url, "api_key": daemon.api_key}
    async with await AsyncSandbox.create(
        memory_mib=256,
        metadata={"suite": f"asdk-{tag}"},
        **kw,  # type: ignore[arg-type]
    ) as sb:
        pid = daemon.qemu_pid_of(sb.id)
        r = await sb.exec("uname -s")
        assert r.stdout == "Linux\n"

        started = time.monotonic()
        firsts: list[float] = []

        async def on_stdout(chunk: str) -> None:  # coroutine callbacks are awaited
            firsts.append(time.monotonic() - started)

        r = await sb.exec(["sh", "-c", STREAM_SCRIPT], on_stdout=on_stdout)
        ended = time.monotonic() - started
        assert r.stdout == "first\nsecond\n" and r.stderr == "oops\n"
        assert firsts and ended - firsts[0] > 2.0, (firsts, ended)

        await sb.files.write("/tmp/a.txt", b"async bytes")
        assert await sb.files.read("/tmp/a.txt") == b"async bytes"
        names = [e.name for e in await sb.files.list("/tmp")]
        assert "a.txt" in names
        await sb.files.remove("/tmp/a.txt")
        assert "a.txt" not in [e.name for e in await sb.files.list("/tmp")]

        listed = await AsyncSandbox.list(metadata={"suite": f"asdk-{tag}"}, **kw)  # type: ignore[arg-type]
        assert [s.id for s in listed] == [sb.id]
        await sb.kill()
        assert (await sb.refresh()).state == "destroyed"
    assert wait_for(lambda: not pid_alive(pid), 10)
    assert sb.id not in daemon.sandbox_dirs()
