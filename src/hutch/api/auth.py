"""API-key authentication. The key is compared exactly (nothing is stripped) and in
constant time, and is never logged (see :mod:`hutch.api.redact` for the log side).

REST: ``Authorization: Bearer <key>``. The terminal WebSocket takes the same header or,
for clients that cannot set headers (browsers), the key in its first message
(:mod:`hutch.api.routes.pty`); never in the URL, which ends up in logs, proxies and
browser history.

"Exactly" means the credentials after ``Bearer`` and one space, as HTTP delivers them.
HTTP itself takes the whitespace around a header value off before the value exists
(RFC 9110 §5.5), so ``Bearer <key><TAB>`` on the wire *is* ``Bearer <key>``; anything
else (an extra space before the key, whitespace inside it) is refused, and the SDK
refuses to send a key that starts or ends with whitespace.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from fastapi import Request

from hutch.contract.auth import DEFAULT_PROJECT, Principal
from hutch.contract.names import NAME_RE
from hutch.errors import Forbidden, InvalidArgument, Unauthorized

__all__ = [
    "PROJECT_HEADER",
    "Authenticator",
    "BearerAuth",
    "bearer_token",
    "check_bearer",
    "check_key",
    "load_or_create_key",
]

#: The header an admin request names the project it acts in with (default: ``default``).
PROJECT_HEADER = "hutch-project"

MISSING_HEADER = (
    "missing API key: send 'Authorization: Bearer <key>' (the key is in <state_dir>/api-key)"
)


def load_or_create_key(path: Path, prefix: str = "hk_") -> str:
    """Return the daemon's API key (or another secret of its: the metrics scrape token,
    ``prefix`` hm_), creating it (0600) on first start. The file holds the key and a
    newline."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        key = path.read_text().strip()
        if key:
            os.chmod(path, 0o600)
            return key
    except FileNotFoundError:
        pass
    key = prefix + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def check_key(given: str, key: bytes) -> None:
    """Raise Unauthorized unless ``given`` is the key, byte for byte."""
    if not hmac.compare_digest(given.encode(errors="surrogatepass"), key):
        raise Unauthorized("wrong API key")


def bearer_token(header: str) -> str:
    """The key in an ``Authorization`` header value: ``Bearer`` (any case), one space,
    the key. Unauthorized if the header is not that."""
    scheme, sep, token = header.partition(" ")
    if scheme.lower() != "bearer" or not sep or not token:
        raise Unauthorized(MISSING_HEADER)
    return token


def check_bearer(header: str, key: bytes) -> None:
    """Check an ``Authorization`` header value: ``Bearer`` (any case), one space, the key."""
    check_key(bearer_token(header), key)


def requested_project(header: str | None) -> str | None:
    """The project a ``Hutch-Project`` header names (None when absent)."""
    if header is None:
        return None
    if not NAME_RE.match(header):
        raise InvalidArgument(
            f"Hutch-Project {header!r} is not a project name; use 1-63 lowercase letters, "
            "digits and '-', starting and ending with a letter or digit"
        )
    return header


class Authenticator:
    """Turns the key a request presents into its :class:`Principal`.

    The daemon's own key (``<state>/api-key``) is the instance-wide admin key: it acts in
    the project the request names (``Hutch-Project``), ``default`` if none.
    """

    def __init__(self, admin_key: str) -> None:
        self._admin = admin_key.encode()

    def principal(self, presented: str, project: str | None, source: str) -> Principal:
        """The principal of ``presented``; Unauthorized when it is no valid key,
        Forbidden when it may not act in ``project``."""
        check_key(presented, self._admin)
        return Principal.admin(project=project or DEFAULT_PROJECT, source=source)

    def check_project(self, principal: Principal, project: str | None) -> None:
        """A project key acts only in its own project (the header, if sent, must match)."""
        if project is not None and project != principal.project:
            raise Forbidden(
                f"this key belongs to project {principal.project!r}; it cannot act in "
                f"project {project!r}"
            )


class BearerAuth:
    def __init__(self, key: str) -> None:
        self._key = key.encode()

    def __call__(self, request: Request) -> None:
        check_bearer(request.headers.get("authorization", ""), self._key)
