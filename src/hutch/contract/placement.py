"""Where a create lands in a cluster: the ``placement`` field of a create request.

``{"host": ID}`` pins the sandbox to one host; ``{"labels": {KEY: VALUE}}`` to the hosts
carrying every one of those labels; ``{"strategy": "spread" | "pack"}`` picks among the
hosts that fit: ``spread`` (the default) the one with the most memory free, ``pack`` the
one with the least that still fits (fills hosts one after the other, so others can be
drained or scaled down). Declared once here: the REST schema, the SDK and the placer use
it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hutch.errors import InvalidArgument

__all__ = ["PLACEMENT_KEYS", "STRATEGIES", "Placement", "parse_placement"]

STRATEGIES = ("spread", "pack")
PLACEMENT_KEYS = ("host", "labels", "strategy")
#: Labels and host ids: what ``HUTCH_HOST_LABELS`` / ``HUTCH_HOST_ID`` accept.
LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")
MAX_LABELS = 16


@dataclass(frozen=True)
class Placement:
    host: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    strategy: str = "spread"


def parse_placement(doc: Any) -> Placement:
    """The placement in ``doc`` (None: anywhere, spread); InvalidArgument says what is
    wrong and what is accepted."""
    if doc is None:
        return Placement()
    if not isinstance(doc, Mapping):
        raise InvalidArgument(
            f'placement must be an object like {{"host": ID}} or {{"labels": {{K: V}}}}, '
            f"got {type(doc).__name__}"
        )
    unknown = sorted(set(doc) - set(PLACEMENT_KEYS))
    if unknown:
        raise InvalidArgument(
            f"placement has unknown key(s) {unknown}; accepted: {', '.join(PLACEMENT_KEYS)}"
        )
    host = doc.get("host")
    if host is not None and (not isinstance(host, str) or not LABEL_RE.match(host)):
        raise InvalidArgument(f"placement.host {host!r} is not a host id (see GET /v1/hosts)")
    labels = doc.get("labels") or {}
    if not isinstance(labels, Mapping) or len(labels) > MAX_LABELS:
        raise InvalidArgument(
            f"placement.labels must be an object of at most {MAX_LABELS} key: value labels"
        )
    for key, value in labels.items():
        if not (isinstance(key, str) and LABEL_RE.match(key)) or not (
            isinstance(value, str) and LABEL_RE.match(value)
        ):
            raise InvalidArgument(
                f"placement.labels {key!r}: {value!r} is not a label; keys and values are "
                "1-63 letters, digits, '.', '_', '-', '/' (starting with a letter or digit)"
            )
    strategy = doc.get("strategy", "spread")
    if strategy not in STRATEGIES:
        raise InvalidArgument(f"placement.strategy {strategy!r}; accepted: {', '.join(STRATEGIES)}")
    return Placement(host=host, labels=dict(labels), strategy=strategy)
