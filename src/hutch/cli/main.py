"""``hutch``: the command line, built on the SDK only.

Two commands run local code by design: ``hutch daemon`` (it *is* the daemon) and
``hutch image build`` (the host-side builder); both import it lazily so every other
command starts fast and needs nothing but the SDK.

Exit status: 0 ok; 1 a hutch error (printed as ``error: <message>`` on stderr); 2 a
usage error; ``hutch exec`` passes on the command's own status.
"""

from __future__ import annotations

from typing import Any

import click

from hutch.cli import egress_learn  # noqa: F401  (registers egress suggest, dry-run)
from hutch.cli._env import CliEnv, get_env
from hutch.cli._output import print_json
from hutch.cli.code import run_code
from hutch.cli.cp import cp
from hutch.cli.exec_cmd import exec_
from hutch.cli.hosts import host
from hutch.cli.images import image, images
from hutch.cli.lifecycle import fork, pause, resume
from hutch.cli.mcp_cmd import mcp
from hutch.cli.net import egress, network, port
from hutch.cli.processes import kill, logs, ps
from hutch.cli.projects import key, project
from hutch.cli.sandboxes import create, inspect, ls, rm
from hutch.cli.secrets import secret
from hutch.cli.shell import shell
from hutch.cli.snapshots import snapshot
from hutch.cli.usage import events, usage
from hutch.cli.volumes import grow, volume
from hutch.cli.watch import watch
from hutch.errors import HutchError
from hutch.sdk import DaemonUnreachable
from hutch.version import __version__

__all__ = ["cli", "daemon_main", "main"]


class _HutchGroup(click.Group):
    """Turns hutch errors into ``error: <message>`` and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except HutchError as exc:
            click.echo(f"error: {exc}", err=True)
            raise click.exceptions.Exit(1) from exc


@click.group(cls=_HutchGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--url",
    envvar="HUTCH_URL",
    metavar="URL",
    help="Daemon URL [env HUTCH_URL; default http://127.0.0.1:7070].",
)
@click.option(
    "--api-key",
    metavar="KEY",
    help="API key [env HUTCH_API_KEY; default the file $HUTCH_STATE_DIR/api-key].",
)
@click.option(
    "--project",
    metavar="NAME",
    help="Project to act in [env HUTCH_PROJECT; admin key default: default].",
)
@click.pass_context
def cli(ctx: click.Context, url: str | None, api_key: str | None, project: str | None) -> None:
    """hutch: micro-VM sandboxes for code written by AI agents."""
    env = ctx.ensure_object(CliEnv)
    env.url = url or env.url
    env.api_key = api_key or env.api_key
    env.project = project or env.project


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def version(as_json: bool) -> None:
    """Print the client's version and, if it answers, the daemon's."""
    env = get_env()
    try:
        health = env.client().health()
    except DaemonUnreachable:
        health = None
    if as_json:
        print_json({"client": __version__, "daemon": health.raw if health else None})
        return
    click.echo(f"hutch {__version__}")
    url = env.client().base_url
    if health is None:
        click.echo(f"daemon: not reachable at {url}")
    else:
        click.echo(f"daemon: hutchd {health.version} at {url} (accel {health.accel or '?'})")


@cli.command()
def daemon() -> None:
    """Run the daemon in the foreground (Ctrl-C stops it; sandboxes keep running)."""
    _run_daemon()


def _run_daemon() -> None:
    # Imported here: the daemon pulls in FastAPI, uvicorn and the VM layer.
    from hutch.config import load_settings
    from hutch.daemon import run

    run(load_settings())


for _command in (
    create,
    ls,
    inspect,
    rm,
    pause,
    resume,
    fork,
    snapshot,
    exec_,
    cp,
    watch,
    run_code,
    images,
    image,
    mcp,
    egress,
    port,
    network,
    volume,
    grow,
    secret,
    shell,
    ps,
    logs,
    kill,
    usage,
    events,
    project,
    key,
    host,
):
    cli.add_command(_command)


def main() -> None:
    """Entry point of the ``hutch`` script."""
    cli(prog_name="hutch")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
def _hutchd() -> None:
    """hutchd: the hutch daemon, in the foreground. Settings: HUTCH_* env, config.toml."""
    try:
        _run_daemon()
    except HutchError as exc:
        click.echo(f"error: {exc}", err=True)
        raise click.exceptions.Exit(1) from exc


def daemon_main() -> None:
    """Entry point of the ``hutchd`` script."""
    _hutchd(prog_name="hutchd")
