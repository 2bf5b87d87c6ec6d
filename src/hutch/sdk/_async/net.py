"""The networking shells: ``sb.egress``, ``sb.ports``, ``sb.networks`` and
``client.networks``. Requests are built and answers read by :class:`NetCalls`."""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hutch.contract.limits import DEFAULT_EGRESS_LOG_LIMIT
from hutch.sdk._net import (
    DryRunEvent,
    EgressEvent,
    EgressInfo,
    NamedPolicyInfo,
    NetCalls,
    NetworkInfo,
    PortInfo,
)

if TYPE_CHECKING:
    from hutch.sdk._async.client import AsyncClient

__all__ = [
    "AsyncEgress",
    "AsyncEgressPolicies",
    "AsyncNetworks",
    "AsyncPorts",
    "AsyncSandboxNetworks",
]


class AsyncEgress:
    """``sb.egress``: the sandbox's outbound rules, enforced on the host.

    No rules: open egress (except the always-denied set: cloud metadata, the host,
    other sandboxes, SMTP). Any rule: only what a rule matches leaves. ``["deny-all"]``:
    nothing does. Rule forms: ``host``, ``host:port``, ``*.host`` (subdomains, not the
    apex), ``ip``, ``ip:port``, ``cidr``, ``cidr:port``; IPv6 as ``[2001:db8::1]:443``.
    """

    def __init__(self, client: AsyncClient, sandbox_id: str) -> None:
        self._client = client
        self._calls = NetCalls(client.core)
        self._id = sandbox_id

    async def get(self) -> EgressInfo:
        return await self._client.call(self._calls.egress_get(self._id))

    async def set(
        self,
        rules: Sequence[str] | None = None,
        *,
        policy: Mapping[str, Any] | str | None = None,
    ) -> EgressInfo:
        """Replace every rule at once: ``rules`` (a list as above) or ``policy``, an
        ordered policy (``{"default": "deny", "rules": [{"action": "allow", "host":
        "pypi.org:443"}, ...]}``, first match wins) or the name of one in
        ``client.egress_policies`` (copied). They apply immediately to new connections
        and requests, and open connections no longer allowed are cut; a request already
        relayed is not evaluated again. An invalid rule raises ``InvalidArgument``
        naming it (``rules[2].methods``), and the old rules stay."""
        return await self._client.call(self._calls.egress_set(self._id, rules, policy))

    async def clear(self) -> EgressInfo:
        """Remove every rule: open egress again."""
        return await self.set([])

    async def log(self, limit: int = DEFAULT_EGRESS_LOG_LIMIT) -> builtins.list[EgressEvent]:
        """The newest ``limit`` (1-1000) egress decisions, oldest first."""
        return await self._client.call(self._calls.egress_log(self._id, limit))

    async def suggest(self) -> dict[str, Any]:
        """The smallest ordered policy allowing exactly what the egress log shows this
        sandbox used (run it under ``{"inspection": "learn"}`` first: everything passes
        and every proxied connection and request is logged). Apply it with
        ``sb.egress.set(policy=sb.egress.suggest())``."""
        return await self._client.call(self._calls.egress_suggest(self._id))

    async def dry_run(
        self,
        rules: Sequence[str] | None = None,
        *,
        policy: Mapping[str, Any] | str | None = None,
    ) -> builtins.list[DryRunEvent]:
        """Every proxied decision in the egress log decided again under ``rules`` or
        ``policy`` (as for :meth:`set`); nothing changes."""
        return await self._client.call(self._calls.egress_dry_run(self._id, rules, policy))


class AsyncPorts:
    """``sb.ports``: guest ports reachable from the host (inbound is closed otherwise)."""

    def __init__(self, client: AsyncClient, sandbox_id: str) -> None:
        self._client = client
        self._calls = NetCalls(client.core)
        self._id = sandbox_id

    async def expose(self, port: int) -> PortInfo:
        """Forward guest ``port`` through a host-side proxy; ``.url`` says where.
        ``Conflict`` if the sandbox has network ``none`` or was deleted (a paused one
        keeps its network: the port answers once it runs again)."""
        return await self._client.call(self._calls.expose_port(self._id, port))

    async def list(self) -> builtins.list[PortInfo]:
        return await self._client.call(self._calls.list_ports(self._id))

    async def close(self, port: int) -> None:
        """Stop forwarding ``port``; ``NotFound`` if it is not exposed."""
        await self._client.call(self._calls.close_port(self._id, port))


class AsyncSandboxNetworks:
    """``sb.networks``: the private networks this sandbox is on."""

    def __init__(self, client: AsyncClient, sandbox_id: str) -> None:
        self._client = client
        self._calls = NetCalls(client.core)
        self._id = sandbox_id

    async def join(self, network: str) -> NetworkInfo:
        """Join a network (id or name); its members then reach this sandbox by name."""
        return await self._client.call(self._calls.join_network(self._id, network))

    async def leave(self, network: str) -> None:
        await self._client.call(self._calls.leave_network(self._id, network))

    async def list(self) -> builtins.list[str]:
        """Ids of the networks the sandbox is on, as the daemon reports now."""
        info = await self._client.get_sandbox(self._id)
        return builtins.list(info.network.networks) if info.network else []


class AsyncEgressPolicies:
    """``client.egress_policies``: named egress policies of the project, reusable at
    create (``egress_policy="name"``) and by ``sb.egress.set(policy="name")``. A sandbox
    gets a copy: editing or deleting the named policy later changes no sandbox."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._calls = NetCalls(client.core)

    async def put(self, name: str, policy: Mapping[str, Any]) -> NamedPolicyInfo:
        """Create or replace ``name``; ``InvalidArgument`` names a bad field."""
        return await self._client.call(self._calls.put_policy(name, policy))

    async def get(self, name: str) -> NamedPolicyInfo:
        return await self._client.call(self._calls.get_policy(name))

    async def list(self) -> builtins.list[NamedPolicyInfo]:
        return await self._client.call(self._calls.list_policies())

    async def delete(self, name: str) -> None:
        await self._client.call(self._calls.delete_policy(name))


class AsyncNetworks:
    """``client.networks``: private networks on the daemon. Sandboxes on one network
    reach each other by sandbox name; different networks stay apart."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._calls = NetCalls(client.core)

    async def create(self, name: str) -> NetworkInfo:
        """A new empty network; ``Conflict`` if ``name`` is taken."""
        return await self._client.call(self._calls.create_network(name))

    async def list(self) -> builtins.list[NetworkInfo]:
        return await self._client.call(self._calls.list_networks())

    async def get(self, network: str) -> NetworkInfo:
        """By id (``net-...``) or name; ``NotFound`` if there is none."""
        return await self._client.call(self._calls.get_network(network))

    async def delete(self, network: str) -> None:
        """``Conflict`` while sandboxes are on it (the message names them)."""
        await self._client.call(self._calls.delete_network(network))
