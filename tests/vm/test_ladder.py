"""Guest-facing checks on every rung of the VM ladder (``tests/vm/ladder.py``).

Tests taking ``guest`` run three times: on a freshly booted sandbox, on the same
sandbox after a memory pause and resume, and on a fork child of it. Tests taking one
rung check what that stage must keep or change. Rung by rung, in file order within a
rung: so the checks of what a resume kept come first, right after the resume.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import time
from pathlib import Path

import pytest

from hutch.errors import Conflict, InvalidArgument, NotFound, StateError, Timeout
from hutch.net.addressing import guest_mac
from hutch.sdk import ExecExit, ExecOutput
from hutch.vm.accel import detect_accel
from tests.e2e.conftest import qemu_pids
from tests.vm import guest_programs as gp
from tests.vm.ladder import Forked, Identity, Ladder, Paused, Rung, sh

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(600)]


# -- paused ------------------------------------------------------------------------------------


def test_a_paused_sandbox_keeps_no_vm_and_refuses_commands(sandbox_paused: Paused) -> None:
    sb = sandbox_paused.sb
    info = sb.refresh()
    assert (info.state, info.pause_mode) == ("paused", "memory")
    assert qemu_pids(sb.id) == {}, "a paused sandbox must not keep a QEMU process"
    with pytest.raises(StateError, match="paused"):
        sb.exec(["true"])
    with pytest.raises(StateError, match="paused"):
        sb.files.read("/root/file")


# -- restored ----------------------------------------------------------------------------------


def test_memory_pause_keeps_processes_terminals_memory_and_sockets(
    sandbox_paused: Paused, sandbox_restored: Rung
) -> None:
    sb, paused = sandbox_restored.sb, sandbox_paused
    # The background process started before the pause runs on, the same process: its
    # output continues the count it had (a restart would begin at "tick 1" again).
    ticker = sb.processes.get(paused.ticker.pid)
    assert ticker.info.running, ticker.info
    out = ticker.output().stdout.splitlines()
    assert out[: paused.ticks_before] == [f"tick {i}" for i in range(1, paused.ticks_before + 1)]
    assert out == [f"tick {i}" for i in range(1, len(out) + 1)], "the ticker restarted"
    written = ticker.refresh().output_bytes
    time.sleep(1)
    assert ticker.refresh().output_bytes > written, "the process stopped after the resume"
    # A value held only in a process's memory, a file, the same listening socket and the
    # same open file behind it.
    assert sh(sb, gp.ASK_HOLDER, timeout_s=30) == paused.secret
    assert sh(sb, ["cat", "/root/file"]) == "keep\n"
    assert sh(sb, gp.PING) == "pong\n"
    assert sh(sb, ["cat", "/tmp/served.log"]) == "served\nserved\n"
    # The terminal: its scrollback from before the pause, its shell's variable.
    with sb.pty.attach(paused.pty_id) as term:
        term.read_until("marker-42")
        term.send("echo V=$V\n")
        term.read_until("V=set-before-pause")
    assert sb.pty.close(paused.pty_id).state == "exited"


# -- forked ------------------------------------------------------------------------------------


def test_fork_children_are_independent_copies(
    sandbox_booted: Rung, sandbox_paused: Paused, sandbox_forked: Forked
) -> None:
    child, sibling, parent = sandbox_forked, sandbox_forked.sibling, sandbox_forked.parent
    assert sibling is not None and parent is not None
    everyone = (child, sibling, parent)
    # Entropy: the first bytes each read after the fork differ from each other and from
    # the booted sandbox's. These clones differed even with the hello's entropy removed
    # (measured: what else runs in them draws from the kernel RNG), so the check that
    # catches a missing reseed is test_snapshot.py's long-running-template test.
    randoms = [r.random for r in everyone] + [sandbox_booted.random]
    assert len(set(randoms)) == 4, f"clones read the same random bytes: {randoms}"
    # Each its own hostname, machine-id, MAC and address; the parent keeps its own.
    assert parent.identity == sandbox_booted.identity
    for attr in ("hostname", "machine_id", "mac"):
        seen = [getattr(r.identity, attr) for r in everyone]
        assert len(set(seen)) == 3, f"{attr} shared: {seen}"
    addresses = [r.identity.address for r in everyone]
    if parent.identity.address:
        assert len(set(addresses)) == 3, f"addresses shared: {addresses}"
    # Memory was copied: each child has the parent's Python value and its process.
    pid = sandbox_paused.ticker.pid
    for r in (child, sibling):
        assert sh(r.sb, gp.ASK_HOLDER, timeout_s=30) == sandbox_paused.secret
        assert r.sb.processes.get(pid).info.running
    # Disks and processes are their own.
    sh(child.sb, "echo mine > /root/only-in-child")
    for r in (sibling, parent):
        assert sh(r.sb, "cat /root/only-in-child 2>/dev/null || echo absent") == "absent\n"
    killed = child.sb.processes.get(pid).kill()
    assert (killed.state, killed.signal) == ("exited", 9)
    assert parent.sb.processes.get(pid).info.running
    # Deleting a child leaves the others as they were.
    sibling.sb.kill()
    assert parent.sb.refresh().state == "running"
    assert sh(parent.sb, gp.ASK_HOLDER, timeout_s=30) == sandbox_paused.secret
    assert sh(child.sb, ["echo", "ok"]) == "ok\n"


# -- every guest rung: booted, restored, forked -------------------------------------------------


def test_guest_runs_its_own_kernel(guest: Rung, ladder: Ladder) -> None:
    served = {i.name: i for i in ladder.client.list_images()}["base"]
    uname = sh(guest.sb, ["uname", "-r"]).strip()
    assert uname == served.kernel_release
    assert uname != os.uname().release


def test_shape_hostname_and_env(guest: Rung) -> None:
    sb = guest.sb
    assert sh(sb, ["nproc"]).strip() == "2"
    total_kib = int(sh(sb, ["cat", "/proc/meminfo"]).split()[1])
    assert 300 * 1024 < total_kib <= 384 * 1024
    size_mib = int(sh(sb, ["df", "--output=size", "-B1M", "/"]).split()[-1])
    assert 2600 < size_mib <= 3 * 1024, "the root filesystem was not grown to disk_gib"
    assert sh(sb, ["hostname"]).strip() == guest.expected_hostname
    assert sh(sb, "echo $SANDBOX_VAR").strip() == "from-create"


def test_clock_is_the_hosts(guest: Rung) -> None:
    before = time.time()
    guest_now = float(sh(guest.sb, ["date", "+%s.%N"]))
    after = time.time()
    assert before - 1 <= guest_now <= after + 1, (
        f"guest clock {guest_now:.3f}, host {before:.3f}..{after:.3f}"
    )


def test_commands_reuse_one_address_layout_under_tcg(guest: Rung) -> None:
    """Under TCG every command maps ld.so and libc where the one before had them, so
    QEMU reuses what it translated (``hutch_agent.system.keep_translations_reusable``:
    a spawn took 26-38 ms with randomization, 4.7 ms without); under KVM address
    randomization stays on."""
    sb = guest.sb

    def libc_start() -> str:
        maps = sh(sb, ["cat", "/proc/self/maps"]).splitlines()
        return next(line.split("-")[0] for line in maps if "libc.so" in line)

    setting = sh(sb, ["cat", "/proc/sys/kernel/randomize_va_space"]).strip()
    if detect_accel(os.environ.get("HUTCH_ACCEL", "auto")) == "tcg":
        assert setting == "0"
        assert libc_start() == libc_start()
    else:
        assert setting == "2"


def test_identity_and_address_are_its_own(guest: Rung, request: pytest.FixtureRequest) -> None:
    now = Identity.read(guest.sb)
    assert now == guest.identity, "the identity changed while the sandbox ran"
    assert now.hostname == guest.expected_hostname
    assert re.fullmatch(r"[0-9a-f]{32}", now.machine_id), now.machine_id
    net = guest.sb.refresh().network
    assert net is not None
    if net.mode == "default":
        # The address, route and MAC hutch gave this sandbox, not its template's.
        address = ipaddress.ip_interface(now.address)
        assert str(address.ip) == net.address, (now, net)
        assert ipaddress.ip_address(now.gateway) in address.network, now
        assert now.mac == guest_mac(guest.sb.id)
    else:
        assert (net.mode, now.address, now.gateway) == ("none", "", ""), (now, net)
    if guest.stage == "restored":
        # A resume is the same machine: same identity, same boot.
        booted: Rung = request.getfixturevalue("sandbox_booted")
        assert now == booted.identity


def test_output_streams_while_the_command_runs(guest: Rung) -> None:
    start = time.monotonic()
    arrivals: list[tuple[float, str]] = []
    end = None
    with guest.sb.exec_stream("for i in 1 2 3; do echo $i; sleep 1; done") as events:
        for event in events:
            if isinstance(event, ExecOutput):
                arrivals.append((time.monotonic() - start, event.data))
            else:
                assert isinstance(event, ExecExit)
                end = event
    assert end is not None and end.exit_code == 0
    assert "".join(d for _, d in arrivals) == "1\n2\n3\n"
    assert arrivals[0][0] < arrivals[-1][0] - 1.5, f"not streamed: {arrivals}"


def test_bad_input_leaves_the_vm_usable(guest: Rung) -> None:
    sb = guest.sb
    with pytest.raises(InvalidArgument, match="no-such-cmd"):
        sb.exec(["no-such-cmd"])
    with pytest.raises(InvalidArgument):
        sb.files.stat("/proc/1/environ")
    with pytest.raises(InvalidArgument):
        sb.files.write("../../etc/passwd", b"x")
    with pytest.raises(NotFound):
        sb.files.stat("/no/such/file")
    with pytest.raises(Timeout):
        sb.exec(["sleep", "60"], timeout_s=1)
    assert sh(sb, ["echo", "ok"]) == "ok\n"


def test_files_in_the_guest(guest: Rung) -> None:
    sb = guest.sb
    data = f"data-{guest.stage}".encode()
    written = sb.files.write("/home/user/x/y.txt", data, mode=0o600)
    assert written.size == len(data)
    assert sh(sb, ["cat", "/home/user/x/y.txt"]) == data.decode()
    assert sb.files.stat("/home/user/x/y.txt").mode == 0o600
    assert b"bookworm" in sb.files.read("/etc/os-release")


def test_watch_sees_a_file_created_by_exec(guest: Rung) -> None:
    sb = guest.sb
    root = f"/root/watched-{guest.stage}"
    sh(sb, ["mkdir", "-p", f"{root}/sub"])
    with sb.files.watch(root, timeout_s=60) as watch:
        sh(sb, f"echo hi > {root}/sub/new.txt")
        seen: list[tuple[str, str]] = []
        while ("modified", f"{root}/sub/new.txt") not in seen:
            event = next(watch)
            seen.append((event.type, event.path))
        assert seen[0] == ("created", f"{root}/sub/new.txt")
        sh(sb, f"mv {root}/sub/new.txt {root}/moved.txt")
        event = next(watch)
        # The shell's write and its close are one burst only if nothing stalls it for
        # the agent's quiet time between them (a loaded host can): then a second
        # `modified` of the same file comes first, as the watch promises.
        while (event.type, event.path) == ("modified", f"{root}/sub/new.txt"):
            event = next(watch)
        assert (event.type, event.from_path, event.to_path) == (
            "renamed",
            f"{root}/sub/new.txt",
            f"{root}/moved.txt",
        )


def _local_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink()
    }


def test_tar_round_trip_keeps_every_byte(guest: Rung, tmp_path: Path) -> None:
    sb = guest.sb
    tree, copy = f"/root/tree-{guest.stage}", f"/root/copy-{guest.stage}"
    sh(
        sb,
        f"mkdir -p {tree}/a/b/c {tree}/empty && cd {tree} && "
        "head -c 3000000 /dev/urandom > a/big.bin && "
        "for i in $(seq 1 40); do head -c $((i * 997)) /dev/urandom > a/b/c/f$i; done && "
        "echo text > top.txt && ln -s a/big.bin link",
    )
    sums = "find . -type f | sort | xargs sha256sum"
    want = sh(sb, f"cd {tree} && {sums}")
    expected = {line.split()[1][2:]: line.split()[0] for line in want.splitlines()}

    local = tmp_path / "down"
    sb.files.download_dir(tree, local)
    assert _local_hashes(local) == expected
    assert os.readlink(local / "link") == "a/big.bin"
    assert (local / "empty").is_dir()

    written = sb.files.upload_dir(local, copy)
    assert written.entries == len(expected) + 5  # files + 4 directories + the symlink
    assert sh(sb, f"cd {copy} && {sums}") == want
    assert sh(sb, ["readlink", f"{copy}/link"]).strip() == "a/big.bin"


def test_signal_to_finished_process_and_unknown_ids(guest: Rung) -> None:
    sb = guest.sb
    p = sb.processes.start(["sh", "-c", "echo bye; exit 5"])
    done = p.wait(timeout_s=60)
    assert (done.state, done.exit_code) == ("exited", 5)
    with pytest.raises(Conflict, match=f"^process {p.pid} already exited with code 5$"):
        p.signal(15)
    with pytest.raises(NotFound, match="no background process 4000000"):
        sb.processes.get(4000000)
    with pytest.raises(NotFound, match="no terminal 'pty-nope'"):
        sb.pty.attach("pty-nope")
