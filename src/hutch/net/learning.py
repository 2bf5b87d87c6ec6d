"""Filling each sandbox's learned allow sets from DNS, and swapping its policy, in the
data path's loop (:mod:`hutch.net.datapath`).

The resolver awaits :meth:`Learner.learn` with every allowed answer before the guest
sees it; the enforcer awaits :meth:`Learner.swap` (through ``Datapath.run``) to
change a sandbox's rules. Both write the same nft sets, so per sandbox one
``asyncio.Lock`` of this loop orders them: an answer that was on its way while the rules
changed is learned under the rules in force *after* the swap (or not at all), never
into the new sets for a name the new rules dropped; a swap never flushes sets between
a learning's check and its write. A flood of one sandbox's answers waits on its own
lock only.

What is remembered per sandbox (:mod:`hutch.net.learned`): the elements the sets hold
(so an answer they already cover costs no nft run) and the names each address was
learned for (so a swap carries over what the new rules still allow). The policy used
here is the one the sets were last filled for: set by :meth:`swap` once nft holds it,
else the one published (:class:`hutch.net.enforcer.Snapshot`) when the sandbox first
learned something.

Everything here runs in the data path's loop only; nothing is shared with the API's
thread but the callables given to the constructor (which read published snapshots).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from ipaddress import IPv4Address

from hutch.errors import HutchError
from hutch.net.dataplane import Dataplane
from hutch.net.learned import SLACK_S, LearnedElements, LearnedNames
from hutch.net.nft_common import SandboxNet, TableConfig
from hutch.net.nft_sandbox import LearnedAddress
from hutch.net.rules import EgressPolicy

__all__ = ["Learner"]

log = logging.getLogger(__name__)


@dataclass
class _Sandbox:
    policy: EgressPolicy
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    elements: LearnedElements = field(default_factory=LearnedElements)
    names: LearnedNames = field(default_factory=LearnedNames)


class Learner:
    """See the module docstring. ``policy_of(sandbox_id)`` is the policy last
    published (None: not attached); ``forbidden(addr)`` says an address may no longer
    be carried over (it became the host's, ...); ``clock`` is monotonic seconds."""

    def __init__(
        self,
        dataplane: Dataplane,
        config: Callable[[], TableConfig],
        policy_of: Callable[[str], EgressPolicy | None],
        forbidden: Callable[[IPv4Address], object],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._dataplane = dataplane
        self._config = config
        self._policy_of = policy_of
        self._forbidden = forbidden
        self._clock = clock
        self._sandboxes: dict[str, _Sandbox] = {}

    async def learn(
        self, sandbox_id: str, learned: list[tuple[IPv4Address, int | None]], ttl: int, name: str
    ) -> None:
        """Allow ``learned`` ((address, port) pairs the resolver found for ``name``, TTL
        ``ttl``) in the sandbox's sets, with ``ttl + SLACK_S`` seconds; elements the sets
        already hold for ``ttl`` more seconds are not written again. A failed nft run is
        logged (the guest's connection is then refused: fail closed)."""
        published = self._policy_of(sandbox_id)
        if published is None:
            return  # detached (or never attached)
        sb = self._sandboxes.get(sandbox_id)
        if sb is None:
            sb = self._sandboxes[sandbox_id] = _Sandbox(published)
        async with sb.lock:
            # The rules may have changed while the answer was on its way: only what the
            # rules the sets are filled for now allow is learned.
            policy = sb.policy
            if policy.name_allowed_any_port(name) is None:
                return
            ports = set(policy.name_ports(name))
            wanted = [(addr, port) for addr, port in learned if port in ports]
            if not wanted:
                return
            now = self._clock()
            timeout = ttl + SLACK_S
            stale = sb.elements.stale(wanted, ttl, now)
            if stale:
                items = [LearnedAddress(addr, port, timeout) for addr, port in stale]
                try:
                    await self._dataplane.learned(self._config(), sandbox_id, items)
                except HutchError as exc:
                    log.warning("could not allow learned addresses for %s: %s", sandbox_id, exc)
                    return
                sb.elements.added(stale, timeout, now)
            # Remembered even when nothing was written: the guest has this answer now.
            sb.names.record(name, {addr for addr, _ in wanted}, timeout, now)

    async def swap(self, view: SandboxNet, policy: EgressPolicy) -> None:
        """Give ``view.sandbox_id`` the rules ``policy`` (``view.policy``) in nft,
        carrying over the learned addresses they still allow. Raises what the dataplane
        raises (the old rules then stay in force, here as in nft)."""
        sid = view.sandbox_id
        sb = self._sandboxes.get(sid)
        if sb is None:  # nothing learned yet: the sets are filled for the rules in force
            sb = self._sandboxes[sid] = _Sandbox(self._policy_of(sid) or policy)
        async with sb.lock:
            now = self._clock()
            kept = sb.names.carry_over(policy, now, self._forbidden)
            await self._dataplane.replace_policy(self._config(), view, kept)
            sb.policy = policy
            sb.elements.replaced(kept, now)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone (its sets with it). Safe to call twice."""
        self._sandboxes.pop(sandbox_id, None)
