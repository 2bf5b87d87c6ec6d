"""Bearer-key authentication. The key is compared in constant time and never logged."""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from fastapi import Request

from hutch.errors import Unauthorized


def load_or_create_key(path: Path) -> str:
    """Return the daemon's API key, creating it (0600) on first start."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        key = path.read_text().strip()
        if key:
            os.chmod(path, 0o600)
            return key
    except FileNotFoundError:
        pass
    key = "hk_" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


class BearerAuth:
    def __init__(self, key: str) -> None:
        self._key = key.encode()

    def __call__(self, request: Request) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized(
                "missing API key: send 'Authorization: Bearer <key>' (the key is in "
                "<state_dir>/api-key)"
            )
        if not hmac.compare_digest(token.strip().encode(), self._key):
            raise Unauthorized("wrong API key")
