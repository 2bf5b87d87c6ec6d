"""Projects, their quotas and their API keys (issue 10).

A key's secret is ``hk_<12 hex key id>_<43 chars: 32 random bytes, base64url>``; only its
sha256 is stored. A presented secret is looked up by its id and its hash compared in
constant time; a revoked or expired key is refused on the very next request (nothing is
cached). The message says "revoked" or "expired" only to a caller that presented the
whole secret: anyone else learns "wrong API key", whether or not the id exists.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from hutch.contract.auth import ADMIN_KEY_ID, DEFAULT_PROJECT, Principal, Role
from hutch.contract.names import NAME_RE
from hutch.errors import Conflict, InvalidArgument, NotFound, QuotaExceeded, Unauthorized
from hutch.store.projects import QUOTA_FIELDS, KeyRow, ProjectRow, ProjectStore, ProjectUse

__all__ = [
    "KEY_ROLES",
    "QUOTA_FIELDS",
    "CreatedKey",
    "KeyRow",
    "ProjectRow",
    "ProjectService",
    "ProjectUse",
    "check_quota",
    "looks_like_project_key",
]

#: The roles a project key may have (``admin`` is the instance key's alone).
KEY_ROLES = (Role.OWNER, Role.DEVELOPER, Role.OPERATOR, Role.VIEWER)
_KEY_RE = re.compile(r"^hk_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")
#: last_used_at is written at most this often per key (a write per request is waste).
_TOUCH_EVERY_S = 1.0
WRONG_KEY = "wrong API key"
_MAX_TTL_S = 10 * 365 * 86400


def looks_like_project_key(secret: str) -> bool:
    return _KEY_RE.match(secret) is not None


def _sha256(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class CreatedKey:
    secret: str  # shown once, never stored
    row: KeyRow


def check_quota(
    store: ProjectStore, project: str, *, sandboxes: int, vcpus: int, memory_mib: int
) -> None:
    """Raise QuotaExceeded if adding this much to ``project`` would pass one of its quotas.
    The caller holds the create gate, so the use read here is not stale when it inserts."""
    row = store.get(project)
    if row is None or not any(v is not None for v in row.quotas.values()):
        return
    use = store.use(project)
    asked = {"max_sandboxes": sandboxes, "max_vcpus": vcpus, "max_memory_mib": memory_mib}
    for quota, extra in asked.items():
        limit = row.quotas.get(quota)
        if limit is not None and extra and use.of(quota) + extra > limit:
            raise QuotaExceeded(
                f"project {project!r} quota {quota} exceeded: {use.of(quota)} in use + "
                f"{extra} asked > limit {limit}"
            )


def _check_quotas(quotas: dict[str, int | None]) -> dict[str, int | None]:
    for quota, value in quotas.items():
        if quota not in QUOTA_FIELDS:
            raise InvalidArgument(f"unknown quota {quota!r}; accepted: {', '.join(QUOTA_FIELDS)}")
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise InvalidArgument(f"quota {quota}={value!r}: a whole number >= 0, or null")
    return quotas


class ProjectService:
    def __init__(self, store: ProjectStore, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock

    # -- projects ----------------------------------------------------------------------

    def create(self, name: str, quotas: dict[str, int | None] | None = None) -> ProjectRow:
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise InvalidArgument(
                f"project name {name!r} is not valid; use 1-63 lowercase letters, digits and "
                "'-', starting and ending with a letter or digit"
            )
        full = {q: None for q in QUOTA_FIELDS} | _check_quotas(dict(quotas or {}))
        row = ProjectRow(name, self.clock(), full)
        self.store.insert(row)
        return row

    def get(self, name: str) -> ProjectRow:
        row = self.store.get(name) if isinstance(name, str) else None
        if row is None:
            raise NotFound(f"no project {name!r}")
        return row

    def all(self) -> list[ProjectRow]:
        return self.store.all()

    def use(self, name: str) -> ProjectUse:
        return self.store.use(self.get(name).name)

    def set_quotas(self, name: str, quotas: dict[str, int | None]) -> ProjectRow:
        self.get(name)
        self.store.set_quotas(name, _check_quotas(dict(quotas)))
        return self.get(name)

    def delete(self, name: str) -> None:
        """Refused (Conflict) for ``default`` and while the project holds anything."""
        if name == DEFAULT_PROJECT:
            raise Conflict("project 'default' cannot be deleted")
        self.get(name)
        held = self.store.holdings(name)
        if held:
            what = ", ".join(f"{n} {kind}" for kind, n in held.items())
            raise Conflict(
                f"project {name!r} still holds {what}; delete them (and revoke its keys) first"
            )
        self.store.delete(name)

    # -- keys --------------------------------------------------------------------------

    def create_key(
        self,
        project: str,
        name: str,
        role: str,
        *,
        expires_at: float | None = None,
        ttl_s: float | None = None,
        created_by: str | None = None,
    ) -> CreatedKey:
        self.get(project)
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise InvalidArgument(
                f"key name {name!r} is not valid; use 1-63 lowercase letters, digits and '-'"
            )
        if role not in {str(r) for r in KEY_ROLES}:
            raise InvalidArgument(
                f"role {role!r} is not a key role; accepted: {', '.join(map(str, KEY_ROLES))}"
            )
        now = self.clock()
        if expires_at is not None and ttl_s is not None:
            raise InvalidArgument("give expires_at or ttl_s, not both")
        if ttl_s is not None:
            if not 0 < ttl_s <= _MAX_TTL_S:
                raise InvalidArgument(f"ttl_s={ttl_s!r}: more than 0, at most {_MAX_TTL_S}")
            expires_at = now + ttl_s
        elif expires_at is not None and expires_at <= now:
            raise InvalidArgument("expires_at is in the past")
        key_id = secrets.token_hex(6)
        secret = f"hk_{key_id}_{secrets.token_urlsafe(32)}"
        row = KeyRow(
            id=key_id,
            project=project,
            name=name,
            role=role,
            secret_sha256=_sha256(secret),
            created_at=now,
            created_by=created_by,
            expires_at=expires_at,
            revoked_at=None,
            last_used_at=None,
        )
        self.store.insert_key(row)
        return CreatedKey(secret, row)

    def keys(self, project: str) -> list[KeyRow]:
        self.get(project)
        return self.store.keys(project)

    def revoke_key(self, project: str, key_id: str) -> KeyRow:
        """Revoked from the next request on; a key of another project is not found."""
        row = self.store.key(key_id) if isinstance(key_id, str) else None
        if row is None or row.project != project:
            raise NotFound(f"no key {key_id!r} in project {project!r}")
        if row.revoked_at is None:
            self.store.revoke(key_id, self.clock())
        found = self.store.key(key_id)
        assert found is not None
        return found

    def principal(self, secret: str, source: str) -> Principal:
        """The principal of a project key's secret; Unauthorized when it is not one."""
        m = _KEY_RE.match(secret)
        row = self.store.key(m.group(1)) if m else None
        # The hash is compared even for an unknown id, so timing says nothing of ids.
        stored = row.secret_sha256 if row is not None else "0" * 64
        if not hmac.compare_digest(_sha256(secret), stored) or row is None:
            raise Unauthorized(WRONG_KEY)
        now = self.clock()
        if row.revoked_at is not None:
            raise Unauthorized("this API key was revoked")
        if row.expires_at is not None and now >= row.expires_at:
            raise Unauthorized("this API key has expired")
        if row.last_used_at is None or now - row.last_used_at >= _TOUCH_EVERY_S:
            self.store.touch(row.id, now)
        assert row.id != ADMIN_KEY_ID
        return Principal(row.id, row.project, Role(row.role), source)
