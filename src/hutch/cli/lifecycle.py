"""``hutch pause | resume | fork``: the long lifecycle calls, with a spinner on a terminal.

Each prints ids on stdout (one per line) so scripts can chain them
(``hutch fork ID --count 3 | xargs -n1 hutch exec ...``); ``--json`` prints the
sandbox objects instead, as the API returns them.
"""

from __future__ import annotations

import click

from hutch.cli._env import get_env, spinner
from hutch.cli._output import print_json
from hutch.cli._placement import placement_body, placement_options
from hutch.contract.enums import DEFAULT_PAUSE_MODE, PauseMode
from hutch.contract.limits import DEFAULT_FORK_COUNT, FORK_COUNT_RANGE
from hutch.sdk import SandboxInfo

__all__ = ["fork", "pause", "resume"]


def _report(info: SandboxInfo, as_json: bool) -> None:
    if as_json:
        print_json(info.to_dict())
    else:
        click.echo(info.id)


@click.command()
@click.argument("sandbox_id", metavar="ID")
@click.option(
    "--mode",
    type=click.Choice([m.value for m in PauseMode]),
    default=DEFAULT_PAUSE_MODE.value,
    show_default=True,
    help="memory: processes carry on after resume; disk: keep only the disk (boots again).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the paused sandbox as JSON.")
def pause(sandbox_id: str, mode: str, as_json: bool) -> None:
    """Pause sandbox ID (it must be running) and print its id."""
    client = get_env().client()
    with spinner(f"pausing {sandbox_id} ({mode})..."):
        info = client.pause_sandbox(sandbox_id, PauseMode(mode))
    _report(info, as_json)


@click.command()
@click.argument("sandbox_id", metavar="ID")
@placement_options(strategy=False)
@click.option("--json", "as_json", is_flag=True, help="Print the resumed sandbox as JSON.")
def resume(sandbox_id: str, host: str | None, labels: tuple[str, ...], as_json: bool) -> None:
    """Resume paused sandbox ID and print its id (a running one is left as it is).

    In a cluster, --host/--label resume it on another host than the one it paused on
    (its pause comes through the blob store)."""
    placement = placement_body(host, labels)
    client = get_env().client()
    where = f" on {host}" if host else ""
    with spinner(f"resuming {sandbox_id}{where}..."):
        info = client.resume_sandbox(sandbox_id, placement)
    _report(info, as_json)


@click.command()
@click.argument("sandbox_id", metavar="ID")
@click.option(
    "--count",
    "-n",
    type=click.IntRange(*FORK_COUNT_RANGE),
    default=DEFAULT_FORK_COUNT,
    show_default=True,
    help="How many children to make.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of the children.")
def fork(sandbox_id: str, count: int, as_json: bool) -> None:
    """Fork sandbox ID into COUNT copies of it as it is now; print the children's ids,
    one per line. ID itself is left running or paused as it was."""
    client = get_env().client()
    noun = "sandbox" if count == 1 else "sandboxes"
    with spinner(f"forking {sandbox_id} into {count} {noun}..."):
        children = client.fork_sandbox(sandbox_id, count)
    if as_json:
        print_json([child.to_dict() for child in children])
        return
    for child in children:
        click.echo(child.id)
