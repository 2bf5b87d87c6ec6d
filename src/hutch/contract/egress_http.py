"""What an egress policy knows of HTTP: header value templates with ``{secret:NAME}``
references, and the normalized request path that path rules compare with (pure, no I/O).

Split from :mod:`hutch.contract.egress_policy`, which builds rules on these.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from hutch.contract.egress import IpAddress

__all__ = [
    "MAX_HEADER_VALUE",
    "FieldError",
    "HttpRequest",
    "SecretRef",
    "Template",
    "normalize_request_path",
    "parse_template",
]

MAX_HEADER_VALUE = 4096
_SECRET_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
_PLACEHOLDER = re.compile(r"\{secret:([^{}]*)\}")
_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


class FieldError(ValueError):
    """One field is wrong: ``where`` (``rules[2].path``) and why (with what is accepted)."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where}: {why}")
        self.where, self.why = where, why


# ---- header value templates ------------------------------------------------------------


@dataclass(frozen=True)
class SecretRef:
    """A ``{secret:NAME}`` reference inside a header value."""

    name: str


@dataclass(frozen=True)
class Template:
    """A header value: literal text and secret references, in order."""

    parts: tuple[str | SecretRef, ...]

    @property
    def text(self) -> str:
        return "".join(p if isinstance(p, str) else f"{{secret:{p.name}}}" for p in self.parts)

    @property
    def secrets(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parts if isinstance(p, SecretRef))

    def render(self, resolve: Any) -> str:
        """The value with each reference replaced by ``resolve(name)`` (a callable
        returning the secret's text; it raises when the secret does not exist)."""
        return "".join(p if isinstance(p, str) else str(resolve(p.name)) for p in self.parts)


def parse_template(text: str, where: str = "value") -> Template:
    """Parse a header value; ``{secret:NAME}`` is the only brace syntax."""
    if len(text) > MAX_HEADER_VALUE:
        raise FieldError(where, f"is {len(text)} characters; at most {MAX_HEADER_VALUE}")
    if any((ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F for c in text):
        raise FieldError(where, "holds a control character (CR, LF, NUL, ...); not allowed")
    parts: list[str | SecretRef] = []
    pos = 0
    for m in _PLACEHOLDER.finditer(text):
        literal = text[pos : m.start()]
        name = m.group(1)
        if not _SECRET_NAME.match(name):
            raise FieldError(
                where,
                f"{{secret:{name}}} does not name a secret (1-64 letters, digits, '_', "
                "'.', '-', starting with a letter or '_')",
            )
        if literal:
            parts.append(literal)
        parts.append(SecretRef(name))
        pos = m.end()
    if text[pos:]:
        parts.append(text[pos:])
    for part in parts:
        if isinstance(part, str) and ("{" in part or "}" in part):
            raise FieldError(
                where,
                f"{text!r} has a brace outside a {{secret:NAME}} reference; the only brace "
                "syntax accepted is {secret:NAME}",
            )
    return Template(tuple(parts))


# ---- requests and paths ----------------------------------------------------------------


def normalize_request_path(target: str) -> str | None:
    """The path a rule's ``path`` is compared with: the request target without query,
    percent-encoded unreserved characters decoded (``%7E`` -> ``~``). None when it is
    ambiguous: a dot segment (``.``/``..``, also encoded), an encoded ``/`` or ``\\``, a
    backslash, or not starting with ``/``. Servers resolve those differently, so no
    path rule can be trusted to mean the same thing as the server."""
    path = target.split("?", 1)[0].split("#", 1)[0]
    if not path.startswith("/"):
        return None
    out: list[str] = []
    i = 0
    while i < len(path):
        c = path[i]
        if c == "%":
            hexpart = path[i + 1 : i + 3]
            if len(hexpart) != 2 or not all(h in "0123456789abcdefABCDEF" for h in hexpart):
                return None  # a bare '%': servers disagree on it
            ch = chr(int(hexpart, 16))
            if ch in ("/", "\\"):
                return None
            out.append(ch if ch in _UNRESERVED else "%" + hexpart.upper())
            i += 3
            continue
        if c == "\\":
            return None
        out.append(c)
        i += 1
    norm = "".join(out)
    if any(seg in (".", "..") for seg in norm.split("/")):
        return None
    return norm


@dataclass(frozen=True)
class HttpRequest:
    """What the evaluator needs of a request: the name (Host/SNI, normalized or not),
    the address and port it goes to, the method and the raw request target."""

    name: str | None
    address: IpAddress | None
    port: int
    method: str
    target: str

    @property
    def path(self) -> str | None:
        return normalize_request_path(self.target)
