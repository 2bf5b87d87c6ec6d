"""``hutch snapshot create | ls | inspect | rm``: named snapshots of sandboxes.

``create`` prints the new snapshot's id on stdout so scripts can chain it
(``hutch create --snapshot "$(hutch snapshot create ID warm)"``); ``--json`` prints the
snapshot objects instead, as the API returns them.
"""

from __future__ import annotations

import click
from rich.table import Table

from hutch.cli._env import get_env, print_table, spinner
from hutch.cli._output import human_bytes, print_json, when
from hutch.errors import HutchError
from hutch.sdk import SnapshotInfo

__all__ = ["snapshot"]


@click.group()
def snapshot() -> None:
    """Named snapshots: save a sandbox, start new ones from it (create --snapshot)."""


@snapshot.command("create")
@click.argument("sandbox_id", metavar="ID")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the snapshot as JSON.")
def create_snapshot(sandbox_id: str, name: str, as_json: bool) -> None:
    """Save sandbox ID (memory, processes, disk) as NAME and print the snapshot id.

    NAME: 1-63 lowercase letters, digits and '-'. ID must be running or paused; it is
    left as it was."""
    client = get_env().client()
    with spinner(f"snapshotting {sandbox_id} as {name}..."):
        info = client.create_snapshot(sandbox_id, name)
    if as_json:
        print_json(info.to_dict())
    else:
        click.echo(info.id)


@snapshot.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def ls_snapshots(as_json: bool) -> None:
    """List snapshots."""
    found = get_env().client().list_snapshots()
    if as_json:
        print_json([s.to_dict() for s in found])
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("ID", "NAME", "SANDBOX", "IMAGE", "SIZE", "CREATED"):
        table.add_column(column, no_wrap=True)
    for snap in found:
        table.add_row(
            snap.id,
            snap.name,
            snap.sandbox_id,
            snap.image,
            # No space inside the size, so columns stay split by whitespace for awk.
            human_bytes(snap.size_bytes).replace(" ", ""),
            when(snap.created_at),
        )
    print_table(table)


def _describe(info: SnapshotInfo) -> list[tuple[str, str]]:
    return [
        ("id", info.id),
        ("name", info.name),
        ("sandbox", info.sandbox_id),
        ("image", info.image),
        ("vcpus", str(info.vcpus)),
        ("memory", f"{info.memory_mib} MiB"),
        ("disk", f"{info.disk_gib} GiB"),
        ("size", human_bytes(info.size_bytes)),
        ("created", when(info.created_at)),
    ]


@snapshot.command("inspect")
@click.argument("snapshot_id", metavar="SNAP")
@click.option("--json", "as_json", is_flag=True, help="Print the snapshot as JSON.")
def inspect_snapshot(snapshot_id: str, as_json: bool) -> None:
    """Show one snapshot."""
    info = get_env().client().get_snapshot(snapshot_id)
    if as_json:
        print_json(info.to_dict())
        return
    rows = _describe(info)
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key + ':':<{width + 1}} {value}")


@snapshot.command("rm")
@click.argument("snapshot_ids", metavar="SNAP...", nargs=-1, required=True)
def rm_snapshots(snapshot_ids: tuple[str, ...]) -> None:
    """Delete snapshots. Prints each id removed; fails (exit 1) if any could not be.

    Any order works: sandboxes and snapshots built on one run on and stay usable; its
    space is freed once nothing is built on it any more."""
    client = get_env().client()
    failed = 0
    for snapshot_id in snapshot_ids:
        try:
            client.delete_snapshot(snapshot_id)
        except HutchError as exc:
            failed += 1
            click.echo(f"error: {snapshot_id}: {exc}", err=True)
            continue
        click.echo(snapshot_id)
    if failed:
        raise click.exceptions.Exit(1)
