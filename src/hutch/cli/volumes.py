"""``hutch volume create | ls | inspect | grow | rm`` and ``hutch create --volume``,
plus ``hutch grow`` (a sandbox's own disk, live).

Write commands print what scripts chain on (the volume id); ``--json`` prints the API's
objects instead. Tables keep one word per column (``-`` for empty) so ``awk`` works.
"""

from __future__ import annotations

import click
from rich.table import Table

from hutch.cli._env import get_env, print_table
from hutch.cli._output import print_json, when
from hutch.contract.volumes import VolumeKind, VolumeMount, parse_volume_flag
from hutch.errors import HutchError, InvalidArgument
from hutch.sdk import VolumeInfo

__all__ = ["grow", "parse_volume_flags", "volume", "volume_option"]


def parse_volume_flags(values: tuple[str, ...]) -> list[VolumeMount]:
    """``--volume NAME:/path[:ro]`` values of ``hutch create`` (a usage error if malformed)."""
    try:
        return [parse_volume_flag(v) for v in values]
    except InvalidArgument as exc:
        raise click.BadParameter(str(exc), param_hint="--volume") from None


volume_option = click.option(
    "--volume",
    "volumes",
    multiple=True,
    metavar="NAME:/PATH[:ro]",
    help="Mount volume NAME (or id) at /PATH; ':ro' read-only (repeatable).",
)


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


@click.group()
def volume() -> None:
    """Volumes: filesystems that outlive sandboxes, mounted with `hutch create --volume`."""


@volume.command("create")
@click.argument("name")
@click.option("--size", required=True, metavar="SIZE", help="Bytes, or 512M, 1G, 2T.")
@click.option(
    "--kind",
    type=click.Choice([k.value for k in VolumeKind]),
    default=VolumeKind.EXCLUSIVE.value,
    show_default=True,
    help="exclusive: a block device on one sandbox at a time (fastest). shared: mounted "
    "by many sandboxes at once, fork children included.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the volume as JSON.")
def volume_create(name: str, size: str, kind: str, as_json: bool) -> None:
    """Create volume NAME (empty ext4 of SIZE) and print its id."""
    info = get_env().client().volumes.create(name, size, kind)
    if as_json:
        print_json(info.to_dict())
    else:
        click.echo(info.id)


@volume.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def volume_ls(as_json: bool) -> None:
    """List the project's volumes."""
    found = get_env().client().volumes.list()
    if as_json:
        print_json([v.to_dict() for v in found])
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("ID", "NAME", "KIND", "SIZE", "USED", "MOUNTED_BY", "HOST", "CREATED"):
        table.add_column(column, no_wrap=True)
    for v in found:
        users = ",".join(u.sandbox_id for u in v.mounted_by) or "-"
        table.add_row(
            v.id, v.name, v.kind, _human(v.size), _human(v.used), users, v.host or "-",
            when(v.created_at),
        )  # fmt: skip
    print_table(table)


def _rows(info: VolumeInfo) -> list[tuple[str, str]]:
    users = [f"{u.sandbox_id}:{u.path}{':ro' if u.read_only else ''}" for u in info.mounted_by]
    return [
        ("id", info.id),
        ("name", info.name),
        ("project", info.project),
        ("kind", info.kind),
        ("size", f"{info.size} ({_human(info.size)})"),
        ("used", "-" if info.used is None else f"{info.used} ({_human(info.used)})"),
        ("mounted by", ",".join(users) or "-"),
        ("host", info.host or "-"),
        ("created", when(info.created_at)),
    ]


@volume.command("inspect")
@click.argument("ref", metavar="VOLUME")
@click.option("--json", "as_json", is_flag=True, help="Print the volume as JSON.")
def volume_inspect(ref: str, as_json: bool) -> None:
    """Show VOLUME (id or name): size, bytes used, the sandboxes mounting it."""
    info = get_env().client().volumes.get(ref)
    if as_json:
        print_json(info.to_dict())
        return
    rows = _rows(info)
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key + ':':<{width + 1}} {value}")


@volume.command("grow")
@click.argument("ref", metavar="VOLUME")
@click.argument("size", metavar="SIZE")
def volume_grow(ref: str, size: str) -> None:
    """Grow VOLUME to SIZE (live if a running sandbox mounts it); prints the new size."""
    info = get_env().client().volumes.grow(ref, size)
    click.echo(info.size)


@volume.command("rm")
@click.argument("refs", metavar="VOLUME...", nargs=-1, required=True)
def volume_rm(refs: tuple[str, ...]) -> None:
    """Delete volumes and their data. Prints each removed; exit 1 if any was not.

    A volume is kept while sandboxes mount it; the error names them."""
    volumes = get_env().client().volumes
    failed = 0
    for ref in refs:
        try:
            volumes.delete(ref)
        except HutchError as exc:
            failed += 1
            click.echo(f"error: {ref}: {exc}", err=True)
            continue
        click.echo(ref)
    if failed:
        raise click.exceptions.Exit(1)


@click.command()
@click.argument("sandbox_id", metavar="ID")
@click.option("--disk", "disk_gib", type=int, required=True, metavar="GIB", help="New disk size.")
def grow(sandbox_id: str, disk_gib: int) -> None:
    """Grow running sandbox ID's own disk to GIB, live (`df /` in it sees it)."""
    info = get_env().client().grow_disk(sandbox_id, disk_gib)
    click.echo(f"{info.id} {info.disk_gib}")
