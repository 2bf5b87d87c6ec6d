"""The networking use cases of a sandbox (egress rules, ports, private networks) and the
network plumbing of its lifecycle (:class:`NetworkingService`); the work is done by
:class:`hutch.services.network.NetworkService`."""

from __future__ import annotations

import logging
from typing import Any

from hutch.contract.egress_suggest import DryRunResult, dry_run, list_as_policy, suggest_policy
from hutch.contract.limits import EGRESS_LOG_MAX
from hutch.contract.views import (
    EgressEvent,
    EgressView,
    NetworkView,
    PortView,
    SandboxNetView,
)
from hutch.errors import HutchError, InvalidArgument, NetworkError
from hutch.guest.client import AgentClient
from hutch.models import NetworkMode, SandboxRecord, SandboxSpec
from hutch.net.proxy_decide import inspects_tls
from hutch.net.rules import EgressPolicy, StoredPolicy, policy_from_stored
from hutch.services.egress_policies import DEFAULT_PROJECT, EgressPolicyService
from hutch.services.egress_trust import install_ca
from hutch.services.network import NetworkService
from hutch.services.registry import SandboxRegistry

__all__ = ["NetPlan", "NetworkingService"]

log = logging.getLogger(__name__)

#: Most egress log events one request returns.
MAX_LOG_LIMIT = EGRESS_LOG_MAX


class NetPlan:
    """What a create asked of the network, validated before anything is created."""

    def __init__(self, mode: NetworkMode, policy: EgressPolicy, network_ids: list[str]) -> None:
        self.mode = mode
        self.policy = policy
        self.network_ids = network_ids


class NetworkingService:
    def __init__(self, core: SandboxRegistry, policies: EgressPolicyService | None = None) -> None:
        self.core = core
        self.net = core.net
        #: Named egress policies (``/v1/egress-policies``), copied into sandboxes.
        self.policies = policies if policies is not None else EgressPolicyService(core.store)

    def _netman(self) -> NetworkService:
        if self.net is None:
            raise NetworkError("networking is off in this daemon (it runs without root?)")
        return self.net

    def resolve_egress(
        self,
        egress: StoredPolicy | None,
        policy_name: str | None,
        project: str = DEFAULT_PROJECT,
    ) -> EgressPolicy:
        """The policy a create or a PUT asks for: a rule list, a policy document, or a
        named policy of ``project`` (copied). Raises InvalidArgument/NotFound."""
        if policy_name is not None:
            if egress:
                raise InvalidArgument(
                    'give either "egress" (rules or a policy) or "egress_policy" (a named '
                    "policy), not both"
                )
            return self.policies.resolve(policy_name, project)
        return policy_from_stored(egress if egress is not None else [])

    def plan_network(self, spec: SandboxSpec) -> NetPlan:
        """Validate the network part of ``spec`` (bad rules, unknown networks, a named
        policy of another project) up front."""
        policy = self.resolve_egress(spec.egress, spec.egress_policy, spec.project)
        mode = NetworkMode(spec.network)
        ids: list[str] = []
        if mode is NetworkMode.NONE:
            if spec.egress or spec.egress_policy or spec.networks:
                raise InvalidArgument(
                    'network "none" has no egress rules or private networks; drop '
                    '"egress"/"networks" or use network "default"'
                )
        elif spec.networks:
            ids = self._netman().check_networks(list(spec.networks), spec.project)
        return NetPlan(mode, policy, ids)

    # -- egress --------------------------------------------------------------------------

    def egress_get(self, sandbox_id: str) -> EgressView:
        self.core.get(sandbox_id)
        return self._netman().egress_view(sandbox_id)

    async def egress_set(
        self,
        sandbox_id: str,
        rules: StoredPolicy | None,
        policy_name: str | None = None,
        project: str = DEFAULT_PROJECT,
    ) -> EgressView:
        """Replace the sandbox's egress with a rule list, a policy document or a copy of a
        named policy. Applies to new connections and requests at once; a request already
        relayed is not evaluated again (connections the new rules no longer allow by
        destination are cut, see :meth:`NetworkService.set_policy`)."""
        self.core.get(sandbox_id)
        # InvalidArgument names the bad rule or field; nothing changes then.
        policy = self.resolve_egress(rules, policy_name, project)
        view = await self._netman().set_policy(sandbox_id, policy)
        runtime = self.core.runtimes.get(sandbox_id)
        if runtime is not None:
            await self.trust_ca(sandbox_id, runtime.agent, policy)
        return view

    async def trust_ca(self, sandbox_id: str, agent: AgentClient, policy: EgressPolicy) -> None:
        """When the proxy may terminate the sandbox's TLS (inspection ``full``, or
        ``partial`` with a request rule on 443), make the guest trust its project's CA
        (:mod:`hutch.services.egress_trust`); otherwise nothing."""
        if self.net is None or not inspects_tls(policy):
            return
        try:
            pem = self.net.egress_ca_pem(self.core.get(sandbox_id).project)
            if pem is None:
                return
            await install_ca(agent, pem)
        except HutchError as exc:
            # Fail closed all the same: a client that does not trust the CA fails its
            # handshake, which the proxy logs; nothing passes uninspected.
            log.warning(
                "sandbox %s: hutch's egress CA could not be installed in the guest (%s); "
                "its TLS clients will not trust the inspecting proxy",
                sandbox_id,
                exc,
            )

    def egress_suggest(self, sandbox_id: str) -> tuple[dict[str, Any], int]:
        """(policy document, events used): the smallest ordered policy allowing exactly
        what the sandbox's egress log shows it used (``inspection: learn`` logs it all)."""
        self.core.get(sandbox_id)
        events = self._netman().events(sandbox_id, MAX_LOG_LIMIT)
        return suggest_policy(events), len(events)

    def egress_dry_run(
        self,
        sandbox_id: str,
        rules: StoredPolicy | None,
        policy_name: str | None = None,
        project: str = DEFAULT_PROJECT,
    ) -> list[DryRunResult]:
        """Each proxied decision in the sandbox's egress log decided again under a rule
        list, a policy document or a named policy; nothing is changed."""
        self.core.get(sandbox_id)
        policy = self.resolve_egress(rules, policy_name, project)
        ordered = policy.ordered or list_as_policy(policy.texts())
        return dry_run(ordered, self._netman().events(sandbox_id, MAX_LOG_LIMIT))

    def egress_log(self, sandbox_id: str, limit: int) -> list[EgressEvent]:
        self.core.get(sandbox_id)
        return self._netman().events(sandbox_id, max(0, min(limit, MAX_LOG_LIMIT)))

    # -- ports ---------------------------------------------------------------------------

    async def expose_port(self, sandbox_id: str, port: int) -> PortView:
        rec = self.core.get(sandbox_id)
        view = await self._netman().expose(sandbox_id, port)
        self.core.events.record(
            "port.exposed",
            project=rec.project,
            sandbox_id=sandbox_id,
            data={"port": view.port, "host": view.host, "host_port": view.host_port},
        )
        return view

    def list_ports(self, sandbox_id: str) -> list[PortView]:
        self.core.get(sandbox_id)
        return self._netman().ports(sandbox_id)

    async def close_port(self, sandbox_id: str, port: int) -> None:
        rec = self.core.get(sandbox_id)
        await self._netman().unexpose(sandbox_id, port)
        self.core.events.record(
            "port.closed", project=rec.project, sandbox_id=sandbox_id, data={"port": port}
        )

    # -- private networks ----------------------------------------------------------------

    # A network is looked up in ``project`` only: another project's network (by id or
    # name) is not found, exactly as a missing one.

    async def create_network(self, name: str, project: str) -> NetworkView:
        return self._netman().create_network(name, project)

    def list_networks(self, project: str) -> list[NetworkView]:
        return self._netman().list_networks(project)

    def get_network(self, id_or_name: str, project: str) -> NetworkView:
        return self._netman().network_view(id_or_name, project)

    async def delete_network(self, id_or_name: str, project: str) -> None:
        await self._netman().delete_network(id_or_name, project)

    async def join_network(self, sandbox_id: str, id_or_name: str, project: str) -> NetworkView:
        self.core.get(sandbox_id, project)
        return await self._netman().join(sandbox_id, id_or_name, project)

    async def leave_network(self, sandbox_id: str, id_or_name: str, project: str) -> None:
        self.core.get(sandbox_id, project)
        await self._netman().leave(sandbox_id, id_or_name, project)

    def sandbox_net(self, rec: SandboxRecord) -> SandboxNetView:
        """The network block of ``rec`` (a record already read: listing works while a
        sandbox is still being checked after a restart)."""
        if self.net is None or rec.network is NetworkMode.NONE:
            return SandboxNetView(rec.network, None, [])
        address = self.net.shown_address(rec.id)
        return SandboxNetView(
            rec.network, str(address) if address else None, self.net.networks_of(rec.id)
        )

    # -- the network of a sandbox's lifecycle -------------------------------------------

    async def attach(self, rec: SandboxRecord, plan: NetPlan, *, pooled: bool) -> None:
        """Attach ``rec`` as ``plan`` says (a pooled VM is attached already: its policy
        and networks are set instead)."""
        if self.net is None or plan.mode is NetworkMode.NONE:
            return
        if pooled:
            await self.net.set_policy(rec.id, plan.policy)
            for nid in plan.network_ids:
                await self.net.join(rec.id, nid, rec.project)
        else:
            await self.net.attach(rec.id, plan.policy, plan.network_ids)

    async def prepare_pooled(self, stub: SandboxRecord) -> None:
        """A pooled VM gets its tap and address now, and no egress until handed out."""
        if self.net is not None:
            await self.net.attach(stub.id, policy_from_stored(["deny-all"]), [])
