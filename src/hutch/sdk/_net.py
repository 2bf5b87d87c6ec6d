"""Networking in the SDK: egress rules, exposed ports, private networks.

One sans-IO core (:class:`NetCalls`: builds each request on a :class:`ClientCore` and
says how to read the answer) and two thin shells that only send: the blocking accessors
(``sb.egress``, ``sb.ports``, ``sb.networks``, ``client.networks``) and their asyncio
twins (``Async*``). Arguments are checked here, before anything is sent.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Protocol, TypeVar
from urllib.parse import quote

from hutch.errors import InvalidArgument
from hutch.models import validate_name
from hutch.sdk._core import Call, ClientCore, _json, _list_of, _nothing
from hutch.sdk._net_args import (
    EGRESS_LOG_MAX,
    MAX_EGRESS_RULES,
    NetworkModeArg,
    check_log_limit,
    check_port,
    check_ref,
    check_rules,
)
from hutch.sdk._net_types import EgressEvent, EgressInfo, NetworkInfo, PortInfo

__all__ = [
    "EGRESS_LOG_MAX",
    "MAX_EGRESS_RULES",
    "AsyncEgress",
    "AsyncNetworks",
    "AsyncPorts",
    "AsyncSandboxNetworks",
    "Egress",
    "NetCalls",
    "NetworkModeArg",
    "Networks",
    "Ports",
    "SandboxNetworks",
]

T = TypeVar("T")


class NetCalls:
    """Builds every networking request of API v1 and reads every answer. No I/O."""

    def __init__(self, core: ClientCore) -> None:
        self.core = core

    def _sandbox(self, sandbox_id: str, suffix: str) -> str:
        return self.core._sandbox_path(sandbox_id, suffix)

    # -- egress -----------------------------------------------------------------------

    def egress_get(self, sandbox_id: str) -> Call[EgressInfo]:
        req = self.core.request("GET", self._sandbox(sandbox_id, "/egress"))
        return Call(req, lambda r: EgressInfo.from_dict(_json(r)))

    def egress_set(self, sandbox_id: str, rules: Sequence[str]) -> Call[EgressInfo]:
        body = {"rules": check_rules(rules)}
        req = self.core.request("PUT", self._sandbox(sandbox_id, "/egress"), json_body=body)
        return Call(req, lambda r: EgressInfo.from_dict(_json(r)))

    def egress_log(self, sandbox_id: str, limit: int = 100) -> Call[list[EgressEvent]]:
        check_log_limit(limit)
        req = self.core.request(
            "GET", self._sandbox(sandbox_id, "/egress/log"), params=[("limit", str(limit))]
        )
        return Call(req, _list_of("events", EgressEvent.from_dict))

    # -- ports ------------------------------------------------------------------------

    def expose_port(self, sandbox_id: str, port: int) -> Call[PortInfo]:
        body = {"port": check_port(port)}
        req = self.core.request("POST", self._sandbox(sandbox_id, "/ports"), json_body=body)
        return Call(req, lambda r: PortInfo.from_dict(_json(r)))

    def list_ports(self, sandbox_id: str) -> Call[list[PortInfo]]:
        req = self.core.request("GET", self._sandbox(sandbox_id, "/ports"))
        return Call(req, _list_of("ports", PortInfo.from_dict))

    def close_port(self, sandbox_id: str, port: int) -> Call[None]:
        path = self._sandbox(sandbox_id, f"/ports/{check_port(port)}")
        return Call(self.core.request("DELETE", path), _nothing)

    # -- private networks -------------------------------------------------------------

    def _network_path(self, network: str) -> str:
        return f"/v1/networks/{quote(check_ref(network, 'network'), safe='')}"

    def create_network(self, name: str) -> Call[NetworkInfo]:
        if not isinstance(name, str):
            raise InvalidArgument(f"network name must be a string, got {name!r}")
        body = {"name": validate_name(name)}
        req = self.core.request("POST", "/v1/networks", json_body=body)
        return Call(req, lambda r: NetworkInfo.from_dict(_json(r)))

    def list_networks(self) -> Call[list[NetworkInfo]]:
        req = self.core.request("GET", "/v1/networks")
        return Call(req, _list_of("networks", NetworkInfo.from_dict))

    def get_network(self, network: str) -> Call[NetworkInfo]:
        req = self.core.request("GET", self._network_path(network))
        return Call(req, lambda r: NetworkInfo.from_dict(_json(r)))

    def delete_network(self, network: str) -> Call[None]:
        return Call(self.core.request("DELETE", self._network_path(network)), _nothing)

    def join_network(self, sandbox_id: str, network: str) -> Call[NetworkInfo]:
        body = {"network": check_ref(network, "network")}
        req = self.core.request("POST", self._sandbox(sandbox_id, "/networks"), json_body=body)
        return Call(req, lambda r: NetworkInfo.from_dict(_json(r)))

    def leave_network(self, sandbox_id: str, network: str) -> Call[None]:
        ref = quote(check_ref(network, "network"), safe="")
        path = self._sandbox(sandbox_id, f"/networks/{ref}")
        return Call(self.core.request("DELETE", path), _nothing)


# -- the shells -----------------------------------------------------------------------


class _Sync(Protocol):
    core: ClientCore

    def call(self, call: Call[T]) -> T: ...


class _Async(Protocol):
    core: ClientCore

    async def call(self, call: Call[T]) -> T: ...


class Egress:
    """``sb.egress``: the sandbox's outbound rules, enforced on the host.

    No rules: open egress (except the always-denied set: cloud metadata, the host,
    other sandboxes, SMTP). Any rule: only what a rule matches leaves. ``["deny-all"]``:
    nothing does. Rule forms: ``host``, ``host:port``, ``*.host`` (subdomains, not the
    apex), ``ip``, ``ip:port``, ``cidr``, ``cidr:port``; IPv6 as ``[2001:db8::1]:443``.
    """

    def __init__(self, client: _Sync, sandbox_id: str) -> None:
        self._client = client
        self._calls = NetCalls(client.core)
        self._id = sandbox_id

    def get(self) -> EgressInfo:
        return self._client.call(self._calls.egress_get(self._id))

    def set(self, rules: Sequence[str]) -> EgressInfo:
        """Replace every rule at once; new connections follow them immediately. An
        invalid rule raises ``InvalidArgument`` naming it, and the old rules stay."""
        return self._client.call(self._calls.egress_set(self._id, rules))

    def clear(self) -> EgressInfo:
        """Remove every rule: open egress again."""
        return self.set([])

    def log(self, limit: int = 100) -> builtins.list[EgressEvent]:
        """The newest ``limit`` (1-1000) egress decisions, oldest first."""
        return self._client.call(self._calls.egress_log(self._id, limit))


class Ports:
    """``sb.ports``: guest ports reachable from the host (inbound is closed otherwise)."""

    def __init__(self, client: _Sync, sandbox_id: str) -> None:
        self._client = client
        self._calls = NetCalls(client.core)
        self._id = sandbox_id

    def expose(self, port: int) -> PortInfo:
        """Forward guest ``port`` through a host-side proxy; ``.url`` says where.
        ``Conflict`` if the sandbox has network ``none`` or was deleted (a paused one
        keeps its network: the port answers once it runs again)."""
        return self._client.call(self._calls.expose_port(self._id, port))

    def list(self) -> builtins.list[PortInfo]:
        return self._client.call(self._calls.list_ports(self._id))

    def close(self, port: int) -> None:
        """Stop forwarding ``port``; ``NotFound`` if it is not exposed."""
        self._client.call(self._calls.close_port(self._id, port))


class SandboxNetworks:
    """``sb.networks``: the private networks this sandbox is on."""

    def __init__(self, client: _Sync, sandbox_id: str) -> None:
        self._client = client
        self._calls = NetCalls(client.core)
        self._id = sandbox_id

    def join(self, network: str) -> NetworkInfo:
        """Join a network (id or name); its members then reach this sandbox by name."""
        return self._client.call(self._calls.join_network(self._id, network))

    def leave(self, network: str) -> None:
        self._client.call(self._calls.leave_network(self._id, network))

    def list(self) -> builtins.list[str]:
        """Ids of the networks the sandbox is on, as the daemon reports now."""
        info = self._client.call(self._client.core.get_sandbox(self._id))
        return builtins.list(info.network.networks) if info.network else []


class Networks:
    """``client.networks``: private networks on the daemon. Sandboxes on one network
    reach each other by sandbox name; different networks stay apart."""

    def __init__(self, client: _Sync) -> None:
        self._client = client
        self._calls = NetCalls(client.core)

    def create(self, name: str) -> NetworkInfo:
        """A new empty network; ``Conflict`` if ``name`` is taken."""
        return self._client.call(self._calls.create_network(name))

    def list(self) -> builtins.list[NetworkInfo]:
        return self._client.call(self._calls.list_networks())

    def get(self, network: str) -> NetworkInfo:
        """By id (``net-...``) or name; ``NotFound`` if there is none."""
        return self._client.call(self._calls.get_network(network))

    def delete(self, network: str) -> None:
        """``Conflict`` while sandboxes are on it (the message names them)."""
        self._client.call(self._calls.delete_network(network))


class AsyncEgress:
    """``sb.egress`` of an ``AsyncSandbox``; see :class:`Egress`."""

    def __init__(self, client: _Async, sandbox_id: str) -> None:
        self._client = client
        self._calls = NetCalls(client.core)
        self._id = sandbox_id

    async def get(self) -> EgressInfo:
        return await self._client.call(self._calls.egress_get(self._id))

    async def set(self, rules: Sequence[str]) -> EgressInfo:
        return await self._client.call(self._calls.egress_set(self._id, rules))

    async def clear(self) -> EgressInfo:
        return await self.set([])

    async def log(self, limit: int = 100) -> builtins.list[EgressEvent]:
        return await self._client.call(self._calls.egress_log(self._id, limit))


class AsyncPorts:
    """``sb.ports`` of an ``AsyncSandbox``; see :class:`Ports`."""

    def __init__(self, client: _Async, sandbox_id: str) -> None:
        self._client = client
        self._calls = NetCalls(client.core)
        self._id = sandbox_id

    async def expose(self, port: int) -> PortInfo:
        return await self._client.call(self._calls.expose_port(self._id, port))

    async def list(self) -> builtins.list[PortInfo]:
        return await self._client.call(self._calls.list_ports(self._id))

    async def close(self, port: int) -> None:
        await self._client.call(self._calls.close_port(self._id, port))


class AsyncSandboxNetworks:
    """``sb.networks`` of an ``AsyncSandbox``; see :class:`SandboxNetworks`."""

    def __init__(self, client: _Async, sandbox_id: str) -> None:
        self._client = client
        self._calls = NetCalls(client.core)
        self._id = sandbox_id

    async def join(self, network: str) -> NetworkInfo:
        return await self._client.call(self._calls.join_network(self._id, network))

    async def leave(self, network: str) -> None:
        await self._client.call(self._calls.leave_network(self._id, network))

    async def list(self) -> builtins.list[str]:
        info = await self._client.call(self._client.core.get_sandbox(self._id))
        return builtins.list(info.network.networks) if info.network else []


class AsyncNetworks:
    """``client.networks`` of an ``AsyncClient``; see :class:`Networks`."""

    def __init__(self, client: _Async) -> None:
        self._client = client
        self._calls = NetCalls(client.core)

    async def create(self, name: str) -> NetworkInfo:
        return await self._client.call(self._calls.create_network(name))

    async def list(self) -> builtins.list[NetworkInfo]:
        return await self._client.call(self._calls.list_networks())

    async def get(self, network: str) -> NetworkInfo:
        return await self._client.call(self._calls.get_network(network))

    async def delete(self, network: str) -> None:
        await self._client.call(self._calls.delete_network(network))
