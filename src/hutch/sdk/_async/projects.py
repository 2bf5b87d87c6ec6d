"""The projects and keys shells: ``client.projects`` and ``client.keys``. Requests are
built and answers read by :class:`ProjectCalls`."""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING

from hutch.sdk._projects import CreatedKeyInfo, KeyInfo, ProjectCalls, ProjectInfo

if TYPE_CHECKING:
    from hutch.sdk._async.client import AsyncClient

__all__ = ["AsyncKeys", "AsyncProjects"]


class AsyncProjects:
    """``client.projects``: projects and their quotas (creating, changing and deleting
    them takes the admin key; a project key sees its own project)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._calls = ProjectCalls(client.core)

    async def create(
        self, name: str, quotas: Mapping[str, int | None] | None = None
    ) -> ProjectInfo:
        """A new project; ``quotas`` by name (max_sandboxes, max_vcpus, max_memory_mib,
        max_snapshot_bytes), absent or None = unlimited."""
        return await self._client.call(self._calls.create(name, quotas))

    async def list(self) -> builtins.list[ProjectInfo]:
        return await self._client.call(self._calls.list_all())

    async def get(self, name: str) -> ProjectInfo:
        """The project with its quotas and what it uses now."""
        return await self._client.call(self._calls.get(name))

    async def set_quotas(self, name: str, **quotas: int | None) -> ProjectInfo:
        """Change the quotas named (None lifts one); the others stay."""
        return await self._client.call(self._calls.set_quotas(name, quotas))

    async def delete(self, name: str) -> None:
        """``Conflict`` (naming what it holds) while it holds anything; ``default``
        cannot be deleted."""
        await self._client.call(self._calls.delete(name))


class AsyncKeys:
    """``client.keys``: a project's API keys (its owner, or the admin key). ``project``
    defaults to the client's project (``project=`` / ``HUTCH_PROJECT``), else the
    project of the client's key (a project key), else default (the admin key)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._calls = ProjectCalls(client.core)

    async def _project(self, project: str | None) -> str:
        if project or self._client.core.config.project or not self._calls.holds_project_key():
            return self._calls.project_of(project)
        # A project key sees its own project only: the list names it.
        own = await self._client.call(self._calls.list_all())
        return own[0].name if len(own) == 1 else self._calls.project_of(None)

    async def create(
        self,
        name: str,
        role: str,
        *,
        project: str | None = None,
        ttl_s: int | None = None,
        expires_at: datetime | None = None,
    ) -> CreatedKeyInfo:
        """A new key (role owner, developer, operator or viewer); ``.secret`` is shown
        this once and stored by the daemon only as a hash."""
        call = self._calls.create_key(await self._project(project), name, role, ttl_s, expires_at)
        return await self._client.call(call)

    async def list(self, *, project: str | None = None) -> builtins.list[KeyInfo]:
        return await self._client.call(self._calls.list_keys(await self._project(project)))

    async def revoke(self, key_id: str, *, project: str | None = None) -> KeyInfo:
        """Revoke: the key is refused from its next request on."""
        call = self._calls.revoke_key(await self._project(project), key_id)
        return await self._client.call(call)
