"""Sandbox networking as one unit: address leases, egress policies, private networks and
exposed ports, kept in the store and pushed to the dataplane (taps + nftables). The
resolver, the SNI/Host proxy, the NFLOG reader, the counter poll and the learned sets
(:mod:`hutch.net.learning`: DNS learning and policy swaps) run in the data path's own
thread and loop (:mod:`hutch.net.datapath`), so what guests send cannot slow the API's
loop; the port forwarder (host clients, exposed by API calls) and the host-address
watcher stay in the API's loop. What the data path asks about a sandbox (``lookup``) is
answered from a snapshot that every change replaces whole; calls into the data path's
objects go through ``Datapath.run``/``Datapath.call``, never directly.

Everything is enforced on the host. While the daemon is down its nft table stays in
place and its resolver and proxy ports are closed: sandboxes fail closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Interface
from pathlib import Path

from hutch.config import Settings
from hutch.contract.limits import MAX_NETWORKS_PER_SANDBOX
from hutch.contract.names import NETWORK_ID_RE as _NETWORK_ID_RE
from hutch.errors import Conflict, HutchError, InvalidArgument, NetworkError, NotFound
from hutch.models import NAME_RE
from hutch.net import links, nft_apply
from hutch.net.addressing import (
    AddressPool,
    Block,
    guest_mac,
    host_addresses,
    tap_name,
    tap_prefix,
)
from hutch.net.datapath import Datapath
from hutch.net.dataplane import Dataplane, NftDataplane
from hutch.net.destinations import Forbidden, classify_destination
from hutch.net.dns import INTERNAL_SUFFIX, Resolver, SandboxNetInfo
from hutch.net.egress_log import EgressLog
from hutch.net.host_addresses import HostAddressWatcher, is_host_address
from hutch.net.inbound import PortForwarder
from hutch.net.learning import Learner
from hutch.net.nflog import LoggedPacket, NflogReader, split_prefix
from hutch.net.nft import SandboxNet, TableConfig
from hutch.net.nft_apply import SandboxCounters
from hutch.net.proxy import EgressProxy
from hutch.net.ratelimit import Rate
from hutch.net.rules import EgressPolicy, parse_policy
from hutch.net.summaries import Summaries
from hutch.net.views import EgressEvent, EgressView, NetworkView, PortView
from hutch.store.db import Store
from hutch.store.net import NetStore, NetworkRow
from hutch.vm.runas import qemu_uid

__all__ = ["NetworkManager", "default_upstream"]

log = logging.getLogger(__name__)

_COUNTERS_EVERY_S = 2.0
#: How often the limiters' refusals become counts and summary lines.
_REFUSALS_EVERY_S = 1.0


def default_upstream(resolv_conf: Path = Path("/etc/resolv.conf")) -> tuple[str, int]:
    """The host's first IPv4 nameserver (the daemon asks it from the host's side)."""
    try:
        for line in resolv_conf.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver" and ":" not in parts[1]:
                return parts[1], 53
    except OSError:
        pass
    # Every forwarded name then fails (SERVFAIL) rather than the daemon not starting.
    log.warning(
        "no IPv4 nameserver in %s: sandboxes cannot resolve names; set "
        "HUTCH_DNS_UPSTREAM=ip[:port]",
        resolv_conf,
    )
    return "127.0.0.1", 53


@dataclass(frozen=True)
class _Published:
    """What the data path's thread reads of the sandboxes: made whole by _publish()
    and never changed after (the next change publishes a new one)."""

    by_address: Mapping[IPv4Address, SandboxNetInfo]
    by_id: Mapping[str, SandboxNetInfo]
    by_tap: Mapping[str, str]  # tap -> sandbox id


@dataclass
class _Attached:
    """A sandbox with network ``default``."""

    sandbox_id: str
    block: Block
    tap: str
    policy: EgressPolicy

    def dataplane_view(self) -> SandboxNet:
        return SandboxNet(self.sandbox_id, self.tap, self.block.guest, self.policy)


class NetworkManager:
    """See the module docstring. ``names(sandbox_id)`` gives a sandbox's name (private
    DNS answers it); ``dataplane`` defaults to the real taps + nftables."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        names: Callable[[str], str | None],
        dataplane: Dataplane | None = None,
    ) -> None:
        self.settings = settings
        self.db = NetStore(store)
        self.pool = AddressPool(settings.net_pool)
        self.dataplane: Dataplane = dataplane or NftDataplane()
        self.real = dataplane is None
        self.log = EgressLog()
        self._names = names
        self._attached: dict[str, _Attached] = {}
        self._host_addrs: frozenset[IPv4Address] = frozenset()
        # Host address events arrive in the API's loop; the data path reads the set
        # (replaced whole) and asks the kernel at each check (_is_host).
        self._host_watch = HostAddressWatcher(host_addresses, self._host_addrs_changed)
        self._counters: dict[str, SandboxCounters] = {}
        # What the data path's thread reads: replaced whole by _publish(), never changed.
        self._published = _Published({}, {}, {})
        self._lock = asyncio.Lock()
        self._nflog: NflogReader | None = None
        self.datapath = Datapath()
        lim = settings.net_limits
        self.summaries = Summaries(self.log, lim)
        # Lives in the data path's loop: reached only through self.datapath.
        self.learner = Learner(
            self.dataplane, self._config, self._published_policy, self._forbidden
        )
        self.resolver = Resolver(
            self,
            settings.dns_upstream or default_upstream(),
            self.log,
            self.learner.learn,
            forbidden=self._forbidden,
            limit=Rate(lim.dns_rate, lim.dns_burst),
        )
        self.proxy = EgressProxy(
            self,
            self.resolver,
            self.log,
            self._forbidden,
            limit=Rate(lim.proxy_conn_rate, lim.proxy_conn_burst),
        )
        self.forwarder = PortForwarder(settings.ports_bind)
        self.cfg: TableConfig | None = None

    # -- daemon lifecycle ----------------------------------------------------------------

    async def start(self, live_ids: Collection[str]) -> None:
        """Bring the host in line with the store: leases of sandboxes not in ``live_ids``
        are dropped, taps and the table rebuilt, exposed ports listened on again."""
        self.datapath.start()
        try:
            await self._start(live_ids)
        except BaseException:
            await self.datapath.run(self.proxy.close())
            await self.datapath.run(self.resolver.close())
            await self.datapath.stop()
            await self._host_watch.close()
            raise

    async def _start(self, live_ids: Collection[str]) -> None:
        dns_port = await self.datapath.run(self.resolver.start())
        proxy_port = await self.datapath.run(self.proxy.start())
        group = 1000 + int(self.settings.daemon_tag, 16) % 30000
        self.cfg = TableConfig(
            tag=self.settings.daemon_tag,
            pool=self.settings.net_pool,
            dns_port=dns_port,
            proxy_port=proxy_port,
            nflog_group=group,
            vmm_uid=qemu_uid(self.settings) if self.real else None,
            limits=self.settings.net_limits,
        )
        if self.real:
            # Subscribed to address events before the first read: no change is missed.
            self._host_addrs = await self._host_watch.start()
            await self._check_pool_is_ours()
        live = set(live_ids)
        for sid in set(self.db.leases()) - live:
            self.db.forget_sandbox(sid)
        for sid, lease in self.db.leases().items():
            self._attached[sid] = _Attached(
                sid, self.pool.block(lease.block), lease.tap, parse_policy(self.db.rules(sid))
            )
        async with self._lock:  # a host address change waits for the table to exist
            self._publish()
            await self.dataplane.install(
                self.cfg,
                [a.dataplane_view() for a in self._attached.values()],
                {sid: a.block for sid, a in self._attached.items()},
                self._network_addresses(),
            )
        for sid, guest_port, _old in self.db.ports():
            if sid in self._attached:
                try:
                    await self._expose(sid, guest_port, _old)
                except (HutchError, OSError):
                    # The old host port is taken now: a new one (the store learns it).
                    with contextlib.suppress(HutchError, OSError):
                        await self._expose(sid, guest_port)
        if self.real:
            self._nflog = NflogReader(group)
            self.datapath.spawn(self._read_nflog, "hutch-nflog")
        self.datapath.spawn(self._poll_counters, "hutch-counters")

    async def close(self) -> None:
        """Stop the servers and readers. With sandboxes left, the nft table and taps
        stay (their traffic fails closed until a restart); with none, the table goes."""
        if self.datapath.thread is not None:
            await self.datapath.run(self.proxy.close())
            await self.datapath.run(self.resolver.close())
        await self.datapath.stop()
        if self._nflog is not None:
            self._nflog.close()  # after the loop that waited on it is gone
        await self._host_watch.close()
        if self.real and self.cfg is not None and not self.db.leases():
            with contextlib.suppress(HutchError):
                await nft_apply.delete_table(self.cfg.tag)
        await self.forwarder.shutdown()

    # -- what the resolver, the proxy and the guest ask ----------------------------------

    def lookup(self, addr: IPv4Address) -> SandboxNetInfo | None:
        """The sandbox behind a guest address (called from the data path's thread)."""
        return self._published.by_address.get(addr)

    def guest_settings(self, sandbox_id: str) -> dict[str, str] | None:
        att = self._attached.get(sandbox_id)
        if att is None:
            return None
        gw = str(att.block.gateway)
        return {
            "address": att.block.guest_cidr,
            "gateway": gw,
            "dns": gw,
            "mac": guest_mac(sandbox_id),
        }

    def address_of(self, sandbox_id: str) -> IPv4Address | None:
        att = self._attached.get(sandbox_id)
        return att.block.guest if att else None

    # -- sandboxes -----------------------------------------------------------------------

    def check_networks(self, ids_or_names: list[str]) -> list[str]:
        """The network ids for ``ids_or_names`` (NotFound names the unknown one)."""
        if len(ids_or_names) > MAX_NETWORKS_PER_SANDBOX:
            raise InvalidArgument(
                f"{len(ids_or_names)} networks given; a sandbox joins at most "
                f"{MAX_NETWORKS_PER_SANDBOX}"
            )
        return list(dict.fromkeys(self._network(n).id for n in ids_or_names))

    async def attach(
        self,
        sandbox_id: str,
        policy: EgressPolicy,
        network_ids: Sequence[str] = (),
    ) -> None:
        """Give ``sandbox_id`` an address, a tap and its policy; join ``network_ids``."""
        cfg = self._config()
        async with self._lock:
            used = {lease.block for lease in self.db.leases().values()}
            block = self.pool.block(self.pool.first_free(used))
            tap = tap_name(self.settings.daemon_tag, sandbox_id)
            self.db.add_lease(sandbox_id, block.index, tap)
            self.db.set_rules(sandbox_id, policy.texts())
            att = _Attached(sandbox_id, block, tap, policy)
            try:
                await self.dataplane.add(cfg, att.dataplane_view(), block)
            except BaseException:
                self.db.forget_sandbox(sandbox_id)
                with contextlib.suppress(Exception):
                    await self.dataplane.remove(cfg, att.dataplane_view())
                raise
            self._attached[sandbox_id] = att
            for nid in network_ids:
                self.db.add_member(nid, sandbox_id)
            self._publish()
            if network_ids:
                await self.dataplane.set_networks(cfg, self._network_addresses())

    async def detach(self, sandbox_id: str) -> None:
        """Take everything back. Safe to call twice and for sandboxes never attached."""
        cfg = self._config()
        await self.forwarder.close_all(sandbox_id)
        async with self._lock:
            att = self._attached.pop(sandbox_id, None)
            had_networks = bool(self.db.networks_of(sandbox_id))
            lease = self.db.leases().get(sandbox_id)
            self.db.forget_sandbox(sandbox_id)
            if att is None and lease is not None:
                att = _Attached(
                    sandbox_id, self.pool.block(lease.block), lease.tap, EgressPolicy.open()
                )
            self._publish()
            if att is not None:
                await self.dataplane.remove(cfg, att.dataplane_view())
            if had_networks:
                await self.dataplane.set_networks(cfg, self._network_addresses())
        self.log.forget(sandbox_id)
        if self.datapath.thread is not None:
            await self.datapath.call(self.learner.forget, sandbox_id)
        else:
            self.learner.forget(sandbox_id)

    def is_attached(self, sandbox_id: str) -> bool:
        return sandbox_id in self._attached

    # -- egress --------------------------------------------------------------------------

    def policy_of(self, sandbox_id: str) -> EgressPolicy:
        att = self._attached.get(sandbox_id)
        return att.policy if att else parse_policy(self.db.rules(sandbox_id))

    async def set_policy(self, sandbox_id: str, policy: EgressPolicy) -> EgressView:
        """Swap the rules live. What the new rules no longer allow stops at once: the
        nft flows of older rules are checked again on their next packet (see
        :mod:`hutch.net.nft`) and the proxy cuts the connections it relays for names
        no longer allowed; addresses learned for names still allowed are carried over."""
        att = self._require(sandbox_id)
        async with self._lock:
            new = _Attached(att.sandbox_id, att.block, att.tap, policy)
            # In the data path's loop, ordered against its learnings (hutch.net.learning).
            await self.datapath.run(self.learner.swap(new.dataplane_view(), policy))
            # Stored only once the host enforces it: a failure keeps the old rules.
            self.db.set_rules(sandbox_id, policy.texts())
            self._attached[sandbox_id] = new
            self._publish()
            # After the publish: a connection decided under the old rules and registered
            # after this cut meets the new rules when it registers (see the proxy).
            await self.datapath.call(self.proxy.revalidate, sandbox_id, policy)
        return self.egress_view(sandbox_id)

    def egress_view(self, sandbox_id: str) -> EgressView:
        policy = self.policy_of(sandbox_id)
        # Decisions of the resolver and the proxy, plus what nft counts (its denials are
        # in the log too, recorded without counting them twice).
        allowed, denied = self.log.counters(sandbox_id)
        limited, unlogged = self.log.rate_limited(sandbox_id), 0
        nft = self._counters.get(sandbox_id)
        if nft is not None:
            allowed += nft.allowed
            denied += nft.denied
            limited += nft.rate_limited
            unlogged = nft.unlogged
        return EgressView(policy.texts(), policy.mode, allowed, denied, limited, unlogged)

    def events(self, sandbox_id: str, limit: int) -> list[EgressEvent]:
        return self.log.events(sandbox_id, limit)

    # -- private networks ----------------------------------------------------------------

    def create_network(self, name: str) -> NetworkView:
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise InvalidArgument(
                f"network name {name!r} is not valid; use 1-63 lower-case letters, digits "
                "and '-', starting and ending with a letter or digit"
            )
        if _NETWORK_ID_RE.match(name):
            raise InvalidArgument(f"network name {name!r} looks like a network id; pick another")
        row = NetworkRow("net-" + secrets.token_hex(6), name, time.time())
        self.db.insert_network(row)
        return self.network_view(row.id)

    def list_networks(self) -> list[NetworkView]:
        return [self._view(row) for row in self.db.networks()]

    def network_view(self, id_or_name: str) -> NetworkView:
        return self._view(self._network(id_or_name))

    async def delete_network(self, id_or_name: str) -> None:
        row = self._network(id_or_name)
        async with self._lock:
            self.db.delete_network(row.id)
            self._publish()
            await self.dataplane.set_networks(
                self._config(), self._network_addresses(), removed=[row.id]
            )

    async def join(self, sandbox_id: str, id_or_name: str) -> NetworkView:
        self._require(sandbox_id)
        row = self._network(id_or_name)
        current = self.db.networks_of(sandbox_id)
        if row.id not in current and len(current) >= MAX_NETWORKS_PER_SANDBOX:
            raise Conflict(f"sandbox {sandbox_id} is already on {len(current)} networks (the most)")
        async with self._lock:
            self.db.add_member(row.id, sandbox_id)
            self._publish()
            await self.dataplane.set_networks(self._config(), self._network_addresses())
        return self._view(row)

    async def leave(self, sandbox_id: str, id_or_name: str) -> None:
        row = self._network(id_or_name)
        if row.id not in self.db.networks_of(sandbox_id):
            raise NotFound(f"sandbox {sandbox_id} is not on network {row.id} ({row.name})")
        async with self._lock:
            self.db.remove_member(row.id, sandbox_id)
            self._publish()
            await self.dataplane.set_networks(self._config(), self._network_addresses())

    def networks_of(self, sandbox_id: str) -> list[str]:
        return self.db.networks_of(sandbox_id)

    # -- inbound ports -------------------------------------------------------------------

    async def expose(self, sandbox_id: str, port: int) -> PortView:
        self._require(sandbox_id)
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise InvalidArgument(f"port {port!r} is not a TCP port; accepted: 1-65535")
        return await self._expose(sandbox_id, port)

    async def _expose(self, sandbox_id: str, port: int, host_port: int = 0) -> PortView:
        existing = self.forwarder.exposed(sandbox_id).get(port)
        if existing is None:
            existing = await self.forwarder.expose(
                sandbox_id, self._attached[sandbox_id].block.guest, port, host_port
            )
            self.db.add_port(sandbox_id, port, existing)
        return self._port_view(port, existing)

    def ports(self, sandbox_id: str) -> list[PortView]:
        return [
            self._port_view(guest, host)
            for guest, host in sorted(self.forwarder.exposed(sandbox_id).items())
        ]

    async def unexpose(self, sandbox_id: str, port: int) -> None:
        if port not in self.forwarder.exposed(sandbox_id):
            raise NotFound(
                f"port {port} of sandbox {sandbox_id} is not exposed; "
                f"GET /v1/sandboxes/{sandbox_id}/ports lists those that are"
            )
        await self.forwarder.close(sandbox_id, port)
        self.db.remove_port(sandbox_id, port)

    # -- internals -----------------------------------------------------------------------

    async def _check_pool_is_ours(self) -> None:
        """Refuse a pool that addresses on other interfaces already use (another daemon
        with the same HUTCH_NET_POOL, a VPN, ...): routes to sandboxes would be ambiguous."""
        out = await links.run_ip(["-j", "addr", "show"])
        prefix = tap_prefix(self.settings.daemon_tag)
        for link in json.loads(out or "[]"):
            name = str(link.get("ifname", ""))
            if name.startswith(prefix):
                continue
            for info in link.get("addr_info", []):
                if info.get("family") != "inet":
                    continue
                iface = IPv4Interface(f"{info.get('local')}/{info.get('prefixlen')}")
                if iface.network.overlaps(self.settings.net_pool):
                    raise NetworkError(
                        f"the sandbox address pool {self.settings.net_pool} overlaps "
                        f"{iface} on interface {name}; set HUTCH_NET_POOL to a free range"
                    )

    def _config(self) -> TableConfig:
        if self.cfg is None:
            raise NetworkError("networking has not started")
        return self.cfg

    def _require(self, sandbox_id: str) -> _Attached:
        att = self._attached.get(sandbox_id)
        if att is None:
            raise Conflict(
                f'sandbox {sandbox_id} has no network (created with network "none"); '
                'create it with network "default" to use egress rules, ports or networks'
            )
        return att

    def _publish(self) -> None:
        """Replace the data path's view of the sandboxes (one assignment: its thread sees
        the old snapshot or the new one, never a half-made one). Called under _lock, so
        snapshots are published in the order the changes were made."""
        infos = {
            sid: SandboxNetInfo(sid, a.policy, self._peers(sid))
            for sid, a in self._attached.items()
        }
        self._published = _Published(
            by_address={a.block.guest: infos[sid] for sid, a in self._attached.items()},
            by_id=infos,
            by_tap={a.tap: sid for sid, a in self._attached.items()},
        )

    def _published_policy(self, sandbox_id: str) -> EgressPolicy | None:
        info = self._published.by_id.get(sandbox_id)
        return info.policy if info is not None else None

    def _network(self, id_or_name: str) -> NetworkRow:
        row = self.db.network(id_or_name) if isinstance(id_or_name, str) else None
        if row is None:
            raise NotFound(f"no network {id_or_name!r}; GET /v1/networks lists them")
        return row

    def _view(self, row: NetworkRow) -> NetworkView:
        return NetworkView(row.id, row.name, row.created_at, self.db.members(row.id))

    def _network_addresses(self) -> dict[str, list[IPv4Address]]:
        out: dict[str, list[IPv4Address]] = {}
        for nid, members in self.db.memberships().items():
            out[nid] = [self._attached[m].block.guest for m in members if m in self._attached]
        return out

    def _peers(self, sandbox_id: str) -> dict[str, IPv4Address]:
        peers: dict[str, IPv4Address] = {}
        memberships = self.db.memberships()
        for nid in self.db.networks_of(sandbox_id):
            for member in memberships.get(nid, []):
                att = self._attached.get(member)
                if member == sandbox_id or att is None:
                    continue
                for label in (member, self._names(member)):
                    if label:
                        peers[label.lower()] = att.block.guest
                        peers[f"{label.lower()}.{INTERNAL_SUFFIX}"] = att.block.guest
        return peers

    def _port_view(self, guest: int, host_port: int) -> PortView:
        host = self.settings.ports_bind
        shown = f"[{host}]" if ":" in host else host
        return PortView(guest, host, host_port, f"http://{shown}:{host_port}")

    def _is_host(self, addr: IPv4Address) -> bool:
        """The host's own address: in the last set read, or (asked of the kernel now) an
        address that appeared since."""
        return addr in self._host_addrs or is_host_address(addr)

    def _forbidden(self, addr: IPv4Address) -> Forbidden | None:
        """Why a name must not lead to ``addr`` (called from the data path's thread)."""
        return classify_destination(addr, self.pool, self._is_host)

    async def _host_addrs_changed(self, addrs: frozenset[IPv4Address]) -> None:
        async with self._lock:
            if self.cfg is not None:
                await self.dataplane.set_host_addrs(self.cfg, addrs)
            self._host_addrs = addrs  # replaced whole: the data path's thread reads it

    async def _poll_counters(self) -> None:
        """In the data path's loop: the limiters' refusals every second and the nft
        counters every _COUNTERS_EVERY_S become counts and summary lines."""
        polled = 0.0
        while True:
            self._account_refusals()
            if time.monotonic() - polled >= _COUNTERS_EVERY_S:
                polled = time.monotonic()
                with contextlib.suppress(HutchError):
                    self._counters = await self.dataplane.counters(self._config())
                    self.summaries.kernel(self._counters)
            await asyncio.sleep(_REFUSALS_EVERY_S)

    def _account_refusals(self) -> None:
        self.summaries.take_refused(
            [("dns", self.resolver.limiter), ("proxy", self.proxy.limiter)],
            self.lookup,
            _REFUSALS_EVERY_S,
        )

    async def _read_nflog(self) -> None:
        assert self._nflog is not None
        try:
            async for packet in self._nflog:
                self._record_packet(packet)
        except HutchError as exc:
            log.warning("NFLOG reader stopped: %s", exc)

    def _record_packet(self, packet: LoggedPacket) -> None:
        tag, sid, reason = split_prefix(packet.prefix)
        if tag != f"h{self.settings.daemon_tag}":
            return
        published = self._published
        if sid is None and packet.indev:
            sid = published.by_tap.get(packet.indev)
        if sid is None or sid not in published.by_id:
            return  # not ours, or deleted since (its log is gone; do not make a new one)
        # The nft deny counter counts it already: logged, not counted again.
        self.log.record(
            EgressEvent(
                time=packet.time,
                sandbox_id=sid,
                destination=str(packet.dst) if packet.dst else "?",
                port=packet.dport,
                protocol=packet.protocol,
                name=None,
                verdict="deny",
                rule=None,
                reason=_REASONS.get(reason, reason),
            ),
            count=False,
        )


_REASONS = {
    "unregistered": "always denied: an interface hutch does not know",
    "ipv6": "always denied: IPv6 (sandboxes are IPv4 only)",
    "spoof": "always denied: source address is not the sandbox's own",
    "host": "always denied: the host itself (daemon API included)",
    "link-local": "always denied: link-local / cloud metadata",
    "sandbox": "always denied: another sandbox not on a shared private network",
    "multicast": "always denied: multicast or broadcast",
    "smtp": "always denied: SMTP (tcp port 25)",
    "policy": "no egress rule allows this destination",
    "quic": (
        "udp 443 (QUIC): under rules only an ip/cidr rule opens it (QUIC's server name "
        "is not checked); HTTPS over TCP works"
    ),
}
