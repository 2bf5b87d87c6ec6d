"""``hutch create | ls | inspect | rm``."""

from __future__ import annotations

import click
from rich.table import Table

from hutch.cli._env import get_env, print_table, spinner
from hutch.cli._output import parse_pairs, print_json, when
from hutch.cli._placement import placement_body, placement_options
from hutch.cli.net import network_create_kwargs, network_create_options, network_rows
from hutch.cli.volumes import parse_volume_flags, volume_option
from hutch.contract.limits import (
    AUTO_DELETE_S_RANGE,
    AUTO_PAUSE_S_RANGE,
    DEFAULT_DISK_GIB,
    DEFAULT_IMAGE,
    DEFAULT_MEMORY_MIB,
    DEFAULT_VCPUS,
)
from hutch.errors import HutchError
from hutch.sdk import SandboxInfo

__all__ = ["create", "inspect", "ls", "rm", "state_label"]


def state_label(info: SandboxInfo) -> str:
    """The state as one word for tables: a paused sandbox shows its mode
    (``paused:memory``), so columns stay split by whitespace for awk."""
    if info.state == "paused" and info.pause_mode:
        return f"paused:{info.pause_mode}"
    return info.state


#: Options a snapshot decides for itself (``--snapshot`` brings its image and shape).
_FIXED_BY_SNAPSHOT = {
    "image": "--image",
    "vcpus": "--vcpus",
    "memory_mib": "--memory",
    "disk_gib": "--disk",
}


def _refuse_shape_with_snapshot(ctx: click.Context) -> None:
    given = [
        flag
        for param, flag in _FIXED_BY_SNAPSHOT.items()
        if ctx.get_parameter_source(param) is not click.core.ParameterSource.DEFAULT
    ]
    if given:
        raise click.UsageError(
            f"--snapshot brings its own image and shape; drop {', '.join(given)}", ctx=ctx
        )


@click.command()
@click.option("--image", default=DEFAULT_IMAGE, show_default=True, help="Image to boot.")
@click.option("--vcpus", type=int, default=DEFAULT_VCPUS, show_default=True)
@click.option(
    "--memory",
    "memory_mib",
    type=int,
    default=DEFAULT_MEMORY_MIB,
    show_default=True,
    metavar="MIB",
    help="Memory in MiB.",
)
@click.option(
    "--disk",
    "disk_gib",
    type=int,
    default=DEFAULT_DISK_GIB,
    show_default=True,
    metavar="GIB",
    help="Disk size in GiB.",
)
@click.option("--env", "env", multiple=True, metavar="K=V", help="Environment (repeatable).")
@click.option(
    "--env-secret",
    "env_secret",
    multiple=True,
    metavar="VAR=NAME",
    help="Environment variable VAR = secret NAME's current value in every command "
    "(repeatable; see `hutch secret`).",
)
@click.option("--metadata", multiple=True, metavar="K=V", help="Labels (repeatable).")
@click.option("--name", help="A name (lowercase letters, digits, '-').")
@click.option(
    "--timeout", "timeout_s", type=int, metavar="S", help="Destroy the sandbox after S seconds."
)
@click.option(
    "--auto-resume",
    is_flag=True,
    help="exec and file calls to it while paused resume it first (instead of failing).",
)
@click.option(
    "--snapshot",
    metavar="SNAP",
    help="Start from this snapshot (its files, processes, image and shape).",
)
@click.option(
    "--auto-pause",
    "auto_pause_s",
    type=click.IntRange(*AUTO_PAUSE_S_RANGE),
    metavar="S",
    help="Pause it (memory mode) after S idle seconds.",
)
@click.option(
    "--auto-delete",
    "auto_delete_s",
    type=click.IntRange(*AUTO_DELETE_S_RANGE),
    metavar="S",
    help="Delete it after S seconds paused.",
)
@network_create_options
@volume_option
@placement_options(strategy=True)
@click.option("--json", "as_json", is_flag=True, help="Print the sandbox as JSON.")
@click.pass_context
def create(
    ctx: click.Context,
    image: str,
    vcpus: int,
    memory_mib: int,
    disk_gib: int,
    env: tuple[str, ...],
    env_secret: tuple[str, ...],
    metadata: tuple[str, ...],
    name: str | None,
    timeout_s: int | None,
    auto_resume: bool,
    snapshot: str | None,
    auto_pause_s: int | None,
    auto_delete_s: int | None,
    network: str,
    egress: tuple[str, ...],
    egress_policy: str | None,
    join: tuple[str, ...],
    volumes: tuple[str, ...],
    host: str | None,
    labels: tuple[str, ...],
    strategy: str | None,
    as_json: bool,
) -> None:
    """Boot a sandbox and print its id."""
    mounts = parse_volume_flags(volumes)
    env_map = parse_pairs(env, "--env")
    env_secrets = parse_pairs(env_secret, "--env-secret")
    meta = parse_pairs(metadata, "--metadata")
    if snapshot is not None:
        _refuse_shape_with_snapshot(ctx)
    client = get_env().client()
    what = f"a sandbox from {snapshot}" if snapshot else f"a {image} sandbox"
    with spinner(f"booting {what}..."):
        info = client.create_sandbox(
            image,
            vcpus=vcpus,
            memory_mib=memory_mib,
            disk_gib=disk_gib,
            env=env_map,
            env_secrets=env_secrets,
            metadata=meta,
            name=name,
            timeout_s=timeout_s,
            auto_resume=auto_resume,
            snapshot=snapshot,
            auto_pause_s=auto_pause_s,
            auto_delete_s=auto_delete_s,
            **network_create_kwargs(network, egress, join, egress_policy),
            volumes=mounts or None,
            placement=placement_body(host, labels, strategy),
        )
    if as_json:
        print_json(info.to_dict())
    else:
        click.echo(info.id)


@click.command()
@click.option("--state", help="Only sandboxes in this state (default: all not destroyed).")
@click.option("--metadata", multiple=True, metavar="K=V", help="Filter (repeatable; all match).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def ls(state: str | None, metadata: tuple[str, ...], as_json: bool) -> None:
    """List sandboxes."""
    sandboxes = get_env().client().list_sandboxes(state, parse_pairs(metadata, "--metadata"))
    if as_json:
        print_json([sb.to_dict() for sb in sandboxes])
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("ID", "NAME", "IMAGE", "STATE", "VCPUS", "MEM", "CREATED"):
        table.add_column(column, no_wrap=True)
    for sb in sandboxes:
        table.add_row(
            sb.id,
            sb.name or "-",
            sb.image,
            state_label(sb),
            str(sb.vcpus),
            f"{sb.memory_mib}M",
            when(sb.created_at),
        )
    print_table(table)


def _describe(info: SandboxInfo) -> list[tuple[str, str]]:
    rows = [
        ("id", info.id),
        ("name", info.name or "-"),
        ("image", info.image),
        ("state", state_label(info)),
        ("vcpus", str(info.vcpus)),
        ("memory", f"{info.memory_mib} MiB"),
        ("disk", f"{info.disk_gib} GiB"),
        ("timeout", f"{info.timeout_s} s" if info.timeout_s else "-"),
        ("created", when(info.created_at)),
        ("started", when(info.started_at)),
        ("expires", when(info.expires_at)),
        ("ended", when(info.ended_at)),
    ]
    if info.paused_at is not None:
        rows.append(("paused", when(info.paused_at)))
    if info.parent_id is not None:
        rows.append(("parent", info.parent_id))
    if info.auto_resume:
        rows.append(("auto_resume", "yes"))
    if info.auto_pause_s is not None:
        rows.append(("auto_pause", f"{info.auto_pause_s} s idle"))
    if info.auto_delete_s is not None:
        rows.append(("auto_delete", f"{info.auto_delete_s} s paused"))
    if info.snapshot_id is not None:
        rows.append(("snapshot", info.snapshot_id))
    rows += network_rows(info)
    rows += [(f"env_secret.{k}", v) for k, v in sorted(info.env_secrets.items())]
    rows += [(f"placement.{k}", v) for k, v in sorted(info.placement_labels.items())]
    rows += [(f"metadata.{k}", v) for k, v in sorted(info.metadata.items())]
    if info.error:
        rows.append(("error", info.error))
    return rows


@click.command()
@click.argument("sandbox_id", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="Print the sandbox as JSON.")
def inspect(sandbox_id: str, as_json: bool) -> None:
    """Show one sandbox."""
    info = get_env().client().get_sandbox(sandbox_id)
    if as_json:
        print_json(info.to_dict())
        return
    width = max(len(k) for k, _ in _describe(info))
    for key, value in _describe(info):
        click.echo(f"{key + ':':<{width + 1}} {value}")


@click.command()
@click.argument("sandbox_ids", metavar="ID...", nargs=-1, required=True)
def rm(sandbox_ids: tuple[str, ...]) -> None:
    """Destroy sandboxes. Prints each id removed; fails (exit 1) if any could not be."""
    client = get_env().client()
    failed = 0
    for sandbox_id in sandbox_ids:
        try:
            client.delete_sandbox(sandbox_id)
        except HutchError as exc:
            failed += 1
            click.echo(f"error: {sandbox_id}: {exc}", err=True)
            continue
        click.echo(sandbox_id)
    if failed:
        raise click.exceptions.Exit(1)
