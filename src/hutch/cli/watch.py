"""``hutch watch ID PATH``: print file changes in a sandbox as they happen."""

from __future__ import annotations

import datetime as dt
import json

import click

from hutch.cli._env import get_env
from hutch.sdk import Files, WatchEvent

__all__ = ["watch"]


def _line(event: WatchEvent) -> str:
    when = dt.datetime.fromtimestamp(event.time).strftime("%H:%M:%S.%f")[:-3]
    path = event.path + ("/" if event.is_dir and not event.path.endswith("/") else "")
    if event.type == "renamed":
        return f"{when} renamed   {event.from_path} -> {event.to_path}"
    return f"{when} {event.type:<9} {path}"


@click.command()
@click.argument("sandbox_id", metavar="ID")
@click.argument("path", default="/root")
@click.option("--no-recursive", is_flag=True, help="Only PATH itself, not subdirectories.")
@click.option("--timeout", "timeout_s", type=float, help="Stop after this many seconds.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per event.")
def watch(
    sandbox_id: str, path: str, no_recursive: bool, timeout_s: float | None, as_json: bool
) -> None:
    """Print created, modified, deleted and renamed files under PATH (default /root)
    until Ctrl-C, --timeout, or PATH being deleted."""
    files = Files(get_env().client(), sandbox_id)
    with files.watch(path, recursive=not no_recursive, timeout_s=timeout_s) as events:
        click.echo(f"watching {sandbox_id}:{events.path} (Ctrl-C stops)", err=True)
        try:
            for event in events:
                if as_json:
                    click.echo(json.dumps(event.to_dict()))
                else:
                    click.echo(_line(event))
        except KeyboardInterrupt:
            return
