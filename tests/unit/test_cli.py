"""The `hutch` CLI through click's CliRunner, against the fake REST contract.

The fake is handed over as ``obj=CliEnv(transport=...)``: the same path the real CLI
takes, minus the network.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result

from hutch.cli._env import CliEnv
from hutch.cli.exec_cmd import exit_status
from hutch.cli.main import cli
from hutch.testing import FakeHutch, FakeRun


@pytest.fixture
def fake() -> FakeHutch:
    return FakeHutch()


class Hutch:
    """Runs `hutch ARGS...` against the fake."""

    def __init__(self, fake: FakeHutch, transport: httpx.BaseTransport | None = None) -> None:
        self.fake = fake
        self.transport = transport or fake.transport

    def __call__(self, *args: str, input: str | bytes | None = None, key: bool = True) -> Result:
        argv = ["--api-key", self.fake.api_key, *args] if key else list(args)
        result = CliRunner().invoke(cli, argv, obj=CliEnv(transport=self.transport), input=input)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return result


@pytest.fixture
def hutch(fake: FakeHutch) -> Hutch:
    return Hutch(fake)


def body(fake: FakeHutch) -> Any:
    return json.loads(fake.requests[-1].content)


def test_create_prints_the_id_and_sends_the_spec(fake: FakeHutch, hutch: Hutch) -> None:
    result = hutch(
        "create",
        "--image",
        "base",
        "--vcpus",
        "2",
        "--memory",
        "1024",
        "--disk",
        "8",
        "--env",
        "A=1",
        "--env",
        "B=x=y",
        "--metadata",
        "team=ml",
        "--name",
        "web",
        "--timeout",
        "600",
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "sb-000000000001\n"
    assert result.stderr == ""  # no spinner off a terminal
    assert body(fake) == {
        "image": "base",
        "vcpus": 2,
        "memory_mib": 1024,
        "disk_gib": 8,
        "env": {"A": "1", "B": "x=y"},
        "metadata": {"team": "ml"},
        "name": "web",
        "timeout_s": 600,
    }


def test_create_json(hutch: Hutch) -> None:
    result = hutch("create", "--json")
    data = json.loads(result.stdout)
    assert data["id"] == "sb-000000000001" and data["state"] == "running"
    assert data["created_at"] == "2026-11-30T03:00:00.123Z"


def test_create_usage_errors_exit_2(hutch: Hutch) -> None:
    result = hutch("create", "--env", "NOEQUALS")
    assert result.exit_code == 2
    assert "'NOEQUALS' is not KEY=VALUE" in result.stderr


def test_api_errors_print_error_and_exit_1(hutch: Hutch) -> None:
    result = hutch("create", "--image", "nope")
    assert result.exit_code == 1
    assert result.stderr == "error: unknown image 'nope'; available: base, devbox\n"
    assert result.stdout == ""


def test_ls_table_and_json(fake: FakeHutch, hutch: Hutch) -> None:
    fake.add_sandbox(name="web", metadata={"team": "a"}, vcpus=2, memory_mib=1024)
    fake.add_sandbox(metadata={"team": "b"})
    lines = hutch("ls").stdout.splitlines()
    assert lines[0].split() == ["ID", "NAME", "IMAGE", "STATE", "VCPUS", "MEM", "CREATED"]
    assert lines[1].split() == [
        "sb-000000000001",
        "web",
        "base",
        "running",
        "2",
        "1024M",
        "2026-11-30",
        "03:00:00",
    ]
    assert lines[2].split()[1] == "-"
    assert all(line == line.rstrip() for line in lines)
    listed = json.loads(hutch("ls", "--metadata", "team=b", "--json").stdout)
    assert [s["id"] for s in listed] == ["sb-000000000002"]
    assert fake.requests[-1].url.params.get_list("metadata") == ["team=b"]
    hutch("ls", "--state", "running")
    assert fake.requests[-1].url.params["state"] == "running"
    assert json.loads(hutch("ls", "--state", "destroyed", "--json").stdout) == []


def test_inspect(fake: FakeHutch, hutch: Hutch) -> None:
    sb = fake.add_sandbox(metadata={"k": "v"})
    text = hutch("inspect", sb.id).stdout
    assert f"id:         {sb.id}\n" in text
    assert "metadata.k: v\n" in text
    assert json.loads(hutch("inspect", sb.id, "--json").stdout) == sb.to_json()
    missing = hutch("inspect", "sb-000000000999")
    assert (missing.exit_code, missing.stderr) == (
        1,
        "error: no sandbox sb-000000000999\n",
    )


def test_inspect_shows_the_placement_labels(fake: FakeHutch, hutch: Hutch) -> None:
    sb = fake.add_sandbox(placement={"labels": {"zone": "eu-1", "gpu": "a10"}})
    text = hutch("inspect", sb.id).stdout
    assert "placement.gpu:  a10\n" in text and "placement.zone: eu-1\n" in text
    shown = json.loads(hutch("inspect", sb.id, "--json").stdout)
    assert shown["placement_labels"] == {"zone": "eu-1", "gpu": "a10"}
    assert "placement." not in hutch("inspect", fake.add_sandbox().id).stdout


def test_rm_removes_each_and_reports_failures(fake: FakeHutch, hutch: Hutch) -> None:
    a, b = fake.add_sandbox(), fake.add_sandbox()
    result = hutch("rm", a.id, "sb-000000000999", b.id)
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [a.id, b.id]
    assert "error: sb-000000000999: " in result.stderr
    assert a.state == b.state == "destroyed"
    assert hutch("rm", a.id).exit_code == 0  # already destroyed: idempotent
    assert hutch("rm").exit_code == 2


def test_exec_streams_and_exits_with_the_commands_status(fake: FakeHutch, hutch: Hutch) -> None:
    sb = fake.add_sandbox()
    fake.exec_handler = lambda s, b: FakeRun(
        [("stdout", "out1\n"), ("stderr", "err\n"), ("stdout", "out2\n")], exit_code=7
    )
    result = hutch(
        "exec",
        sb.id,
        "--env",
        "A=1",
        "--cwd",
        "/tmp",
        "--user",
        "nobody",
        "--timeout",
        "5",
        "--",
        "ls",
        "-la",
    )
    assert result.exit_code == 7
    assert (result.stdout, result.stderr) == ("out1\nout2\n", "err\n")
    assert body(fake) == {
        "cmd": ["ls", "-la"],
        "stream": True,
        "env": {"A": "1"},
        "cwd": "/tmp",
        "user": "nobody",
        "timeout_s": 5.0,
    }


def test_exec_args_after_the_command_belong_to_it(fake: FakeHutch, hutch: Hutch) -> None:
    sb = fake.add_sandbox()
    assert hutch("exec", sb.id, "sh", "-e", "-c", "echo hi").exit_code == 0
    assert body(fake)["cmd"] == ["sh", "-e", "-c", "echo hi"]
    assert "env" not in body(fake)
    hutch("exec", "-w", "/srv", sb.id, "python3", "--version")
    assert (body(fake)["cmd"], body(fake)["cwd"]) == (["python3", "--version"], "/srv")


def test_exec_signal_and_stdin(fake: FakeHutch, hutch: Hutch) -> None:
    sb = fake.add_sandbox()
    fake.exec_handler = lambda s, b: FakeRun([], exit_code=None, signal=9)
    assert hutch("exec", sb.id, "sleep", "9").exit_code == 137
    assert "stdin" not in body(fake)  # not forwarded without -i
    fake.exec_handler = lambda s, b: FakeRun([("stdout", b.get("stdin") or "")])
    result = hutch("exec", "-i", sb.id, "cat", input="piped\n")
    assert (result.exit_code, result.stdout) == (0, "piped\n")


def test_exec_timeout_is_an_error(fake: FakeHutch, hutch: Hutch) -> None:
    sb = fake.add_sandbox()
    fake.exec_handler = lambda s, b: FakeRun(
        [("stdout", "so far")], error=("timeout", "ran longer than 1 s")
    )
    result = hutch("exec", "--timeout", "1", sb.id, "sleep", "5")
    assert result.exit_code == 1
    assert result.stdout == "so far"
    assert result.stderr == "error: ran longer than 1 s\n"


def test_exit_status() -> None:
    assert [
        exit_status(0, None),
        exit_status(3, None),
        exit_status(None, 15),
        exit_status(None, None),
    ] == [0, 3, 143, 1]


def test_cp_upload_download_round_trip(fake: FakeHutch, hutch: Hutch, tmp_path: Path) -> None:
    sb = fake.add_sandbox()
    src = tmp_path / "data.bin"
    payload = bytes(range(256)) * 20_000  # 5 MB: several chunks each way
    src.write_bytes(payload)
    src.chmod(0o640)
    assert hutch("cp", str(src), f"{sb.id}:/root/data.bin").exit_code == 0
    assert sb.files["/root/data.bin"] == payload
    assert sb.modes["/root/data.bin"] == 0o640
    out = tmp_path / "back.bin"
    assert hutch("cp", f"{sb.id}:/root/data.bin", str(out)).exit_code == 0
    assert out.read_bytes() == payload
    assert out.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []


def test_cp_into_directories_keeps_the_name(fake: FakeHutch, hutch: Hutch, tmp_path: Path) -> None:
    sb = fake.add_sandbox()
    src = tmp_path / "a.txt"
    src.write_text("A")
    hutch("cp", str(src), f"{sb.id}:/tmp")  # an existing remote directory
    hutch("cp", str(src), f"{sb.id}:/root/")
    assert sb.files["/tmp/a.txt"] == sb.files["/root/a.txt"] == b"A"
    dest = tmp_path / "down"
    dest.mkdir()
    hutch("cp", f"{sb.id}:/tmp/a.txt", str(dest))
    assert (dest / "a.txt").read_text() == "A"


def test_cp_stdin_and_stdout(fake: FakeHutch, hutch: Hutch) -> None:
    sb = fake.add_sandbox()
    assert hutch("cp", "-", f"{sb.id}:/root/in.txt", input=b"from stdin").exit_code == 0
    assert sb.files["/root/in.txt"] == b"from stdin"
    result = hutch("cp", f"{sb.id}:/root/in.txt", "-")
    assert result.stdout_bytes == b"from stdin"


def test_cp_errors(fake: FakeHutch, hutch: Hutch, tmp_path: Path) -> None:
    sb = fake.add_sandbox()
    usage = hutch("cp", str(tmp_path), str(tmp_path))
    assert usage.exit_code == 2 and "exactly one of SRC and DST" in usage.stderr
    local_dir = hutch("cp", str(tmp_path), f"{sb.id}:/root/x")
    assert local_dir.exit_code == 1 and "is a directory" in local_dir.stderr
    remote_dir = hutch("cp", f"{sb.id}:/root", str(tmp_path / "x"))
    assert remote_dir.exit_code == 1 and "is a directory" in remote_dir.stderr
    missing = hutch("cp", f"{sb.id}:/root/nope", str(tmp_path / "x"))
    assert missing.exit_code == 1 and "no such file" in missing.stderr
    assert not (tmp_path / "x").exists()
    no_local = hutch("cp", str(tmp_path / "nope"), f"{sb.id}:/root/x")
    assert no_local.exit_code == 1 and "no such file on this host" in no_local.stderr


def test_images(hutch: Hutch) -> None:
    lines = hutch("images").stdout.splitlines()
    assert lines[0].split() == [
        "NAME", "PROJECT", "BUILT", "SIZE", "DIGEST", "KERNEL", "SOURCE", "DESCRIPTION"
    ]  # fmt: skip
    assert lines[1].split()[:4] == ["base", "(built-in)", "yes", "1.0"]
    data = json.loads(hutch("images", "--json").stdout)
    assert [i["name"] for i in data] == ["base", "devbox"]
    assert data[1] == {
        "name": "devbox",
        "description": "base plus build tools",
        "built": False,
        "digest": None,
        "size_bytes": None,
        "kernel_release": None,
        "source": {"type": "builtin"},
        "config": None,
        "start": False,
        "created_at": None,
        "project": None,
    }


def test_version(hutch: Hutch) -> None:
    lines = hutch("version").stdout.splitlines()
    assert lines == ["hutch 0.1.0", "daemon: hutchd 0.1.0 at http://127.0.0.1:7070 (accel tcg)"]
    data = json.loads(hutch("version", "--json").stdout)
    assert data == {
        "client": "0.1.0",
        "daemon": {"status": "ok", "version": "0.1.0", "accel": "tcg"},
    }


def test_daemon_down(fake: FakeHutch) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    down = Hutch(fake, httpx.MockTransport(refuse))
    result = down("ls")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: cannot reach the hutch daemon at http://127.0.0.1:7070")
    assert "`make up` or `hutch daemon`" in result.stderr
    assert down("version").stdout.splitlines()[1] == (
        "daemon: not reachable at http://127.0.0.1:7070"
    )


def test_url_option_and_missing_key(
    fake: FakeHutch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HUTCH_API_KEY", raising=False)
    monkeypatch.delenv("HUTCH_URL", raising=False)
    monkeypatch.setenv("HUTCH_STATE_DIR", str(tmp_path))
    hutch = Hutch(fake)
    result = hutch("--url", "http://127.0.0.1:9999", "ls", key=False)
    assert result.exit_code == 1
    assert "HUTCH_API_KEY" in result.stderr and str(tmp_path / "api-key") in result.stderr
    assert fake.requests == []
    (tmp_path / "api-key").write_text(fake.api_key)
    assert hutch("--url", "http://127.0.0.1:9999", "ls", key=False).exit_code == 0
    assert str(fake.requests[-1].url).startswith("http://127.0.0.1:9999/v1/sandboxes")


@pytest.mark.parametrize("tty", [False, True], ids=["piped", "terminal"])
def test_image_build_runs_the_local_builder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, hutch: Hutch, tty: bool
) -> None:
    import hutch.images.build as build_mod

    calls: list[tuple[str, Path, bool]] = []

    class Arts:
        name, digest, rootfs = "base", "abc123", tmp_path / "images/base/abc123/rootfs.ext4"

    def fake_build(name: str, images_dir: Path, progress: Any = None, force: bool = False) -> Arts:
        calls.append((name, images_dir, force))
        progress("kernel", 0.0)
        progress("packages", 0.05)
        progress("packages", 0.5)
        progress("done", 1.0)
        return Arts()

    monkeypatch.setattr(build_mod, "build_image", fake_build)
    monkeypatch.setenv("HUTCH_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("TTY_COMPATIBLE", "1" if tty else "0")
    result = hutch("image", "build", "--force")
    assert result.exit_code == 0, result.stderr
    assert calls == [("base", tmp_path / "images", True)]
    if not tty:
        assert result.stderr.splitlines() == [
            "building base: kernel",
            "building base: packages",
            "building base: done",
        ]
    assert result.stdout == f"base abc123 {tmp_path}/images/base/abc123\n"


def test_help_lists_every_command(hutch: Hutch) -> None:
    text = hutch("--help").stdout
    for command in (
        "create",
        "ls",
        "inspect",
        "rm",
        "pause",
        "resume",
        "fork",
        "snapshot",
        "exec",
        "cp",
        "images",
        "image",
        "daemon",
        "version",
    ):
        assert f"  {command} " in text, command


def test_spinner_and_progress_bars_on_a_terminal(
    fake: FakeHutch, hutch: Hutch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rich treats the output as a terminal; the human-only paths must still produce the
    # same results on stdout.
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setattr("hutch.cli.cp.PROGRESS_MIN_BYTES", 1)
    created = hutch("create")
    assert created.exit_code == 0 and created.stdout == "sb-000000000001\n"
    sb = fake.sandboxes["sb-000000000001"]
    src = tmp_path / "f.bin"
    src.write_bytes(b"x" * (3 << 20))
    assert hutch("cp", str(src), f"{sb.id}:/root/f.bin").exit_code == 0
    assert hutch("cp", f"{sb.id}:/root/f.bin", str(tmp_path / "g.bin")).exit_code == 0
    assert (tmp_path / "g.bin").read_bytes() == src.read_bytes()
    assert "sb-000000000001" in hutch("ls").stdout


def test_daemon_commands_run_the_daemon_with_loaded_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, hutch: Hutch
) -> None:
    from hutch.cli.main import _hutchd
    from hutch.config import Settings
    from hutch.errors import VmError

    started: list[Settings] = []
    stub = types.ModuleType("hutch.daemon")
    stub.run = started.append  # type: ignore[attr-defined]
    # A stand-in module: the real one pulls in uvicorn and the VM layer.
    monkeypatch.setitem(sys.modules, "hutch.daemon", stub)
    monkeypatch.setenv("HUTCH_STATE_DIR", str(tmp_path))
    assert hutch("daemon").exit_code == 0
    assert CliRunner().invoke(_hutchd, []).exit_code == 0
    assert [s.state_dir for s in started] == [tmp_path, tmp_path]

    def broken(settings: Settings) -> None:
        raise VmError("qemu-system-x86_64 not found")

    stub.run = broken  # type: ignore[attr-defined]
    result = CliRunner().invoke(_hutchd, [])
    assert (result.exit_code, result.stderr) == (1, "error: qemu-system-x86_64 not found\n")
