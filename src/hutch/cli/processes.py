"""``hutch ps``, ``hutch logs``, ``hutch kill``: background processes in a sandbox.

``hutch exec --background`` starts one (see :mod:`hutch.cli.exec_cmd`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import click
from rich.table import Table

from hutch.cli._env import get_env, print_table
from hutch.cli._output import human_bytes, print_json, when
from hutch.sdk import ProcessChunk, ProcessDropped, ProcessEnd, Processes, ProcessInfo

__all__ = ["kill", "logs", "process_json", "ps"]


def process_json(info: ProcessInfo) -> dict[str, Any]:
    out = dataclasses.asdict(info)
    for key in ("started_at", "ended_at"):
        value = out[key]
        out[key] = None if value is None else value.isoformat()
    return out


def _status(info: ProcessInfo) -> str:
    if info.running:
        return "running"
    if info.timed_out:
        return "timed out"
    if info.signal is not None:
        return f"killed ({info.signal})"
    return f"exited ({info.exit_code})"


@click.command("ps")
@click.argument("sandbox_id", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def ps(sandbox_id: str, as_json: bool) -> None:
    """List the background processes of sandbox ID."""
    procs = Processes(get_env().client(), sandbox_id).list()
    if as_json:
        print_json([process_json(p.info) for p in procs])
        return
    table = Table("PID", "STATUS", "STARTED", "OUTPUT", "COMMAND", box=None)
    for p in procs:
        i = p.info
        table.add_row(
            str(i.pid),
            _status(i),
            when(i.started_at),
            human_bytes(i.output_bytes),
            " ".join(i.argv),
        )
    print_table(table)


@click.command("logs")
@click.argument("sandbox_id", metavar="ID")
@click.argument("pid", type=int)
@click.option("--follow", "-f", is_flag=True, help="Keep streaming until the process exits.")
@click.option("--offset", type=click.IntRange(min=0), default=0, help="Start at this byte.")
def logs(sandbox_id: str, pid: int, follow: bool, offset: int) -> None:
    """Print the buffered output of process PID (stderr to stderr). With -f, follow it
    live; hutch then exits with the process's status."""
    proc = Processes(get_env().client(), sandbox_id).get(pid)
    if not follow:
        out = proc.output(offset)
        if out.dropped_bytes:
            click.echo(f"[hutch: {out.dropped_bytes} older bytes were dropped]", err=True)
        click.echo(out.stdout, nl=False)
        click.echo(out.stderr, nl=False, err=True)
        return
    status = 0
    with proc.stream(offset) as events:
        for event in events:
            if isinstance(event, ProcessChunk):
                click.echo(event.data, nl=False, err=event.stream == "stderr")
            elif isinstance(event, ProcessDropped):
                click.echo(f"\n[hutch: {event.bytes} bytes dropped]", err=True)
            elif isinstance(event, ProcessEnd):
                i = event.process
                status = 128 + i.signal if i.signal is not None else (i.exit_code or 0)
    raise click.exceptions.Exit(status)


@click.command("kill")
@click.argument("sandbox_id", metavar="ID")
@click.argument("pid", type=int)
@click.option(
    "--signal", "-s", "sig", metavar="SIG", help="Send SIG (TERM, INT, 9...) instead of KILL."
)
def kill(sandbox_id: str, pid: int, sig: str | None) -> None:
    """Kill background process PID (its whole process group)."""
    proc = Processes(get_env().client(), sandbox_id).get(pid)
    info = proc.kill() if sig is None else proc.signal(int(sig) if sig.isdigit() else sig)
    if info.running:  # a signal is asynchronous: give it a moment to take effect
        info = proc.wait(timeout_s=5)
    click.echo(f"{info.pid}: {_status(info)}")
