"""Secrets end to end on a real hutchd with a real VM (one cold boot, one memory restore):
a sandbox with env_secrets sees the value in `env`; a replace reaches the next command
(also after a memory pause/resume and after the daemon was SIGKILLed and adopted the
VM), while a process started earlier keeps what it started with; and the values are in
no file of the state directory (database, WAL, logs, sandbox files, the daemon's stderr)
nor in any API answer."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from hutch.sdk import Sandbox
from tests.conftest import ensure_image
from tests.e2e.conftest import Daemon, finalize_daemon

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]

V1 = "hutch-vm-secret-v1-6b0f2e9c41d7"
V2 = "hutch-vm-secret-v2-a83c17e5d902"
V3 = "hutch-vm-secret-v3-1f5d9a0c7e44"
SHAPE = {"vcpus": 1, "memory_mib": 256, "disk_gib": 2}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    ensure_image("base")
    d = Daemon(tmp_path_factory.mktemp("secrets") / "state")
    d.daemon_env["HUTCH_TEMPLATES"] = "0"  # no background template boot
    d.start()
    try:
        yield d
    finally:
        problems = finalize_daemon(d)
        assert not problems, "\n".join(problems)


def _env(sb: Sandbox) -> dict[str, str]:
    out = sb.exec(["env"]).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _files_holding(root: Path, needles: list[bytes]) -> list[str]:
    """Every regular file under ``root`` that contains one of ``needles`` (read in
    chunks, overlapping, so a value across a chunk boundary is found too)."""
    overlap = max(len(n) for n in needles)
    found = []
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.is_symlink():
            continue
        with path.open("rb") as f:
            tail = b""
            while chunk := f.read(1 << 20):
                window = tail + chunk
                hits = [n for n in needles if n in window]
                if hits:
                    found.append(f"{path}: {hits}")
                    break
                tail = window[-overlap:]
    return found


def test_env_secrets_reach_the_guest_and_nothing_of_hutch_keeps_them(daemon: Daemon) -> None:
    # The CLI reads the value from stdin (never argv) and drops the trailing newline.
    done = daemon.cli("secret", "set", "vm-token", input=V1 + "\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "vm-token version 1\n"
    key = daemon.state_dir / "secrets.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600

    with daemon.client(timeout=300.0) as client:
        sb = Sandbox.create("base", env_secrets={"TOKEN": "vm-token"}, client=client, **SHAPE)  # type: ignore[arg-type]
        answers = [sb.info.to_dict()]
        assert sb.info.env_secrets == {"TOKEN": "vm-token"}
        assert _env(sb)["TOKEN"] == V1

        # Started before the rotation: a process keeps the environment it started with.
        early = sb.processes.start("cat >/dev/null; echo early=$TOKEN", keep_stdin=True)
        answers.append(client.secrets.set("vm-token", V2).to_dict())
        assert sb.exec("printenv TOKEN").stdout == f"{V2}\n"

        # Memory pause and resume: the guest's processes live on; new commands still
        # get the current value, resolved by the daemon at each command.
        sb.pause("memory")
        sb.resume()
        assert sb.exec("printenv TOKEN").stdout == f"{V2}\n"
        early.close_stdin()
        early.wait(timeout_s=60)
        assert early.output().stdout == f"early={V1}\n"

    # The daemon is SIGKILLed and restarted: it adopts the VM, and the names stored with
    # the sandbox plus the key file are all it needs.
    daemon.kill9()
    daemon.start()
    with daemon.client(timeout=300.0) as client:
        sb = Sandbox.connect(sb.id, client=client)
        assert sb.exec("printenv TOKEN").stdout == f"{V2}\n"
        answers.append(client.secrets.set("vm-token", V3).to_dict())
        assert _env(sb)["TOKEN"] == V3
        answers += [s.to_dict() for s in client.secrets.list()]
        answers += [s.to_dict() for s in client.list_sandboxes()]
        assert [s.version for s in client.secrets.list()] == [3]

    needles = [v.encode() for v in (V1, V2, V3)]
    assert not any(n.decode() in repr(answers) for n in needles), answers
    # Everything hutch wrote: hutch.db (+ -wal, -shm), logs/hutchd.log, the daemon's
    # stderr, the sandbox's console.log, qemu.log, vm.json, disk overlay; the pause's
    # memory image was consumed by the resume. (A memory image of a paused, forked or
    # snapshotted sandbox holds the guest's RAM, and with it what its processes hold.)
    assert (daemon.state_dir / "hutch.db").is_file()
    assert daemon.log_path.is_file()
    assert _files_holding(daemon.state_dir, needles) == []
    assert _files_holding(daemon.run_dir, needles) == []

    # The scan sees into what the guest owns: a value the guest itself writes to its disk
    # is found there (the guest's disk is the guest's, like its memory).
    with daemon.client(timeout=300.0) as client:
        Sandbox.connect(sb.id, client=client).exec("printenv TOKEN > /root/leaked; sync")
    leaked = _files_holding(daemon.state_dir, needles)
    assert len(leaked) == 1 and f"{sb.id}/disk.qcow2" in leaked[0], leaked
