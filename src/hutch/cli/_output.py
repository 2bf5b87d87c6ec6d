"""Formatting helpers: stable JSON, K=V parsing, human units."""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

import click

__all__ = ["human_bytes", "parse_pairs", "print_json", "when"]


def print_json(value: Any) -> None:
    """``--json`` output: indented, keys in the API's order, one trailing newline."""
    click.echo(json.dumps(value, indent=2, ensure_ascii=False))


def parse_pairs(values: Iterable[str], option: str) -> dict[str, str]:
    """``K=V`` option values → dict; a bad one is a usage error (exit 2)."""
    pairs: dict[str, str] = {}
    for raw in values:
        key, sep, value = raw.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{raw!r} is not KEY=VALUE", param_hint=option)
        pairs[key] = value
    return pairs


def when(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
