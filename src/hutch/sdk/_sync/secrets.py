# Generated from src/hutch/sdk/_async/secrets.py by scripts/unasync.py: do not edit.
"""``client.secrets``: the project's write-only secrets. Requests are built and answers
read by :class:`hutch.sdk._secrets.SecretCalls`."""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING

from hutch.sdk._secrets import SecretCalls, SecretInfo

if TYPE_CHECKING:
    from hutch.sdk._sync.client import Client

__all__ = ["Secrets"]


class Secrets:
    """``client.secrets``: values stored encrypted by the daemon and never returned.

    A sandbox receives them as environment variables with ``env_secrets={"VAR":
    "name"}`` at create (code in the sandbox sees the value); each command gets the
    current version, so ``set`` on an existing name (a rotation) reaches every later
    exec, process, terminal and code context, in existing sandboxes too.
    """

    def __init__(self, client: Client) -> None:
        self._client = client
        self._calls = SecretCalls(client.core)

    def set(self, name: str, value: str) -> SecretInfo:
        """Create ``name`` (version 1) or replace its value (the next version). The value:
        UTF-8 text without NUL, 1 byte to 64 KiB."""
        return self._client.call(self._calls.set(name, value))

    def list(self) -> builtins.list[SecretInfo]:
        return self._client.call(self._calls.list())

    def get(self, name: str) -> SecretInfo:
        """Name, version and timestamps (``NotFound`` if there is none); never the value."""
        return self._client.call(self._calls.get(name))

    def delete(self, name: str) -> None:
        """``NotFound`` if there is none; ``Conflict`` naming the live sandboxes whose
        env_secrets use it."""
        self._client.call(self._calls.delete(name))
