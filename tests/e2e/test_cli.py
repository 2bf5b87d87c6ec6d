"""The ``hutch`` CLI as a user runs it: a subprocess against a real daemon and a real VM.

One sandbox (made by ``hutch create``) is shared by the module; ``test_rm`` runs last and
removes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import select
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hutch.images.build import ImageArtifacts
from hutch.models import SANDBOX_ID_RE
from tests.e2e.conftest import Daemon, pid_alive, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.vm]


@dataclass(frozen=True)
class CliSandbox:
    id: str
    name: str
    tag: str


@pytest.fixture(scope="module")
def cli_sb(daemon: Daemon) -> Iterator[CliSandbox]:
    tag = secrets.token_hex(4)
    name = f"cli-{tag}"
    r = daemon.cli(
        "create",
        "--memory",
        "256",
        "--name",
        name,
        "--metadata",
        f"suite=cli-{tag}",
        "--metadata",
        "role=e2e",
        "--env",
        "GREETING=hello from create",
    )
    assert r.returncode == 0, r.stderr
    sandbox_id = r.stdout.strip()
    # Off a terminal, `create` prints the id and nothing else (scripts capture it).
    assert SANDBOX_ID_RE.match(sandbox_id), r.stdout
    try:
        yield CliSandbox(sandbox_id, name, tag)
    finally:
        daemon.cli("rm", sandbox_id)


def _json(r: subprocess.CompletedProcess[str]) -> Any:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_ls_and_inspect(daemon: Daemon, cli_sb: CliSandbox) -> None:
    mine = _json(daemon.cli("ls", "--json", "--metadata", f"suite=cli-{cli_sb.tag}"))
    assert isinstance(mine, list) and [s["id"] for s in mine] == [cli_sb.id]
    sb = mine[0]
    assert sb["state"] == "running"
    assert sb["name"] == cli_sb.name
    assert sb["metadata"] == {"suite": f"cli-{cli_sb.tag}", "role": "e2e"}
    assert sb["memory_mib"] == 256 and sb["image"] == "base"

    # Filters: all pairs must match; state filters.
    both = daemon.cli(
        "ls", "--json", "--metadata", f"suite=cli-{cli_sb.tag}", "--metadata", "role=e2e"
    )
    assert [s["id"] for s in _json(both)] == [cli_sb.id]
    wrong = daemon.cli(
        "ls", "--json", "--metadata", f"suite=cli-{cli_sb.tag}", "--metadata", "role=other"
    )
    assert _json(wrong) == []
    running = _json(daemon.cli("ls", "--json", "--state", "running"))
    assert cli_sb.id in [s["id"] for s in running]
    destroyed = _json(daemon.cli("ls", "--json", "--state", "destroyed"))
    assert cli_sb.id not in [s["id"] for s in destroyed]

    # The table for humans: one line per sandbox, greppable.
    table = daemon.cli("ls", "--metadata", f"suite=cli-{cli_sb.tag}")
    assert table.returncode == 0
    rows = [line for line in table.stdout.splitlines() if cli_sb.id in line]
    assert len(rows) == 1 and cli_sb.name in rows[0] and "running" in rows[0]

    info = _json(daemon.cli("inspect", "--json", cli_sb.id))
    assert isinstance(info, dict)
    assert info["id"] == cli_sb.id and info["state"] == "running"
    assert info["started_at"] and info["ended_at"] is None and info["error"] is None
    text = daemon.cli("inspect", cli_sb.id)
    assert text.returncode == 0 and f"metadata.suite: cli-{cli_sb.tag}" in text.stdout.replace(
        "  ", " "
    )

    missing = daemon.cli("inspect", "sb-000000000000")
    assert missing.returncode == 1
    assert missing.stderr.startswith("error: ") and "sb-000000000000" in missing.stderr


def test_exec_streams_output_as_it_is_produced(daemon: Daemon, cli_sb: CliSandbox) -> None:
    script = "for i in 1 2 3 4; do echo line$i; sleep 1; done; echo done >&2"
    started = time.monotonic()
    arrivals: list[tuple[float, bytes]] = []
    with daemon.cli_popen("exec", cli_sb.id, "--", "sh", "-c", script) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        fd = proc.stdout.fileno()
        while True:
            ready, _, _ = select.select([fd], [], [], 60)
            assert ready, "no output from hutch exec for 60 s"
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            arrivals.append((time.monotonic() - started, chunk))
        assert proc.wait(30) == 0
        ended = time.monotonic() - started
        assert proc.stderr.read() == b"done\n"
    out = b"".join(c for _, c in arrivals)
    assert out == b"line1\nline2\nline3\nline4\n"
    first_line_at = next(t for t, c in arrivals if b"line1" in c)
    # The command runs ~3 s after its first line; a buffered CLI would print it at the end.
    assert ended - first_line_at > 2.0, (first_line_at, ended, arrivals)


def test_exec_exit_codes_and_env(daemon: Daemon, cli_sb: CliSandbox) -> None:
    r = daemon.cli("exec", cli_sb.id, "--", "sh", "-c", "echo bye; exit 7")
    assert r.returncode == 7, r.stderr
    assert r.stdout == "bye\n"
    r = daemon.cli("exec", cli_sb.id, "false")
    assert r.returncode == 1
    # Options between the id and the command; the create-time env is there too.
    r = daemon.cli(
        "exec", cli_sb.id, "-e", "EXTRA=x", "-w", "/tmp", "sh", "-c", 'echo "$GREETING/$EXTRA/$PWD"'
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == "hello from create/x//tmp\n"
    # A signal ends the command: 128+N like a shell.
    r = daemon.cli("exec", cli_sb.id, "--", "sh", "-c", "kill -9 $$")
    assert r.returncode == 128 + 9
    r = daemon.cli("exec", cli_sb.id, "-i", "--", "wc", "-c", input="12345")
    assert r.returncode == 0 and r.stdout.strip() == "5"


def test_cp_both_ways_keeps_the_bytes(daemon: Daemon, cli_sb: CliSandbox, tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    digest = hashlib.sha256(data).hexdigest()
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    src.chmod(0o640)

    r = daemon.cli("cp", str(src), f"{cli_sb.id}:/root/blob.bin")
    assert r.returncode == 0, r.stderr
    r = daemon.cli(
        "exec", cli_sb.id, "--", "sh", "-c", "sha256sum /root/blob.bin; stat -c %a /root/blob.bin"
    )
    assert r.returncode == 0, r.stderr
    guest_sum, mode = r.stdout.split("\n")[0].split()[0], r.stdout.split("\n")[1]
    assert guest_sum == digest
    assert mode == "640"

    # Onto a directory: the file keeps its name.
    r = daemon.cli("cp", str(src), f"{cli_sb.id}:/tmp/")
    assert r.returncode == 0, r.stderr
    r = daemon.cli("exec", cli_sb.id, "--", "sha256sum", "/tmp/blob.bin")
    assert r.stdout.split()[0] == digest

    back = tmp_path / "back.bin"
    r = daemon.cli("cp", f"{cli_sb.id}:/root/blob.bin", str(back))
    assert r.returncode == 0, r.stderr
    assert hashlib.sha256(back.read_bytes()).hexdigest() == digest
    assert not list(tmp_path.glob(".*.part")), "a partial download was left behind"

    # A file made in the guest comes out intact too; to stdout with '-'.
    r = daemon.cli(
        "exec",
        cli_sb.id,
        "--",
        "sh",
        "-c",
        "head -c 100000 /dev/urandom > /root/g.bin; sha256sum /root/g.bin",
    )
    guest_made = r.stdout.split()[0]
    out = daemon.cli_bytes("cp", f"{cli_sb.id}:/root/g.bin", "-")
    assert out.returncode == 0
    assert hashlib.sha256(out.stdout).hexdigest() == guest_made

    r = daemon.cli("cp", f"{cli_sb.id}:/root/no-such-file", str(tmp_path / "x"))
    assert r.returncode == 1 and "no-such-file" in r.stderr
    assert not (tmp_path / "x").exists()


def test_images_json(daemon: Daemon, base_image: ImageArtifacts) -> None:
    images = _json(daemon.cli("images", "--json"))
    assert isinstance(images, list)
    by_name = {i["name"]: i for i in images}
    assert by_name["base"]["built"] is True
    assert by_name["base"]["kernel_release"] == base_image.kernel_release
    assert by_name["base"]["size_bytes"] > 0
    assert "devbox" in by_name


def test_rm(daemon: Daemon, cli_sb: CliSandbox) -> None:
    pid = daemon.qemu_pid_of(cli_sb.id)
    assert pid_alive(pid)
    r = daemon.cli("rm", cli_sb.id)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == cli_sb.id
    info = _json(daemon.cli("inspect", "--json", cli_sb.id))
    assert isinstance(info, dict) and info["state"] == "destroyed"
    assert wait_for(lambda: not pid_alive(pid), 10), "QEMU still runs after hutch rm"
    assert cli_sb.id not in daemon.sandbox_dirs()
    # Gone from the default listing.
    assert _json(daemon.cli("ls", "--json", "--metadata", f"suite=cli-{cli_sb.tag}")) == []
    # rm of something that does not exist: exit 1, error on stderr, nothing on stdout.
    r = daemon.cli("rm", "sb-000000000000")
    assert r.returncode == 1 and r.stdout == "" and "sb-000000000000" in r.stderr
