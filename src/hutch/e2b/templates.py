"""E2B template names → what hutch starts.

- ``base`` → hutch's ``base`` image; ``code-interpreter-v1`` (the default template of
  ``e2b-code-interpreter``; also ``code-interpreter``) → ``devbox``, which has Python
  with numpy, pandas and matplotlib and hutch's stateful contexts;
- any other hutch image by its name (built-in or imported), with or without the
  ``:default``/``:latest`` tag E2B names carry;
- a hutch snapshot id (``snap-...``, what ``create_snapshot`` returned): a new sandbox
  from that snapshot (E2B's ``Sandbox.create(snapshot_id)``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hutch.contract.names import SNAPSHOT_ID_RE
from hutch.e2b.errors import E2bError

__all__ = ["ALIASES", "Template", "resolve_template", "template_snapshot"]

#: E2B template → hutch image.
ALIASES: dict[str, str] = {
    "base": "base",
    "code-interpreter-v1": "devbox",
    "code-interpreter": "devbox",
}
_TAGS = (":default", ":latest")


@dataclass(frozen=True)
class Template:
    """``image`` to create from, or ``snapshot_id``; ``name``: what E2B calls it."""

    name: str
    image: str | None = None
    snapshot_id: str | None = None


def _untagged(template_id: str) -> str:
    name = template_id
    for tag in _TAGS:
        name = name.removesuffix(tag)
    return name


def template_snapshot(template_id: str) -> str | None:
    """The hutch snapshot a template names (``snap-...``), else None (an image)."""
    name = _untagged(template_id)
    return name if SNAPSHOT_ID_RE.match(name) else None


def resolve_template(template_id: str, images: list[str]) -> Template:
    """``images``: the hutch image names this daemon has."""
    name = _untagged(template_id)
    if SNAPSHOT_ID_RE.match(name):
        return Template(name=template_id, snapshot_id=name)
    image = ALIASES.get(name, name)
    if image not in images:
        known = sorted({*ALIASES, *images})
        raise E2bError(
            404,
            f"template {template_id!r} not found; hutch serves these templates: "
            f"{', '.join(known)} (hutch images by name; import your own with "
            "`hutch image import` or `hutch image pull`), or a snapshot id (snap-...)",
        )
    return Template(name=name, image=image)
