"""Secrets of a project (:class:`SecretService`): write-only values, sealed at rest.

Two faces:

- **The API's** (``/v1/secrets``): ``put`` (create, or replace with the next version),
  ``get``/``list`` (names, versions, timestamps: :class:`SecretInfo`, which has no value
  field at all) and ``delete``. Nothing here returns a value to a caller outside the
  daemon.
- **The daemon's own** (never routed): ``reveal`` (one value), ``env_for`` (a sandbox's
  ``env_secrets`` as environment variables, built for each command) and ``render`` (a
  template such as ``Bearer {secret:openai}``, for the egress proxy's credential
  injection, where the value never enters the guest). Each reads the current version,
  so a replace takes effect at the next use.

Thread-safe: the store has its own lock and the AEAD keeps no state, so the egress data
path's thread may call ``render`` too. Values are UTF-8 text without NUL
(``hutch.contract.names.validate_secret_value``); every error message names a secret,
a variable or the key file, never a value.
"""

from __future__ import annotations

import builtins
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hutch.contract.auth import DEFAULT_PROJECT
from hutch.contract.names import validate_secret_name, validate_secret_value
from hutch.errors import Conflict, InvalidArgument, NotFound, SecretError
from hutch.services.secret_box import SecretKey, open_value, seal
from hutch.store.secrets import SecretRow, SecretStore

__all__ = ["SECRET_REF_RE", "SecretInfo", "SecretService", "references"]

log = logging.getLogger(__name__)

#: A reference in a template: ``{secret:NAME}`` (the egress policies' header values).
SECRET_REF_RE = re.compile(r"\{secret:([^{}]*)\}")


@dataclass(frozen=True)
class SecretInfo:
    """What anyone outside the daemon may know of a secret. No value."""

    project: str
    name: str
    version: int
    created_at: float
    updated_at: float

    @classmethod
    def of(cls, row: SecretRow) -> SecretInfo:
        return cls(row.project, row.name, row.version, row.created_at, row.updated_at)


def references(template: str) -> list[str]:
    """The secret names ``template`` refers to, in order, each checked
    (``InvalidArgument`` naming the grammar)."""
    names = SECRET_REF_RE.findall(template)
    for name in names:
        if not isinstance(name, str) or not name:
            raise InvalidArgument(
                f"{{secret:}} in {template!r} names no secret; use {{secret:NAME}}"
            )
        validate_secret_name(name)
    return names


class SecretService:
    def __init__(
        self, store: SecretStore, key: SecretKey, clock: Callable[[], float] = time.time
    ) -> None:
        self.store = store
        self.key = key
        self.clock = clock

    def prepare(self) -> None:
        """At start: create the key file if it is missing and no secret is stored (the
        first start); otherwise check it and log what is wrong. Never raises: the
        daemon serves, and what needs a secret fails with the reason."""
        if not self.key.exists() and self.store.count() == 0:
            try:
                self.key.create()
                log.info("created the secrets key file %s (0600)", self.key.path)
            except SecretError:
                pass  # another daemon made it just now
            return
        try:
            key_id, _ = self.key.load()
        except SecretError as exc:
            log.error("secrets: %s", exc.message)
            return
        others = self.store.key_ids() - {key_id}
        if others:
            log.error(
                "secrets: %s holds key %s, but stored secrets were sealed with %s; they "
                "cannot be decrypted until the original key file is restored",
                self.key.path, key_id, ", ".join(sorted(others)),
            )  # fmt: skip

    # -- the API's face -----------------------------------------------------------------

    def put(self, name: str, value: str, project: str = DEFAULT_PROJECT) -> tuple[SecretInfo, bool]:
        """Create the secret (version 1) or replace it (the next version): (info,
        created). The old value is gone; sandboxes naming it get the new one at their
        next command."""
        validate_secret_name(name)
        data = validate_secret_value(value)
        if not self.key.exists() and self.store.count() == 0:
            # No key and nothing sealed under one (the file was removed with every secret).
            self.prepare()
        row = self.store.put(
            project,
            name,
            lambda version: seal(self.key, project, name, version, data),
            self.clock(),
        )
        log.info("secret %r of project %r: version %d stored", name, project, row.version)
        return SecretInfo.of(row), row.version == 1

    def get(self, name: str, project: str = DEFAULT_PROJECT) -> SecretInfo:
        return SecretInfo.of(self._row(name, project))

    def list(self, project: str = DEFAULT_PROJECT) -> builtins.list[SecretInfo]:
        return [SecretInfo.of(r) for r in self.store.list(project)]

    def delete(self, name: str, project: str = DEFAULT_PROJECT) -> None:
        """``NotFound`` if there is no such secret; ``Conflict`` naming the live sandboxes
        whose env_secrets name it (delete them first)."""
        validate_secret_name(name)
        deleted, users = self.store.delete(project, name)
        if users:
            shown = ", ".join(users[:5]) + (f" and {len(users) - 5} more" if len(users) > 5 else "")
            raise Conflict(
                f"secret {name!r} is used by the env_secrets of sandbox(es) {shown}; delete "
                "them first (a replace needs no delete: PUT a new value)"
            )
        if not deleted:
            raise NotFound(self._missing(name, project))
        log.info("secret %r of project %r: deleted", name, project)

    def check_refs(self, env_secrets: Mapping[str, str], project: str = DEFAULT_PROJECT) -> None:
        """At create: every secret named exists in the project (``InvalidArgument``
        naming the variable and the secret) and decrypts (``SecretError``), so a broken
        key shows at create, not at the first exec."""
        for var, name in env_secrets.items():
            row = self.store.get(project, name)
            if row is None:
                raise InvalidArgument(
                    f"env_secrets[{var!r}] names secret {name!r}, which does not exist in "
                    f"project {project!r}; create it first (hutch secret set {name})"
                )
            open_value(self.key, project, name, row.version, row.sealed)

    # -- the daemon's own face (never routed) ------------------------------------------

    def reveal(self, name: str, project: str = DEFAULT_PROJECT) -> str:
        """The current value of a secret, for the daemon's own use only (a command's
        environment, an injected header). ``NotFound`` / ``SecretError``."""
        row = self._row(name, project)
        return open_value(self.key, project, name, row.version, row.sealed).decode("utf-8")

    def env_for(
        self,
        env_secrets: Mapping[str, str],
        project: str = DEFAULT_PROJECT,
        *,
        sandbox_id: str = "",
    ) -> dict[str, str]:
        """``{VAR: value}`` for a sandbox's ``env_secrets``, each the current version.
        A secret deleted since the create is a ``Conflict`` naming the variable."""
        out: dict[str, str] = {}
        for var, name in env_secrets.items():
            try:
                out[var] = self.reveal(name, project)
            except NotFound:
                raise Conflict(
                    f"sandbox {sandbox_id}: env_secrets[{var!r}] names secret {name!r}, which "
                    f"no longer exists in project {project!r}; set it again "
                    f"(hutch secret set {name})"
                ) from None
        return out

    def render(self, template: str, project: str = DEFAULT_PROJECT) -> str:
        """``template`` with each ``{secret:NAME}`` replaced by the current value (the
        egress proxy's header injection). ``InvalidArgument`` for a malformed reference,
        ``NotFound`` for a secret that does not exist, ``SecretError``."""
        references(template)

        def value(m: re.Match[str]) -> str:
            return self.reveal(m.group(1), project)

        return SECRET_REF_RE.sub(value, template)

    # -- helpers ------------------------------------------------------------------------

    def _row(self, name: str, project: str) -> SecretRow:
        validate_secret_name(name)
        row = self.store.get(project, name)
        if row is None:
            raise NotFound(self._missing(name, project))
        return row

    @staticmethod
    def _missing(name: str, project: str) -> str:
        return f"no secret named {name!r} in project {project!r}"
