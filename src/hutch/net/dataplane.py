"""The host side of sandbox networking that the kernel enforces: taps and the nftables
table. :class:`NftDataplane` is the real one; :class:`MemoryDataplane` keeps the same
state in memory for the component tests, which run without taps (never in production).

Every method leaves the table consistent on failure: each change is one ``nft -f -``
transaction (see :mod:`hutch.net.nft`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from typing import Protocol

from hutch.net import links, nft_apply
from hutch.net.addressing import Block, host_addresses, tap_prefix
from hutch.net.nft import (
    RulesetState,
    render_cluster,
    render_host_addrs,
    render_networks,
    render_table,
)
from hutch.net.nft_apply import SandboxCounters
from hutch.net.nft_common import SandboxNet, TableConfig
from hutch.net.nft_sandbox import (
    LearnedAddress,
    render_add_sandbox,
    render_learned,
    render_remove_sandbox,
    render_replace_policy,
)
from hutch.net.tunnel import TunnelDriver, TunnelState

__all__ = ["Dataplane", "MemoryDataplane", "NftDataplane"]

log = logging.getLogger(__name__)


class Dataplane(Protocol):
    async def install(
        self,
        cfg: TableConfig,
        sandboxes: Sequence[SandboxNet],
        blocks: Mapping[str, Block],
        networks: Mapping[str, Sequence[IPv4Address]],
    ) -> None:
        """(Re)build everything at daemon start: taps of ``sandboxes`` with their
        ``blocks``, the whole table; taps of this daemon that are not listed are deleted."""
        ...

    async def add(self, cfg: TableConfig, sb: SandboxNet, block: Block) -> None: ...

    async def remove(self, cfg: TableConfig, sb: SandboxNet) -> None: ...

    async def replace_policy(
        self, cfg: TableConfig, sb: SandboxNet, learned: Iterable[LearnedAddress] = ()
    ) -> None:
        """Swap ``sb``'s policy; its learned addresses become exactly ``learned``."""
        ...

    async def set_host_addrs(self, cfg: TableConfig, addrs: Iterable[IPv4Address]) -> None:
        """The host's own addresses changed: make the table's set exactly ``addrs``."""
        ...

    async def learned(
        self, cfg: TableConfig, sandbox_id: str, items: Iterable[LearnedAddress]
    ) -> None: ...

    async def set_networks(
        self,
        cfg: TableConfig,
        networks: Mapping[str, Sequence[IPv4Address]],
        removed: Iterable[str] = (),
    ) -> None: ...

    async def counters(self, cfg: TableConfig) -> dict[str, SandboxCounters]: ...

    async def set_cluster(
        self, cfg: TableConfig, pools: Iterable[IPv4Network], peers: Iterable[IPv4Address]
    ) -> None:
        """The other hosts' pools and tunnel endpoints (always denied) are exactly these."""
        ...

    async def sync_tunnel(self, cfg: TableConfig, state: TunnelState) -> None:
        """The overlay carries exactly ``state`` (``cfg.tunnel`` set; see
        :mod:`hutch.net.tunnel`); an empty state removes the device."""
        ...

    async def drop_tunnel(self, cfg: TableConfig) -> None:
        """Remove the overlay device, its entries and ip rule (also a crash's leftovers)."""
        ...


class NftDataplane:
    """Real taps (``ip``) and the real ``inet hutch_<tag>`` table (``nft``)."""

    def __init__(self) -> None:
        self._tunnel: TunnelDriver | None = None

    def _tunnel_of(self, cfg: TableConfig) -> TunnelDriver | None:
        if cfg.tunnel is None:
            return None
        if self._tunnel is None or self._tunnel.cfg != cfg.tunnel:
            self._tunnel = TunnelDriver(cfg.tunnel)
        return self._tunnel

    async def install(
        self,
        cfg: TableConfig,
        sandboxes: Sequence[SandboxNet],
        blocks: Mapping[str, Block],
        networks: Mapping[str, Sequence[IPv4Address]],
    ) -> None:
        await links.enable_ip_forward()
        wanted = {sb.tap for sb in sandboxes}
        for name in await links.list_links(tap_prefix(cfg.tag)):
            if name not in wanted:
                log.info("deleting leftover tap %s", name)
                await links.delete_tap(name)
        for sb in sandboxes:
            block = blocks[sb.sandbox_id]
            await links.create_tap(sb.tap, block.gateway, block.prefix)
        state = RulesetState(
            config=cfg,
            host_addrs=await host_addresses(),
            sandboxes=tuple(sandboxes),
            networks=networks,
        )
        await nft_apply.apply(render_table(state))

    async def add(self, cfg: TableConfig, sb: SandboxNet, block: Block) -> None:
        await links.create_tap(sb.tap, block.gateway, block.prefix)
        await nft_apply.apply(render_add_sandbox(cfg, sb))

    async def remove(self, cfg: TableConfig, sb: SandboxNet) -> None:
        await nft_apply.apply(render_remove_sandbox(cfg, sb))
        await links.delete_tap(sb.tap)

    async def replace_policy(
        self, cfg: TableConfig, sb: SandboxNet, learned: Iterable[LearnedAddress] = ()
    ) -> None:
        await nft_apply.apply(render_replace_policy(cfg, sb, learned))

    async def set_host_addrs(self, cfg: TableConfig, addrs: Iterable[IPv4Address]) -> None:
        await nft_apply.apply(render_host_addrs(cfg, addrs))

    async def learned(
        self, cfg: TableConfig, sandbox_id: str, items: Iterable[LearnedAddress]
    ) -> None:
        script = render_learned(cfg, sandbox_id, items)
        if script:
            await nft_apply.apply(script)

    async def set_networks(
        self,
        cfg: TableConfig,
        networks: Mapping[str, Sequence[IPv4Address]],
        removed: Iterable[str] = (),
    ) -> None:
        await nft_apply.apply(render_networks(cfg, networks, removed))

    async def counters(self, cfg: TableConfig) -> dict[str, SandboxCounters]:
        return await nft_apply.read_counters(cfg.tag)

    async def set_cluster(
        self, cfg: TableConfig, pools: Iterable[IPv4Network], peers: Iterable[IPv4Address]
    ) -> None:
        await nft_apply.apply(render_cluster(cfg, pools, peers))

    async def sync_tunnel(self, cfg: TableConfig, state: TunnelState) -> None:
        tunnel = self._tunnel_of(cfg)
        if tunnel is not None:
            await tunnel.sync(state)

    async def drop_tunnel(self, cfg: TableConfig) -> None:
        tunnel = self._tunnel_of(cfg)
        if tunnel is not None:
            await tunnel.down()


@dataclass
class MemoryDataplane:
    """The same calls, recorded in memory (component tests only: no taps, no nft).
    ``counter_values`` is what ``counters`` answers (tests set it)."""

    sandboxes: dict[str, SandboxNet] = field(default_factory=dict)
    networks: dict[str, list[IPv4Address]] = field(default_factory=dict)
    learned_items: dict[str, list[LearnedAddress]] = field(default_factory=dict)
    host_addrs: frozenset[IPv4Address] = frozenset()
    learned_calls: int = 0
    counter_values: dict[str, SandboxCounters] = field(default_factory=dict)
    cluster_pools: list[IPv4Network] = field(default_factory=list)
    tunnel_peers: list[IPv4Address] = field(default_factory=list)
    tunnel: TunnelState = field(default_factory=TunnelState)

    async def install(
        self,
        cfg: TableConfig,
        sandboxes: Sequence[SandboxNet],
        blocks: Mapping[str, Block],
        networks: Mapping[str, Sequence[IPv4Address]],
    ) -> None:
        self.sandboxes = {sb.sandbox_id: sb for sb in sandboxes}
        self.networks = {k: list(v) for k, v in networks.items()}

    async def add(self, cfg: TableConfig, sb: SandboxNet, block: Block) -> None:
        self.sandboxes[sb.sandbox_id] = sb

    async def remove(self, cfg: TableConfig, sb: SandboxNet) -> None:
        self.sandboxes.pop(sb.sandbox_id, None)
        self.learned_items.pop(sb.sandbox_id, None)

    async def replace_policy(
        self, cfg: TableConfig, sb: SandboxNet, learned: Iterable[LearnedAddress] = ()
    ) -> None:
        self.sandboxes[sb.sandbox_id] = sb
        self.learned_items[sb.sandbox_id] = list(learned)

    async def set_host_addrs(self, cfg: TableConfig, addrs: Iterable[IPv4Address]) -> None:
        self.host_addrs = frozenset(addrs)

    async def learned(
        self, cfg: TableConfig, sandbox_id: str, items: Iterable[LearnedAddress]
    ) -> None:
        self.learned_items.setdefault(sandbox_id, []).extend(items)
        self.learned_calls += 1

    async def set_networks(
        self,
        cfg: TableConfig,
        networks: Mapping[str, Sequence[IPv4Address]],
        removed: Iterable[str] = (),
    ) -> None:
        self.networks = {k: list(v) for k, v in networks.items()}

    async def counters(self, cfg: TableConfig) -> dict[str, SandboxCounters]:
        return {sid: c for sid, c in self.counter_values.items() if sid in self.sandboxes}

    async def set_cluster(
        self, cfg: TableConfig, pools: Iterable[IPv4Network], peers: Iterable[IPv4Address]
    ) -> None:
        self.cluster_pools, self.tunnel_peers = list(pools), list(peers)

    async def sync_tunnel(self, cfg: TableConfig, state: TunnelState) -> None:
        self.tunnel = state

    async def drop_tunnel(self, cfg: TableConfig) -> None:
        self.tunnel = TunnelState()
