"""``hutch usage`` (metered usage and cost) and ``hutch events`` (a sandbox's trace)."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime

import click
from rich.table import Table

from hutch.cli._env import get_env, print_table
from hutch.cli._output import print_json
from hutch.sdk import Event, UsageRow

__all__ = ["events", "usage"]


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.4f}"


def _row(row: UsageRow) -> list[str]:
    storage = row.disk_gb_hours + row.snapshot_gb_hours + row.image_gb_hours
    return [
        row.key,
        _hours(row.vcpu_seconds),
        _hours(row.memory_gib_seconds),
        _hours(row.paused_memory_gib_seconds),
        f"{storage:.4f}",
        f"{row.cost_usd:.6f}",
    ]


@click.command("usage")
@click.option(
    "--from", "start", metavar="TIME", help="Epoch seconds or ISO 8601 [default: this UTC month]."
)
@click.option("--to", "end", metavar="TIME", help="Epoch seconds or ISO 8601 [default: now].")
@click.option(
    "--by",
    "group_by",
    type=click.Choice(["sandbox", "day", "project"]),
    default="sandbox",
    show_default=True,
    help="Group rows by (project: the admin key only).",
)
@click.option("--project", metavar="NAME", help="Another project (the admin key only).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def usage(
    start: str | None, end: str | None, group_by: str, project: str | None, as_json: bool
) -> None:
    """Metered usage (per second) and its cost."""
    report = get_env().client().usage(start, end, group_by=group_by, project=project)
    if as_json:
        print_json(dataclasses.asdict(report))
        return
    table = Table(
        group_by.upper(), "VCPU-H", "MEM GIB-H", "PAUSED GIB-H", "STORAGE GB-H", "COST USD",
        box=None,
    )  # fmt: skip
    for row in report.rows:
        table.add_row(*_row(row))
    table.add_row(*_row(report.total))
    print_table(table)


def _line(e: Event) -> str:
    at = datetime.fromtimestamp(e.at, UTC).strftime("%Y-%m-%d %H:%M:%S")
    who = e.actor or "hutchd"
    data = " ".join(f"{k}={json.dumps(v)}" for k, v in e.data.items())
    return f"{e.seq:>6} {at} {e.type:<17} {who:<8} {data}".rstrip()


@click.command("events")
@click.argument("sandbox_id", metavar="ID")
@click.option(
    "--type", "types", multiple=True, metavar="TYPE", help="Only these (sandbox.exec, sandbox.*)."
)
@click.option("--after", type=int, default=0, help="Only events after this seq.")
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True)
@click.option(
    "-f",
    "--follow",
    is_flag=True,
    help="Keep printing events as they happen, until the sandbox ends.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object a line.")
def events(
    sandbox_id: str,
    types: tuple[str, ...],
    after: int,
    limit: int,
    follow: bool,
    as_json: bool,
) -> None:
    """The trace of sandbox ID: created, started, execs, files, pauses, deletion."""
    client = get_env().client()

    def show(e: Event) -> None:
        click.echo(json.dumps(dataclasses.asdict(e)) if as_json else _line(e))

    if follow:
        with client.follow_events(sandbox_id, types=list(types) or None, after=after) as stream:
            for event in stream:
                show(event)
        return
    page = client.sandbox_events(sandbox_id, types=list(types) or None, after=after, limit=limit)
    for event in page.events:
        show(event)
