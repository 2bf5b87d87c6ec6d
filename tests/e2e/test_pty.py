"""Interactive terminals and background processes against a real daemon and a real VM.

A full-screen curses program (the base image has no vim; Python's curses is the same
kind of client: alternate screen, raw keys, redraw on SIGWINCH) runs in a PTY over the
WebSocket; the connection drops mid-program; a new connection to the same terminal finds
the program and the shell around it as they were. The CLI side: ``hutch shell`` on a
real local pty (raw mode, detach, reattach), and ``hutch exec --background`` / ``ps`` /
``logs`` / ``kill``.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

import pytest

from hutch.errors import Conflict, NotFound
from hutch.sdk import Sandbox, Terminal
from tests.e2e.conftest import Daemon

pytestmark = [pytest.mark.e2e, pytest.mark.vm, pytest.mark.timeout(600)]

FULLSCREEN = r"""
import curses

def main(scr):
    curses.curs_set(0)
    key, n = "none", 0
    while True:
        rows, cols = scr.getmaxyx()
        scr.clear()  # repaint everything: each state shows up whole in the byte stream
        scr.border()
        scr.addstr(1, 2, f"fullscreen size={rows}x{cols} key={key} n={n}")
        scr.refresh()
        ch = scr.getch()
        n += 1
        if ch == curses.KEY_RESIZE:
            key = "resize"
        elif ch == ord("q"):
            return
        else:
            key = chr(ch) if 32 <= ch < 127 else str(ch)

curses.wrapper(main)
"""


def _until(term: Terminal, needle: str, timeout: float = 90) -> str:
    return term.read_until(needle, timeout).decode(errors="replace")


def test_fullscreen_program_survives_a_reconnect(daemon: Daemon) -> None:
    with daemon.client() as client, Sandbox.create(memory_mib=256, client=client) as sb:
        sb.files.write("/root/fs.py", FULLSCREEN)
        term = sb.pty.open(rows=24, cols=80)
        try:
            pty_id = term.pty_id
            _until(term, "#")  # root's prompt
            term.send("export MARK=before-drop-$((6*7))\n")
            term.send("python3 /root/fs.py\n")
            screen = _until(term, "size=24x80 key=none n=0")
            assert "\x1b[?1049h" in screen, "curses did not switch to the alternate screen"
            term.send("a")
            _until(term, "size=24x80 key=a n=1")
            # ncurses turns SIGWINCH into KEY_RESIZE only while it waits in getch(); give
            # it the moment a human would (a resize in the middle of its redraw waits for
            # the next key).
            time.sleep(1.5)
            term.resize(30, 100)  # SIGWINCH from the kernel; curses redraws
            _until(term, "size=30x100 key=resize n=2")
        finally:
            term.detach()  # the WebSocket drops with the program running

        # The guest notices the dropped stream within a poll interval.
        deadline = time.monotonic() + 10
        while (listed := sb.pty.list()) and listed[0].attached and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [(t.pty_id, t.state, t.attached) for t in listed] == [(pty_id, "running", False)]

        term = sb.pty.attach(pty_id)
        try:
            _until(term, "size=30x100 key=resize n=2")  # the scrollback replays the screen
            term.send("b")
            _until(term, "size=30x100 key=b n=3")  # same program, same state
            term.send("q")
            term.send("echo mark=$MARK\n")
            _until(term, "mark=before-drop-42")  # same shell, same variables
            term.send("exit 3\n")
            while term.recv(60):
                pass
            assert term.exit_code == 3
        finally:
            term.detach()

        with pytest.raises(Conflict, match="exited with code 3"):
            sb.pty.attach(pty_id)
        sb.pty.close(pty_id)
        with pytest.raises(NotFound, match=pty_id):
            sb.pty.attach(pty_id)


def test_background_process_through_sdk_and_cli(daemon: Daemon) -> None:
    with daemon.client() as client, Sandbox.create(memory_mib=256, client=client) as sb:
        r = daemon.cli("exec", "--background", sb.id, "--", "sh", "-c", "echo hi; sleep 600")
        assert r.returncode == 0, r.stderr
        pid = int(r.stdout.strip())
        proc = sb.processes.get(pid)
        deadline = time.monotonic() + 60
        while proc.output().stdout != "hi\n" and time.monotonic() < deadline:
            time.sleep(0.2)
        r = daemon.cli("ps", sb.id, "--json")
        assert r.returncode == 0, r.stderr
        assert [(p["pid"], p["state"]) for p in json.loads(r.stdout)] == [(pid, "running")]
        r = daemon.cli("logs", sb.id, str(pid))
        assert (r.returncode, r.stdout) == (0, "hi\n")
        r = daemon.cli("kill", sb.id, str(pid), "--signal", "TERM")
        assert r.returncode == 0 and "killed (15)" in r.stdout, r
        r = daemon.cli("kill", sb.id, str(pid), "--signal", "TERM")
        assert r.returncode == 1
        assert f"process {pid} already exited (killed by signal 15)" in r.stderr

        # logs -f follows live and exits with the process's status.
        p = sb.processes.start("for i in 1 2 3; do echo n$i; sleep 0.3; done; exit 4")
        r = daemon.cli("logs", "-f", sb.id, str(p.pid))
        assert (r.returncode, r.stdout) == (4, "n1\nn2\nn3\n")


def _read_pty(fd: int, needle: bytes, timeout: float = 90) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{needle!r} not seen; got {seen[-1500:]!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                seen += os.read(fd, 65536)
            except OSError:
                break
    return seen


def test_cli_shell_raw_mode_detach_and_attach(daemon: Daemon) -> None:
    """``hutch shell`` on a real local terminal: keys pass through raw (Ctrl-C reaches
    the sandbox, not hutch), Ctrl-] detaches, ``--attach`` comes back."""
    import termios

    with daemon.client() as client, Sandbox.create(memory_mib=256, client=client) as sb:
        master, slave = os.openpty()
        proc = subprocess.Popen(
            [sys.executable, "-m", "hutch", "shell", sb.id],
            env=daemon.env,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
        )
        os.close(slave)
        try:
            _read_pty(master, b"#")
            os.write(master, b"export K=v1; sleep 100\r")
            time.sleep(1)
            os.write(master, b"\x03")  # Ctrl-C: raw mode sends it on as a byte
            os.write(master, b"echo rc=$?\r")
            _read_pty(master, b"rc=130")
            os.write(master, b"\x1d")  # Ctrl-] detaches
            out = _read_pty(master, b"--attach ")
            assert proc.wait(30) == 0
            pty_id = out.split(b"--attach ")[1].split(b"]")[0].decode()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            os.close(master)

        master, slave = os.openpty()
        saved = termios.tcgetattr(slave)
        proc = subprocess.Popen(
            [sys.executable, "-m", "hutch", "shell", sb.id, "--attach", pty_id],
            env=daemon.env,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
        )
        try:
            _read_pty(master, b"rc=130")  # the scrollback, replayed
            os.write(master, b"echo k=$K\r")
            _read_pty(master, b"k=v1")
            os.write(master, b"exit 5\r")
            assert proc.wait(60) == 5
            assert termios.tcgetattr(slave) == saved, "hutch shell left the terminal raw"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            os.close(slave)
            os.close(master)
