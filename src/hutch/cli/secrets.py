"""``hutch secret set|ls|inspect|rm``: the project's write-only secrets.

A value is read from stdin (a hidden prompt on a terminal), a file (``--from-file``) or
an environment variable of this command (``--from-env``), never from the command line:
argv is readable by every user of the host (``ps``, ``/proc/<pid>/cmdline``) and is
kept in shell history, so a value there would leak before hutch ever saw it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from rich.table import Table

from hutch.cli._env import get_env, print_table
from hutch.cli._output import print_json, when
from hutch.cli.net import _echo_rows, _report_each
from hutch.sdk import SecretInfo

__all__ = ["secret"]


@click.group()
def secret() -> None:
    """Write-only secrets: stored encrypted, given to sandboxes as env_secrets, never shown.

    A sandbox gets one as an environment variable with
    `hutch create --env-secret VAR=NAME`; every later command in it sees the current
    value (code in the sandbox can read it)."""


def _strip_newline(value: str, keep: bool) -> str:
    if keep:
        return value
    if value.endswith("\r\n"):
        return value[:-2]
    return value[:-1] if value.endswith("\n") else value


def _read_value(from_file: Path | None, from_env: str | None, keep_newline: bool) -> str:
    if from_file is not None and from_env is not None:
        raise click.UsageError("give --from-file or --from-env, not both")
    if from_env is not None:
        if from_env not in os.environ:
            raise click.BadParameter(f"{from_env} is not set", param_hint="--from-env")
        return os.environ[from_env]
    if from_file is not None:
        try:
            raw = sys.stdin.buffer.read() if str(from_file) == "-" else from_file.read_bytes()
        except OSError as exc:
            raise click.BadParameter(str(exc), param_hint="--from-file") from exc
    elif sys.stdin.isatty():
        return str(click.prompt("value", hide_input=True, confirmation_prompt=True, err=True))
    else:
        raw = sys.stdin.buffer.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise click.BadParameter(
            f"the value is not UTF-8 text (byte {exc.start}); secrets are text: encode binary "
            "values, e.g. with base64",
            param_hint="--from-file" if from_file is not None else "stdin",
        ) from None
    return _strip_newline(text, keep_newline)


@secret.command("set")
@click.argument("name")
@click.option(
    "--from-file",
    type=click.Path(path_type=Path, dir_okay=False, allow_dash=True),
    metavar="PATH",
    help="Read the value from PATH ('-': stdin).",
)
@click.option("--from-env", metavar="VAR", help="Read the value from this environment variable.")
@click.option(
    "--keep-newline",
    is_flag=True,
    help="Keep one trailing newline of stdin or the file (dropped by default, so "
    "`echo $TOKEN | hutch secret set NAME` stores the token alone).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the secret (never its value) as JSON.")
def secret_set(
    name: str, from_file: Path | None, from_env: str | None, keep_newline: bool, as_json: bool
) -> None:
    """Create secret NAME, or replace its value (a new version).

    The value comes from stdin (a hidden prompt on a terminal), --from-file or
    --from-env; never from the command line, where `ps` and shell history would show
    it. NAME: 1-128 letters, digits, '_', '.', '-', starting with a letter or digit. The
    value: UTF-8 text, 1 byte to 64 KiB. Sandboxes that use NAME get the new value at
    their next command."""
    value = _read_value(from_file, from_env, keep_newline)
    info = get_env().client().secrets.set(name, value)
    if as_json:
        print_json(info.to_dict())
    else:
        click.echo(f"{info.name} version {info.version}")


@secret.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def secret_ls(as_json: bool) -> None:
    """List secrets: names, versions and times (values are never shown)."""
    found = get_env().client().secrets.list()
    if as_json:
        print_json([s.to_dict() for s in found])
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("NAME", "VERSION", "CREATED", "UPDATED"):
        table.add_column(column, no_wrap=True)
    for s in found:
        table.add_row(s.name, str(s.version), when(s.created_at), when(s.updated_at))
    print_table(table)


def _rows(info: SecretInfo) -> list[tuple[str, str]]:
    return [
        ("name", info.name),
        ("project", info.project),
        ("version", str(info.version)),
        ("created", when(info.created_at)),
        ("updated", when(info.updated_at)),
    ]


@secret.command("inspect")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the secret as JSON.")
def secret_inspect(name: str, as_json: bool) -> None:
    """Show secret NAME: its version and times, never its value."""
    info = get_env().client().secrets.get(name)
    if as_json:
        print_json(info.to_dict())
    else:
        _echo_rows(_rows(info))


@secret.command("rm")
@click.argument("names", metavar="NAME...", nargs=-1, required=True)
def secret_rm(names: tuple[str, ...]) -> None:
    """Delete secrets. Prints each removed; exit 1 if any was not.

    A secret is kept while a live sandbox's env_secrets use it; the error names them."""
    _report_each(names, get_env().client().secrets.delete)
