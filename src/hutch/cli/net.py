"""``hutch egress | port | network``: a sandbox's outbound rules, its exposed ports and
private networks; plus the networking options of ``hutch create`` and rows of
``hutch inspect``.

Write commands print what scripts chain on (a URL, a network id); ``--json`` prints the
API's objects instead. Tables keep one word per column (``-`` for empty) so ``awk``
works, except the egress log's last column (the reason, in words).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.table import Table

from hutch.cli._env import get_env, print_table
from hutch.cli._output import print_json, when
from hutch.contract.enums import DEFAULT_NETWORK_MODE, NetworkMode
from hutch.contract.limits import DEFAULT_EGRESS_LOG_LIMIT, EGRESS_LOG_MAX, PORT_RANGE
from hutch.errors import HutchError
from hutch.sdk import (
    Egress,
    EgressInfo,
    EgressPolicies,
    NamedPolicyInfo,
    NetworkInfo,
    Ports,
    SandboxInfo,
    SandboxNetworks,
)

__all__ = [
    "egress",
    "network",
    "network_create_kwargs",
    "network_create_options",
    "network_rows",
    "port",
]

F = TypeVar("F", bound=Callable[..., Any])


def _report_each(items: Sequence[str], action: Callable[[str], None]) -> None:
    """Run ``action`` on each item; print each done, report each failure, exit 1 if any."""
    failed = 0
    for item in items:
        try:
            action(item)
        except HutchError as exc:
            failed += 1
            click.echo(f"error: {item}: {exc}", err=True)
            continue
        click.echo(item)
    if failed:
        raise click.exceptions.Exit(1)


# -- hutch create / inspect -----------------------------------------------------------


def network_create_options(command: F) -> F:
    """The networking options of ``hutch create``."""
    options = (
        click.option(
            "--network",
            "network",
            type=click.Choice([m.value for m in NetworkMode]),
            default=DEFAULT_NETWORK_MODE.value,
            show_default=True,
            help="default: an address and NAT, filtered by --egress; none: no network.",
        ),
        click.option(
            "--egress",
            "egress",
            multiple=True,
            metavar="RULE",
            help="Egress rule (repeatable): host, host:port, *.host, ip[:port], cidr[:port], "
            "or deny-all. Any rule denies everything it does not match.",
        ),
        click.option(
            "--egress-policy",
            "egress_policy",
            metavar="NAME",
            help="Start with a copy of this named egress policy (hutch egress policy list).",
        ),
        click.option(
            "--join",
            "join",
            multiple=True,
            metavar="NET",
            help="Join this private network, by id or name (repeatable).",
        ),
    )
    for option in reversed(options):
        command = option(command)
    return command


def network_create_kwargs(
    network: str,
    egress: tuple[str, ...],
    join: tuple[str, ...],
    egress_policy: str | None = None,
) -> dict[str, Any]:
    """``create_sandbox`` keyword arguments from the options above."""
    out: dict[str, Any] = {
        "network": network,
        "egress": list(egress) or None,
        "networks": list(join),
    }
    if egress_policy is not None:
        out["egress_policy"] = egress_policy
    return out


def network_rows(info: SandboxInfo) -> list[tuple[str, str]]:
    """``hutch inspect`` rows for the sandbox's network (none from an older daemon)."""
    if info.network is None:
        return []
    rows = [("network", info.network.mode), ("address", info.network.address or "-")]
    if info.network.networks:
        rows.append(("networks", ",".join(info.network.networks)))
    return rows


def _echo_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key + ':':<{width + 1}} {value}")


# -- hutch egress ---------------------------------------------------------------------


@click.group()
def egress() -> None:
    """A sandbox's outbound rules (enforced on the host), counters and decision log."""


def _show_egress(info: EgressInfo, as_json: bool) -> None:
    if as_json:
        print_json(info.to_dict())
        return
    if info.policy is not None:  # an ordered policy: one row per rule, in order
        _echo_rows(
            [("mode", info.mode), ("policy", f"inspection {info.policy.get('inspection')}")]
            + [("rule", line) for line in info.rules]
            + [
                ("allowed", str(info.allowed)),
                ("denied", str(info.denied)),
                ("rate_limited", str(info.rate_limited)),
                ("log_dropped", str(info.log_dropped)),
            ]
        )
        return
    _echo_rows(
        [
            ("mode", info.mode),
            ("rules", ",".join(info.rules) or "-"),
            ("allowed", str(info.allowed)),
            ("denied", str(info.denied)),
            ("rate_limited", str(info.rate_limited)),
            ("log_dropped", str(info.log_dropped)),
        ]
    )


@egress.command("get")
@click.argument("sandbox_id", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="Print the rules as JSON.")
def egress_get(sandbox_id: str, as_json: bool) -> None:
    """Show the rules of sandbox ID, the mode they make and the counters.

    Mode open: no rules, everything but the always-denied set may leave; rules: only
    what a rule matches; deny-all: nothing."""
    _show_egress(Egress(get_env().client(), sandbox_id).get(), as_json)


def _read_policy_file(path: str) -> dict[str, Any]:
    """A policy document from a JSON file (``-``: standard input)."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise click.UsageError(f"cannot read the policy file {path}: {exc}") from exc
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise click.UsageError(f"the policy file {path} is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise click.UsageError(
            f'the policy file {path} must hold one JSON object {{"default", "rules": [...]}}'
        )
    return doc


@egress.command("set")
@click.argument("sandbox_id", metavar="ID")
@click.argument("rules", metavar="RULE...", nargs=-1)
@click.option("--clear", is_flag=True, help="Remove every rule (open egress).")
@click.option(
    "--policy-file",
    metavar="FILE",
    help="Set an ordered policy from this JSON file (- for standard input).",
)
@click.option("--policy", "policy_name", metavar="NAME", help="Set a copy of this named policy.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def egress_set(
    sandbox_id: str,
    rules: tuple[str, ...],
    clear: bool,
    policy_file: str | None,
    policy_name: str | None,
    as_json: bool,
) -> None:
    """Replace the rules of sandbox ID; they apply at once, open connections included.

    RULE: host, host:port, *.host (subdomains, not the apex), ip, ip:port, cidr,
    cidr:port ([v6]:port for IPv6), or deny-all alone. Or an ordered policy
    (--policy-file: {"default": "deny", "rules": [{"action": "allow", "host":
    "pypi.org:443"}]}, first match wins) or a named one (--policy). An invalid rule
    rejects the whole request and the old rules stay."""
    given = [bool(rules), clear, policy_file is not None, policy_name is not None]
    if sum(given) != 1:
        raise click.UsageError(
            "give the rules to set, --clear, --policy-file FILE or --policy NAME (one of them)"
        )
    shell = Egress(get_env().client(), sandbox_id)
    if policy_file is not None:
        info = shell.set(policy=_read_policy_file(policy_file))
    elif policy_name is not None:
        info = shell.set(policy=policy_name)
    else:
        info = shell.set(list(rules))
    _show_egress(info, as_json)


@egress.group("policy")
def egress_policy() -> None:
    """Named egress policies of the project, reusable at create (--egress-policy) and by
    `hutch egress set ID --policy NAME`. A sandbox gets a copy."""


def _show_named(info: NamedPolicyInfo, as_json: bool) -> None:
    if as_json:
        print_json(info.to_dict())
        return
    click.echo(json.dumps(info.policy, indent=2))


@egress_policy.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def policy_list(as_json: bool) -> None:
    """The named policies: NAME, DEFAULT, INSPECTION, RULES (how many), UPDATED."""
    found = EgressPolicies(get_env().client()).list()
    if as_json:
        print_json([p.to_dict() for p in found])
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("NAME", "DEFAULT", "INSPECTION", "RULES", "UPDATED"):
        table.add_column(column, no_wrap=True)
    for p in found:
        table.add_row(
            p.name,
            str(p.policy.get("default")),
            str(p.policy.get("inspection")),
            str(len(p.policy.get("rules", []))),
            when(p.updated_at).replace(" ", "T"),
        )
    print_table(table)


@egress_policy.command("get")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the API object as JSON.")
def policy_get(name: str, as_json: bool) -> None:
    """Print the policy document of NAME (the form `put` takes)."""
    _show_named(EgressPolicies(get_env().client()).get(name), as_json)


@egress_policy.command("put")
@click.argument("name")
@click.argument("file", metavar="FILE")
@click.option("--json", "as_json", is_flag=True, help="Print the API object as JSON.")
def policy_put(name: str, file: str, as_json: bool) -> None:
    """Create or replace NAME from a JSON policy FILE (- for standard input)."""
    _show_named(EgressPolicies(get_env().client()).put(name, _read_policy_file(file)), as_json)


@egress_policy.command("delete")
@click.argument("names", metavar="NAME...", nargs=-1, required=True)
def policy_delete(names: tuple[str, ...]) -> None:
    """Delete named policies (sandboxes keep their copies); prints each name deleted."""
    policies = EgressPolicies(get_env().client())
    _report_each(names, policies.delete)


@egress.command("log")
@click.argument("sandbox_id", metavar="ID")
@click.option(
    "--limit",
    type=click.IntRange(1, EGRESS_LOG_MAX),
    default=DEFAULT_EGRESS_LOG_LIMIT,
    show_default=True,
    help="Show at most this many, the newest.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def egress_log(sandbox_id: str, limit: int, as_json: bool) -> None:
    """Recent egress decisions of sandbox ID, oldest first."""
    events = Egress(get_env().client(), sandbox_id).log(limit)
    if as_json:
        print_json([e.to_dict() for e in events])
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    columns = ("TIME", "VERDICT", "PROTO", "DESTINATION", "PORT", "NAME", "RULE", "REASON")
    for column in columns:
        table.add_column(column, no_wrap=True)
    for e in events:
        table.add_row(
            # One word: date and time joined, so the columns stay split by whitespace.
            when(e.time).replace(" ", "T"),
            e.verdict,
            e.protocol,
            e.destination,
            "-" if e.port is None else str(e.port),
            e.name or "-",
            e.rule or "-",
            e.reason,
        )
    print_table(table)


# -- hutch port -----------------------------------------------------------------------


@click.group()
def port() -> None:
    """Guest ports reachable from the host (inbound is closed until exposed)."""


@port.command("expose")
@click.argument("sandbox_id", metavar="ID")
@click.argument("guest_port", metavar="PORT", type=click.IntRange(*PORT_RANGE))
@click.option("--json", "as_json", is_flag=True, help="Print the port as JSON.")
def port_expose(sandbox_id: str, guest_port: int, as_json: bool) -> None:
    """Expose PORT of sandbox ID through a host-side proxy and print its URL."""
    info = Ports(get_env().client(), sandbox_id).expose(guest_port)
    if as_json:
        print_json(info.to_dict())
    else:
        click.echo(info.url)


@port.command("ls")
@click.argument("sandbox_id", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def port_ls(sandbox_id: str, as_json: bool) -> None:
    """List the exposed ports of sandbox ID."""
    found = Ports(get_env().client(), sandbox_id).list()
    if as_json:
        print_json([p.to_dict() for p in found])
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("PORT", "HOST", "HOST_PORT", "URL"):
        table.add_column(column, no_wrap=True)
    for p in found:
        table.add_row(str(p.port), p.host, str(p.host_port), p.url)
    print_table(table)


@port.command("close")
@click.argument("sandbox_id", metavar="ID")
@click.argument(
    "ports", metavar="PORT...", nargs=-1, required=True, type=click.IntRange(*PORT_RANGE)
)
def port_close(sandbox_id: str, ports: tuple[int, ...]) -> None:
    """Stop forwarding ports of sandbox ID. Prints each closed; exit 1 if any was not."""
    accessor = Ports(get_env().client(), sandbox_id)
    _report_each([str(p) for p in ports], lambda p: accessor.close(int(p)))


# -- hutch network --------------------------------------------------------------------


@click.group()
def network() -> None:
    """Private networks: sandboxes on one reach each other by name."""


@network.command("create")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the network as JSON.")
def network_create(name: str, as_json: bool) -> None:
    """Create network NAME and print its id. NAME: 1-63 lowercase letters, digits, '-'."""
    info = get_env().client().networks.create(name)
    if as_json:
        print_json(info.to_dict())
    else:
        click.echo(info.id)


@network.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def network_ls(as_json: bool) -> None:
    """List networks."""
    found = get_env().client().networks.list()
    if as_json:
        print_json([n.to_dict() for n in found])
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("ID", "NAME", "MEMBERS", "CREATED"):
        table.add_column(column, no_wrap=True)
    for n in found:
        table.add_row(n.id, n.name, ",".join(n.members) or "-", when(n.created_at))
    print_table(table)


def _describe_network(info: NetworkInfo) -> list[tuple[str, str]]:
    return [
        ("id", info.id),
        ("name", info.name),
        ("members", ",".join(info.members) or "-"),
        ("created", when(info.created_at)),
    ]


@network.command("inspect")
@click.argument("network_ref", metavar="NET")
@click.option("--json", "as_json", is_flag=True, help="Print the network as JSON.")
def network_inspect(network_ref: str, as_json: bool) -> None:
    """Show network NET (id or name)."""
    info = get_env().client().networks.get(network_ref)
    if as_json:
        print_json(info.to_dict())
    else:
        _echo_rows(_describe_network(info))


@network.command("rm")
@click.argument("network_refs", metavar="NET...", nargs=-1, required=True)
def network_rm(network_refs: tuple[str, ...]) -> None:
    """Delete networks (id or name). Prints each removed; exit 1 if any was not.

    A network is kept while sandboxes are on it; the error names them."""
    networks = get_env().client().networks
    _report_each(network_refs, networks.delete)


@network.command("join")
@click.argument("sandbox_id", metavar="ID")
@click.argument("network_ref", metavar="NET")
@click.option("--json", "as_json", is_flag=True, help="Print the network as JSON.")
def network_join(sandbox_id: str, network_ref: str, as_json: bool) -> None:
    """Put sandbox ID on network NET (id or name); prints the network id."""
    info = SandboxNetworks(get_env().client(), sandbox_id).join(network_ref)
    if as_json:
        print_json(info.to_dict())
    else:
        click.echo(info.id)


@network.command("leave")
@click.argument("sandbox_id", metavar="ID")
@click.argument("network_ref", metavar="NET")
def network_leave(sandbox_id: str, network_ref: str) -> None:
    """Take sandbox ID off network NET (id or name)."""
    SandboxNetworks(get_env().client(), sandbox_id).leave(network_ref)
    click.echo(network_ref)
