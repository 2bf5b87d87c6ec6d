"""``--host`` / ``--label`` / ``--strategy``: where in a cluster a create or a resume
lands (``hutch.contract.placement``), shared by ``hutch create`` and ``hutch resume``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from hutch.cli._output import parse_pairs
from hutch.contract.placement import STRATEGIES

__all__ = ["placement_body", "placement_options"]

F = TypeVar("F", bound=Callable[..., Any])


def placement_options(*, strategy: bool) -> Callable[[F], F]:
    """The placement flags; ``strategy``: offer ``--strategy`` too (a create)."""

    def decorate(fn: F) -> F:
        if strategy:
            fn = click.option(
                "--strategy",
                type=click.Choice(STRATEGIES),
                default=None,
                help="Among the hosts that fit: spread (most memory free, the default) or "
                "pack (fill hosts one after the other).",
            )(fn)
        fn = click.option(
            "--label",
            "labels",
            multiple=True,
            metavar="K=V",
            help="Only on hosts carrying this label (repeatable; all must match; see "
            "`hutch host ls`).",
        )(fn)
        return click.option(
            "--host", "host", metavar="ID", help="On this host (see `hutch host ls`)."
        )(fn)

    return decorate


def placement_body(
    host: str | None, labels: tuple[str, ...], strategy: str | None = None
) -> dict[str, Any] | None:
    """The ``placement`` object for the flags given; None when none was."""
    body: dict[str, Any] = {}
    if host is not None:
        body["host"] = host
    if labels:
        body["labels"] = parse_pairs(labels, "--label")
    if strategy is not None:
        body["strategy"] = strategy
    return body or None
