"""``hutch egress suggest | dry-run``: from what a sandbox used to a policy, and a policy
tried against what it used (its egress log), without changing anything."""

from __future__ import annotations

import json

import click
from rich.table import Table

from hutch.cli._env import get_env, print_table
from hutch.cli._output import print_json
from hutch.cli.net import _read_policy_file, egress
from hutch.sdk import Egress

__all__ = ["egress_dry_run", "egress_suggest"]


@egress.command("suggest")
@click.argument("sandbox_id", metavar="ID")
def egress_suggest(sandbox_id: str) -> None:
    """Print the smallest ordered policy allowing exactly what sandbox ID's egress log
    shows it used (JSON; run it under {"inspection": "learn"} first). Apply it with
    `hutch egress set ID --policy-file FILE` or keep it: `hutch egress policy put`."""
    print_json(Egress(get_env().client(), sandbox_id).suggest())


@egress.command("dry-run")
@click.argument("sandbox_id", metavar="ID")
@click.argument("rules", metavar="RULE...", nargs=-1)
@click.option("--policy-file", metavar="FILE", help="An ordered policy (JSON; - for stdin).")
@click.option("--policy", "policy_name", metavar="NAME", help="A named policy.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def egress_dry_run(
    sandbox_id: str,
    rules: tuple[str, ...],
    policy_file: str | None,
    policy_name: str | None,
    as_json: bool,
) -> None:
    """Decide every proxied connection and request in sandbox ID's egress log again
    under RULE..., --policy-file or --policy; nothing changes."""
    if sum([bool(rules), policy_file is not None, policy_name is not None]) != 1:
        raise click.UsageError("give the rules, --policy-file FILE or --policy NAME (one)")
    shell = Egress(get_env().client(), sandbox_id)
    if policy_file is not None:
        results = shell.dry_run(policy=_read_policy_file(policy_file))
    elif policy_name is not None:
        results = shell.dry_run(policy=policy_name)
    else:
        results = shell.dry_run(list(rules))
    if as_json:
        print_json([r.to_dict() for r in results])
        return
    table = Table("was", "would", "destination", "request", "rule")
    for r in results:
        request = f"{r.method or ''} {r.path or ''}".strip() or "-"
        table.add_row(r.was, r.would, f"{r.name}:{r.port}", request, r.rule or "default")
    print_table(table)
    click.echo(json.dumps({"would_deny": sum(r.would == "deny" for r in results)}))
