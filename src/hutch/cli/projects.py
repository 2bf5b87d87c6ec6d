"""``hutch project create|ls|inspect|rm|quota`` and ``hutch key create|ls|revoke``.

``key create`` prints the new key's secret on stdout (once: the daemon keeps only its
hash), so ``export HUTCH_API_KEY="$(hutch key create ci --role developer)"`` works.
"""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table

from hutch.cli._env import get_env, print_table
from hutch.cli._output import human_bytes, print_json, when
from hutch.sdk import KeyInfo, ProjectInfo

__all__ = ["key", "project"]

ROLES = ("owner", "developer", "operator", "viewer")
_QUOTA_OPTIONS = (
    ("--max-sandboxes", "max_sandboxes", "Live sandboxes (paused ones count)."),
    ("--max-vcpus", "max_vcpus", "vCPUs of running (and starting) sandboxes."),
    ("--max-memory-mib", "max_memory_mib", "MiB of memory of running sandboxes."),
    ("--max-snapshot-bytes", "max_snapshot_bytes", "Bytes of named snapshots."),
)


def _quota_options(command: Any) -> Any:
    for flag, dest, text in reversed(_QUOTA_OPTIONS):
        command = click.option(flag, dest, type=str, default=None, help=text + " 'none' lifts it.")(
            command
        )
    return command


def _quotas(values: dict[str, str | None]) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for name, raw in values.items():
        if raw is None:
            continue
        if raw.lower() in ("none", "unlimited"):
            out[name] = None
            continue
        try:
            out[name] = int(raw)
        except ValueError:
            raise click.BadParameter(f"{raw!r} is not a whole number or 'none'") from None
    return out


def _limit(value: int | None) -> str:
    return "-" if value is None else str(value)


def _describe(info: ProjectInfo) -> list[tuple[str, str]]:
    rows = [("name", info.name), ("created", when(info.created_at))]
    for quota, _, _ in _QUOTA_OPTIONS:
        name = quota.removeprefix("--").replace("-", "_")
        used = info.usage.get(name.removeprefix("max_"), 0)
        shown = human_bytes(used) if name == "max_snapshot_bytes" else str(used)
        rows.append((name, f"{shown} used of {_limit(info.quotas.get(name))}"))
    return rows


@click.group()
def project() -> None:
    """Projects and their quotas (create, rm and quota need the admin key)."""


@project.command("create")
@click.argument("name")
@_quota_options
@click.option("--json", "as_json", is_flag=True, help="Print the project as JSON.")
def create_project(name: str, as_json: bool, **quotas: str | None) -> None:
    """Create project NAME (1-63 lowercase letters, digits and '-')."""
    info = get_env().client().projects.create(name, _quotas(quotas))
    if as_json:
        print_json(info.to_dict())
    else:
        click.echo(info.name)


@project.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def ls_projects(as_json: bool) -> None:
    """List projects (a project key sees its own)."""
    found = get_env().client().projects.list()
    if as_json:
        print_json([p.to_dict() for p in found])
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("NAME", "SANDBOXES", "VCPUS", "MEMORY_MIB", "CREATED"):
        table.add_column(column, no_wrap=True)
    for p in found:
        table.add_row(
            p.name,
            f"{p.usage.get('sandboxes', 0)}/{_limit(p.quotas['max_sandboxes'])}",
            f"{p.usage.get('vcpus', 0)}/{_limit(p.quotas['max_vcpus'])}",
            f"{p.usage.get('memory_mib', 0)}/{_limit(p.quotas['max_memory_mib'])}",
            when(p.created_at),
        )
    print_table(table)


@project.command("inspect")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def inspect_project(name: str, as_json: bool) -> None:
    """Show project NAME: its quotas and what it uses."""
    info = get_env().client().projects.get(name)
    if as_json:
        print_json(info.to_dict())
        return
    for field, value in _describe(info):
        click.echo(f"{field + ':':<20} {value}")


@project.command("rm")
@click.argument("name")
def rm_project(name: str) -> None:
    """Delete project NAME (refused while it holds anything; 'default' never)."""
    get_env().client().projects.delete(name)
    click.echo(name)


@project.command("quota")
@click.argument("name")
@_quota_options
@click.option("--json", "as_json", is_flag=True, help="Print the project as JSON.")
def quota(name: str, as_json: bool, **quotas: str | None) -> None:
    """Change the quotas of project NAME (only those given); print them."""
    client = get_env().client()
    changes = _quotas(quotas)
    info = client.projects.set_quotas(name, **changes) if changes else client.projects.get(name)
    if as_json:
        print_json(info.to_dict())
        return
    for field, value in _describe(info):
        click.echo(f"{field + ':':<20} {value}")


@click.group()
def key() -> None:
    """API keys of a project (its owner or the admin key). --project defaults to the
    client's project (--project / HUTCH_PROJECT), else default."""


def _project_option(command: Any) -> Any:
    return click.option("--project", "-p", "proj", metavar="NAME", help="The project.")(command)


@key.command("create")
@click.argument("name")
@click.option("--role", type=click.Choice(ROLES), required=True, help="What the key may do.")
@click.option("--ttl", "ttl_s", type=click.IntRange(min=1), help="Expire after this many seconds.")
@_project_option
@click.option("--json", "as_json", is_flag=True, help="Print the key (with its secret) as JSON.")
def create_key(name: str, role: str, ttl_s: int | None, proj: str | None, as_json: bool) -> None:
    """Create key NAME and print its secret (shown this once)."""
    created = get_env().client().keys.create(name, role, project=proj, ttl_s=ttl_s)
    if as_json:
        print_json({**created.to_dict(), "secret": created.secret})
    else:
        click.echo(created.secret)


@key.command("ls")
@_project_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def ls_keys(proj: str | None, as_json: bool) -> None:
    """List the project's keys (never their secrets)."""
    found: list[KeyInfo] = get_env().client().keys.list(project=proj)
    if as_json:
        print_json([k.to_dict() for k in found])
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("ID", "NAME", "ROLE", "CREATED", "EXPIRES", "LAST_USED", "STATE"):
        table.add_column(column, no_wrap=True)
    for k in found:
        state = "revoked" if k.revoked_at else "active"
        table.add_row(
            k.id,
            k.name,
            k.role,
            when(k.created_at),
            when(k.expires_at) if k.expires_at else "-",
            when(k.last_used_at) if k.last_used_at else "-",
            state,
        )
    print_table(table)


@key.command("revoke")
@click.argument("key_id", metavar="ID")
@_project_option
def revoke_key(key_id: str, proj: str | None) -> None:
    """Revoke key ID: refused from its next request on."""
    get_env().client().keys.revoke(key_id, project=proj)
    click.echo(key_id)
