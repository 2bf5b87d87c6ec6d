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

from hutch.contract.auth import Principal
from hutch.errors import Unauthorized
from hutch.services.events import act_as

__all__ = ["BearerAuth", "act_for_request", "check_bearer", "check_key", "load_or_create_key"]

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


def check_bearer(header: str, key: bytes) -> None:
    """Check an ``Authorization`` header value: ``Bearer`` (any case), one space, the key."""
    scheme, sep, token = header.partition(" ")
    if scheme.lower() != "bearer" or not sep or not token:
        raise Unauthorized(MISSING_HEADER)
    check_key(token, key)


async def act_for_request(request: Request) -> None:
    """The request's events record its caller: until keys per project exist, every
    caller holds the admin key. Async on purpose: it runs in the request's own task, so
    the context it sets is the route's."""
    client = request.client
    act_as(Principal.admin(source=client.host if client else ""))


class BearerAuth:
    def __init__(self, key: str) -> None:
        self._key = key.encode()

    def __call__(self, request: Request) -> None:
        check_bearer(request.headers.get("authorization", ""), self._key)
