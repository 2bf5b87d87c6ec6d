"""``hutch exec``: run a command in a sandbox, streaming its output live."""

from __future__ import annotations

import sys

import click

from hutch.cli._env import get_env
from hutch.cli._output import parse_pairs
from hutch.sdk import ExecExit, ExecOutput

__all__ = ["exec_", "exit_status"]


def exit_status(exit_code: int | None, signal: int | None) -> int:
    """The shell convention: the exit code, or 128+N when signal N ended the command."""
    if signal is not None:
        return 128 + signal
    return 1 if exit_code is None else exit_code


class _ExecCommand(click.Command):
    """Everything from the command's first word on belongs to the command, as in
    ``docker exec``: ``hutch exec ID sh -e x`` passes ``-e`` to sh. Our options go
    between ID and CMD (or anywhere before an explicit ``--``)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        takes_value = {
            name
            for param in self.params
            if isinstance(param, click.Option) and not param.is_flag
            for name in (*param.opts, *param.secondary_opts)
        }
        out: list[str] = []
        positionals = 0
        i = 0
        while i < len(args):
            arg = args[i]
            if arg == "--":
                out.extend(args[i:])
                break
            if arg.startswith("-") and arg != "-":
                out.append(arg)
                if arg in takes_value and i + 1 < len(args):
                    out.append(args[i + 1])
                    i += 1
                i += 1
                continue
            positionals += 1
            if positionals == 2:  # ID was the first; this starts CMD
                out.append("--")
                out.extend(args[i:])
                break
            out.append(arg)
            i += 1
        return super().parse_args(ctx, out)


@click.command("exec", cls=_ExecCommand)
@click.argument("sandbox_id", metavar="ID")
@click.option("--env", "-e", "env", multiple=True, metavar="K=V", help="Environment (repeatable).")
@click.option("--cwd", "-w", metavar="DIR", help="Working directory in the sandbox.")
@click.option("--user", "-u", metavar="USER", help="Run as this user.")
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    metavar="S",
    help="Kill the command after S seconds (error, exit 1).",
)
@click.option(
    "--interactive",
    "-i",
    is_flag=True,
    help="Send this terminal's stdin to the command (read to the end first).",
)
@click.option(
    "--background",
    "-d",
    is_flag=True,
    help="Start CMD detached and print its pid (see hutch ps / logs / kill).",
)
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_(
    sandbox_id: str,
    env: tuple[str, ...],
    cwd: str | None,
    user: str | None,
    timeout_s: float | None,
    interactive: bool,
    background: bool,
    cmd: tuple[str, ...],
) -> None:
    """Run CMD in sandbox ID: hutch exec ID [OPTIONS] -- CMD [ARGS]...

    Output streams as it arrives; hutch exits with the command's exit code (128+N if
    signal N killed it). CMD runs directly, not through a shell: use `-- sh -c '...'`
    for pipes and globbing.
    """
    stdin: str | None = None
    if interactive:
        # The API takes stdin as one string; undecodable bytes become U+FFFD.
        stdin = sys.stdin.buffer.read().decode("utf-8", "replace")
    client = get_env().client()
    if background:
        # Imported here: only this path needs the processes API.
        from hutch.sdk import Processes

        proc = Processes(client, sandbox_id).start(
            list(cmd),
            env=parse_pairs(env, "--env"),
            cwd=cwd,
            user=user,
            stdin=stdin,
            timeout_s=timeout_s,
        )
        click.echo(proc.pid)
        return
    status = 1
    with client.exec_stream(
        sandbox_id,
        list(cmd),
        env=parse_pairs(env, "--env"),
        cwd=cwd,
        user=user,
        stdin=stdin,
        timeout_s=timeout_s,
    ) as events:
        for event in events:
            if isinstance(event, ExecOutput):
                click.echo(event.data, nl=False, err=event.stream == "stderr")
            elif isinstance(event, ExecExit):
                status = exit_status(event.exit_code, event.signal)
    raise click.exceptions.Exit(status)
