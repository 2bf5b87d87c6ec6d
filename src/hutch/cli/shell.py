"""``hutch shell ID``: an interactive terminal in a sandbox, in this terminal.

The local terminal goes to raw mode (every key, Ctrl-C included, goes to the sandbox) and
is restored on the way out, whatever happens. A window resize (SIGWINCH) is forwarded.
``Ctrl-]`` detaches and leaves the shell running; ``--attach PTY_ID`` comes back to it.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import sys
import termios
import threading
import tty
from collections.abc import Iterator
from types import FrameType

import click

from hutch.cli._env import get_env
from hutch.sdk import Pty, Terminal

__all__ = ["shell"]

DETACH_KEY = b"\x1d"  # Ctrl-]


@contextlib.contextmanager
def _raw(fd: int) -> Iterator[None]:
    """Raw mode on a terminal ``fd`` for the block; restored even on errors."""
    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd, termios.TCSANOW)  # not TCSAFLUSH: keep what was typed ahead
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _pump_output(
    term: Terminal, out_fd: int, wake_w: int, errors: list[Exception], done: threading.Event
) -> None:
    try:
        while chunk := term.recv():
            os.write(out_fd, chunk)
    except Exception as exc:  # reported once the local terminal is restored
        errors.append(exc)
    finally:
        # Set before the wake-up: the main loop must not see this thread still alive
        # after it consumed the wake-up byte (it would then wait on stdin forever).
        done.set()
        with contextlib.suppress(OSError):
            os.write(wake_w, b"x")


@click.command("shell")
@click.argument("sandbox_id", metavar="ID")
@click.option("--attach", "pty_id", metavar="PTY_ID", help="Reattach to a running terminal.")
@click.option("--cmd", "-c", metavar="CMD", help="Run CMD (via /bin/sh -c) instead of a shell.")
def shell(sandbox_id: str, pty_id: str | None, cmd: str | None) -> None:
    """Open an interactive terminal in sandbox ID (Ctrl-] detaches; the shell keeps running).

    hutch exits with the shell's exit status.
    """
    in_fd, out_fd = sys.stdin.fileno(), sys.stdout.fileno()
    size = shutil.get_terminal_size((80, 24))
    pty = Pty(get_env().client(), sandbox_id)
    if pty_id is not None:
        if cmd is not None:
            raise click.UsageError("--cmd starts a new terminal; it cannot go with --attach")
        term = pty.attach(pty_id)
        if os.isatty(out_fd):
            term.resize(size.lines, size.columns)
    else:
        term = pty.open(size.lines, size.columns, cmd=cmd)
    wake_r, wake_w = os.pipe()
    resized = threading.Event()

    def on_winch(_sig: int, _frame: FrameType | None) -> None:
        resized.set()
        with contextlib.suppress(OSError):
            os.write(wake_w, b"w")

    old_handler = signal.signal(signal.SIGWINCH, on_winch)
    errors: list[Exception] = []
    output_done = threading.Event()
    reader = threading.Thread(
        target=_pump_output, args=(term, out_fd, wake_w, errors, output_done), daemon=True
    )
    detached = False
    stdin_open = True
    try:
        with _raw(in_fd):
            reader.start()
            while not output_done.is_set():
                watch = [wake_r, in_fd] if stdin_open else [wake_r]
                ready, _, _ = select.select(watch, [], [])
                if wake_r in ready:
                    os.read(wake_r, 64)
                    if resized.is_set():
                        resized.clear()
                        size = shutil.get_terminal_size((80, 24))
                        term.resize(size.lines, size.columns)
                if in_fd in ready:
                    data = os.read(in_fd, 4096)
                    if not data:  # stdin is a pipe that ended: end of input, as Ctrl-D
                        stdin_open = False
                        term.send(b"\x04")
                    elif DETACH_KEY in data and os.isatty(in_fd):
                        before = data.split(DETACH_KEY, 1)[0]
                        if before:
                            term.send(before)
                        detached = True
                        break
                    else:
                        term.send(data)
    finally:
        signal.signal(signal.SIGWINCH, old_handler)
        term.detach()
        reader.join(timeout=5)
        os.close(wake_r)
        os.close(wake_w)
    if errors and not detached:
        raise errors[0]
    if detached or term.state.detached:
        click.echo(
            f"\r\n[hutch: detached; the terminal keeps running. Back: hutch shell "
            f"{sandbox_id} --attach {term.pty_id}]",
            err=True,
        )
        return
    status = 128 + term.state.signal if term.state.signal is not None else term.exit_code or 0
    raise click.exceptions.Exit(status)
