"""``hutch host ls|inspect|drain|undrain``: the hosts of a cluster (admin key)."""

from __future__ import annotations

import click
from rich.table import Table

from hutch.cli._env import get_env, print_table
from hutch.cli._output import print_json, when
from hutch.sdk import HostInfo

__all__ = ["host"]


@click.group()
def host() -> None:
    """The hosts of a cluster: capacity, use, lease; drain one (admin key)."""


def _print(info: HostInfo, as_json: bool) -> None:
    if as_json:
        print_json(info.to_dict())
        return
    labels = ",".join(f"{k}={v}" for k, v in sorted(info.labels.items())) or "-"
    for key, value in (
        ("id", info.id + (" (this host)" if info.this else "")),
        ("state", info.state + (f": {info.down_reason}" if info.down_reason else "")),
        ("address", info.address),
        ("capacity", f"{info.vcpus} vCPUs, {info.memory_mib} MiB, {info.disk_gib} GiB free"),
        ("use", f"{info.sandboxes} sandboxes ({info.running} with a VM), "
                f"{info.used_vcpus} vCPUs, {info.used_memory_mib} MiB"),
        ("accel", info.accel),
        ("qemu", info.qemu_version),
        ("cpu", info.cpu_model),
        ("labels", labels),
        ("lease until", when(info.lease_until)),
    ):  # fmt: skip
        click.echo(f"{key:<12} {value}")


@host.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def host_ls(as_json: bool) -> None:
    """List the hosts with their capacity and what they hold now."""
    found = get_env().client().hosts.list()
    if as_json:
        print_json([h.to_dict() for h in found])
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("ID", "STATE", "ADDRESS", "SANDBOXES", "VCPUS", "MEMORY MIB", "LABELS"):
        table.add_column(column, no_wrap=True)
    for h in found:
        table.add_row(
            h.id + ("*" if h.this else ""),
            h.state,
            h.address,
            f"{h.sandboxes} ({h.running} running)",
            f"{h.used_vcpus}/{h.vcpus}",
            f"{h.used_memory_mib}/{h.memory_mib}",
            ",".join(f"{k}={v}" for k, v in sorted(h.labels.items())) or "-",
        )
    print_table(table)


@host.command("inspect")
@click.argument("host_id")
@click.option("--json", "as_json", is_flag=True, help="Print the host as JSON.")
def host_inspect(host_id: str, as_json: bool) -> None:
    """Show host HOST_ID."""
    _print(get_env().client().hosts.get(host_id), as_json)


@host.command("drain")
@click.argument("host_id")
@click.option("--json", "as_json", is_flag=True, help="Print the host as JSON.")
def host_drain(host_id: str, as_json: bool) -> None:
    """HOST_ID takes no new sandboxes; each running one is paused (memory mode) and,
    with a blob store, resumed at once on another host."""
    _print(get_env().client().hosts.drain(host_id), as_json)


@host.command("undrain")
@click.argument("host_id")
@click.option("--json", "as_json", is_flag=True, help="Print the host as JSON.")
def host_undrain(host_id: str, as_json: bool) -> None:
    """HOST_ID takes new sandboxes again."""
    _print(get_env().client().hosts.undrain(host_id), as_json)
