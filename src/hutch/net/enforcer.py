"""Everything that enforces the sandboxes' networking on the host, as one driver: the
kernel's side (taps and the nft table, :mod:`hutch.net.dataplane`) and the data path
(:mod:`hutch.net.datapath`: its own thread and loop running the resolver, the SNI/Host
proxy, the learned sets of :mod:`hutch.net.learning`, the NFLOG reader and the counter
poll), plus the host-address watcher, which stays in the caller's (the API's) loop.

It keeps no record of its own: :class:`hutch.services.network.NetworkService` owns the
leases, rules, networks and ports (in the store) and drives this with plain values: the
sandboxes' :class:`~hutch.net.nft_common.SandboxNet` views and blocks, the networks' member
addresses, the QEMU uid, and a :class:`Snapshot` of who is behind each address. What the
data path's thread reads is that snapshot, which the service replaces whole after every
change (one assignment: the thread sees the old one or the new one, never half of
either); calls into the data path's objects go through ``Datapath.run``/``Datapath.call``,
never directly.

Changes to the table from the caller's loop (install, add, remove, policy swaps,
networks, the host's addresses) are made one at a time (one lock), so a host address
event never rewrites ``host_addrs`` in the middle of a rebuild. Learning writes from
the data path are ordered per sandbox against swaps by :class:`~hutch.net.learning.Learner`.

While the daemon is down the table stays in place and the resolver and proxy ports are
closed: sandboxes fail closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Interface, IPv4Network
from pathlib import Path
from typing import NamedTuple

from hutch.config import NetLimits
from hutch.contract.views import DenialSpike, EgressEvent, EgressView
from hutch.errors import HutchError, NetworkError
from hutch.net import links, nft_apply
from hutch.net.addressing import AddressPool, Block, host_addresses, tap_prefix
from hutch.net.datapath import Datapath
from hutch.net.dataplane import Dataplane, NftDataplane
from hutch.net.destinations import Forbidden, classify_destination
from hutch.net.dns import Resolver, SandboxNetInfo
from hutch.net.egress_log import DenialTally, EgressLog
from hutch.net.host_addresses import HostAddressWatcher, is_host_address
from hutch.net.learning import Learner
from hutch.net.nflog import LoggedPacket, NflogReader, split_prefix
from hutch.net.nft_apply import SandboxCounters
from hutch.net.nft_common import SandboxNet, TableConfig
from hutch.net.proxy import EgressProxy
from hutch.net.ratelimit import Rate
from hutch.net.rules import EgressPolicy
from hutch.net.summaries import Summaries
from hutch.net.tls_ca import ProjectCAs, upstream_context
from hutch.net.tunnel import TunnelConfig, TunnelState

__all__ = ["Enforcer", "Entry", "Snapshot", "default_upstream"]

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


class Entry(NamedTuple):
    """One attached sandbox as the data path sees it."""

    info: SandboxNetInfo  # id, policy, private-network peers
    address: IPv4Address  # the guest's
    tap: str


@dataclass(frozen=True)
class Snapshot:
    """What the data path's thread reads of the sandboxes: made whole by :meth:`of` and
    never changed after (the next change publishes a new one)."""

    by_address: Mapping[IPv4Address, SandboxNetInfo]
    by_id: Mapping[str, SandboxNetInfo]
    by_tap: Mapping[str, str]  # tap -> sandbox id

    @classmethod
    def of(cls, entries: Iterable[Entry]) -> Snapshot:
        items = list(entries)
        return cls(
            by_address={e.address: e.info for e in items},
            by_id={e.info.sandbox_id: e.info for e in items},
            by_tap={e.tap: e.info.sandbox_id for e in items},
        )


class Enforcer:
    """See the module docstring. ``tag`` is the daemon's 4 hex digits (its table
    ``inet hutch_<tag>`` and taps ``h<tag>*``); ``pool`` the sandboxes' address pool;
    ``upstream`` (ip, port) where allowed names are resolved; ``dataplane`` defaults to
    the real taps + nftables (then the host's addresses are watched, the pool is checked
    against the host's interfaces and denials are read from NFLOG)."""

    def __init__(
        self,
        *,
        tag: str,
        pool: AddressPool,
        limits: NetLimits,
        upstream: tuple[str, int],
        dataplane: Dataplane | None = None,
        ca_dir: Path | None = None,
        upstream_ca: Path | None = None,
        tunnel: TunnelConfig | None = None,
    ) -> None:
        """``ca_dir``: where the TLS-inspection CA lives (made at :meth:`start`; None:
        inspection ``full`` is refused per connection); ``upstream_ca``: the CAs upstream
        servers are verified against then (None: the host's trust store)."""
        self.tag = tag
        self.tunnel = tunnel  # this daemon's end of the overlay (None: one host)
        self._ca_dir = ca_dir
        self._upstream_ca = upstream_ca
        self.pool = pool
        self.limits = limits
        self.dataplane: Dataplane = dataplane or NftDataplane()
        self.real = dataplane is None
        self.log = EgressLog(spike_per_min=limits.deny_spike_per_min, on_spike=self._denial_spike)
        #: Called with every DenialSpike (in the data path's thread), for alerts. The
        #: event log's ``egress.denied`` takes its summaries from :meth:`take_denials`
        #: instead (a spike is its ``spike`` flag). None: the spike is logged only.
        self.denial_spike_hook: Callable[[DenialSpike], None] | None = None
        self._host_addrs: frozenset[IPv4Address] = frozenset()
        # Host address events arrive in the caller's loop; the data path reads the set
        # (replaced whole) and asks the kernel at each check (_is_host).
        self._host_watch = HostAddressWatcher(host_addresses, self._host_addrs_changed)
        self._counters: dict[str, SandboxCounters] = {}
        # The byte and denial deltas of the nft counters go to the log's tallies once:
        # under this lock (the poll in the data path's thread, a removal in the caller's),
        # never for a sandbox removed after the read began (_gone).
        self._account_lock = threading.Lock()
        self._reads = self._accounted = 0
        self._gone: dict[str, int] = {}
        # What the data path's thread reads: replaced whole by publish(), never changed.
        self._published = Snapshot({}, {}, {})
        self._lock = asyncio.Lock()  # table changes from the caller's loop, one at a time
        self._nflog: NflogReader | None = None
        self.datapath = Datapath()
        self.summaries = Summaries(self.log, limits)
        # Lives in the data path's loop: reached only through self.datapath.
        self.learner = Learner(self.dataplane, self.config, self._published_policy, self.forbidden)
        self.resolver = Resolver(
            self,
            upstream,
            self.log,
            self.learner.learn,
            forbidden=self.forbidden,
            limit=Rate(limits.dns_rate, limits.dns_burst),
        )
        self.proxy = EgressProxy(
            self,
            self.resolver,
            self.log,
            self.forbidden,
            limit=Rate(limits.proxy_conn_rate, limits.proxy_conn_burst),
        )
        self.cfg: TableConfig | None = None

    # -- daemon lifecycle ----------------------------------------------------------------

    async def start(self, *, vmm_uid: int | None) -> None:
        """Start the data path and its servers (the table is not touched yet: see
        :meth:`install`); IP traffic that ``vmm_uid`` originates will be dropped. With
        the real dataplane, watch the host's addresses and refuse a pool that another
        interface uses. On failure everything started is stopped again."""
        if self._ca_dir is not None:
            # Before the data path runs: the proxy never sees a half-made CA.
            self.proxy.ca = ProjectCAs(self._ca_dir)
            self.proxy.upstream_tls = upstream_context(self._upstream_ca)
        self.datapath.start()
        try:
            dns_port = await self.datapath.run(self.resolver.start())
            proxy_port = await self.datapath.run(self.proxy.start())
            self.cfg = TableConfig(
                tag=self.tag,
                pool=self.pool.network,
                dns_port=dns_port,
                proxy_port=proxy_port,
                nflog_group=1000 + int(self.tag, 16) % 30000,
                vmm_uid=vmm_uid,
                limits=self.limits,
                tunnel=self.tunnel,
            )
            if self.real:
                # Subscribed to address events before the first read: no change is missed.
                self._host_addrs = await self._host_watch.start()
                await self._check_pool_is_ours()
        except BaseException:
            await self._stop_servers()
            raise

    async def install(
        self,
        sandboxes: Sequence[SandboxNet],
        blocks: Mapping[str, Block],
        networks: Mapping[str, Sequence[IPv4Address]],
        snapshot: Snapshot,
    ) -> None:
        """Make the host exactly this, once after :meth:`start`: the taps of
        ``sandboxes`` (with their ``blocks``; other taps of this daemon are deleted), the
        whole table in one transaction, the private ``networks``' member sets;
        ``snapshot`` published. Then denials (NFLOG) and counters are read."""
        cfg = self.config()
        async with self._lock:  # a host address change waits for the table to exist
            self.publish(snapshot)
            await self.dataplane.install(cfg, sandboxes, blocks, networks)
        if self.real:
            self._nflog = NflogReader(cfg.nflog_group)
            self.datapath.spawn(self._read_nflog, "hutch-nflog")
        self.datapath.spawn(self._poll_counters, "hutch-counters")

    async def close(self, *, drop_table: bool) -> None:
        """Stop the servers and readers. ``drop_table`` (no sandbox is left) deletes the
        nft table; else the table and taps stay (their traffic fails closed until a
        restart)."""
        await self._stop_servers()
        if self.real and self.cfg is not None and drop_table:
            with contextlib.suppress(HutchError):
                await nft_apply.delete_table(self.cfg.tag)

    async def _stop_servers(self) -> None:
        if self.datapath.thread is not None:
            await self.datapath.run(self.proxy.close())
            await self.datapath.run(self.resolver.close())
        await self.datapath.stop()
        if self._nflog is not None:
            self._nflog.close()  # after the loop that waited on it is gone
            self._nflog = None
        await self._host_watch.close()

    def config(self) -> TableConfig:
        if self.cfg is None:
            raise NetworkError("networking has not started")
        return self.cfg

    # -- what the caller changes ---------------------------------------------------------

    def publish(self, snapshot: Snapshot) -> None:
        """Replace the data path's view of the sandboxes. The caller publishes in the
        order its changes were made (under its own lock)."""
        self._published = snapshot

    async def add(self, sb: SandboxNet, block: Block) -> None:
        """Create ``sb``'s tap (gateway of ``block``) and its table entries. On failure
        what was made is taken back and the error raised."""
        cfg = self.config()
        async with self._lock:
            try:
                await self.dataplane.add(cfg, sb, block)
            except BaseException:
                with contextlib.suppress(Exception):
                    await self.dataplane.remove(cfg, sb)
                raise

    async def remove(self, sb: SandboxNet) -> None:
        """Delete ``sb``'s table entries and tap. Safe for a sandbox never added. Its
        counters are read one last time first, so no byte since the last poll is lost."""
        cfg = self.config()
        async with self._lock:
            with contextlib.suppress(HutchError):
                await self._read_counters(last_of=sb.sandbox_id)
            await self.dataplane.remove(cfg, sb)

    async def forget(self, sandbox_id: str) -> None:
        """Drop the egress log and the learned memory of ``sandbox_id``. Safe twice."""
        self.log.forget(sandbox_id)
        if self.datapath.thread is not None:
            await self.datapath.call(self.learner.forget, sandbox_id)
        else:
            self.learner.forget(sandbox_id)

    async def swap_policy(self, sb: SandboxNet, policy: EgressPolicy) -> None:
        """Give ``sb.sandbox_id`` the rules ``policy`` (``sb.policy``) in nft, in the data
        path's loop (ordered against its learnings; addresses learned for names still
        allowed are carried over). Raises what the dataplane raises: the old rules stay."""
        async with self._lock:
            await self.datapath.run(self.learner.swap(sb, policy))
        self.log.reset_rule_counts(sb.sandbox_id)

    def _denial_spike(self, spike: DenialSpike) -> None:
        log.warning(
            "egress denial spike: sandbox %s, %d denials this minute (threshold %d)",
            spike.sandbox_id, spike.denials, spike.threshold,
        )  # fmt: skip
        hook = self.denial_spike_hook
        if hook is not None:
            try:
                hook(spike)
            except Exception:  # an alert must never break the data path
                log.exception("denial spike hook failed")

    async def revalidate(self, sandbox_id: str, policy: EgressPolicy) -> int:
        """Cut the connections the proxy relays for ``sandbox_id`` that ``policy`` no
        longer allows; returns how many. Call after publishing ``policy``: a connection
        decided under the old rules and registered after that meets the new ones."""
        return await self.datapath.call(self.proxy.revalidate, sandbox_id, policy)

    async def set_networks(
        self, networks: Mapping[str, Sequence[IPv4Address]], removed: Iterable[str] = ()
    ) -> None:
        """The private networks' member addresses are exactly ``networks`` (``removed``:
        networks deleted since)."""
        cfg = self.config()
        async with self._lock:
            await self.dataplane.set_networks(cfg, networks, removed)

    async def set_cluster(
        self,
        pools: Iterable[IPv4Network],
        peers: Iterable[IPv4Address],
        tunnel: TunnelState,
    ) -> None:
        """The other hosts' pools and endpoints (always denied) and what the overlay
        carries (:mod:`hutch.net.tunnel`): the nft sets first, then the routes."""
        cfg = self.config()
        async with self._lock:
            await self.dataplane.set_cluster(cfg, pools, peers)
            if cfg.tunnel is not None:
                await self.dataplane.sync_tunnel(cfg, tunnel)

    async def drop_tunnel(self) -> None:
        """Remove the overlay device (daemon start: a crash's leftovers; stop)."""
        cfg = self.config()
        if cfg.tunnel is not None:
            async with self._lock:
                await self.dataplane.drop_tunnel(cfg)

    # -- what the caller reads -----------------------------------------------------------

    def egress_view(self, sandbox_id: str, policy: EgressPolicy) -> EgressView:
        """``policy`` with the counts: decisions of the resolver and the proxy, plus what
        nft counts (its denials are in the log too, recorded without counting them twice)."""
        allowed, denied = self.log.counters(sandbox_id)
        limited, unlogged = self.log.rate_limited(sandbox_id), 0
        nft = self._counters.get(sandbox_id)
        if nft is not None:
            allowed += nft.allowed
            denied += nft.denied
            limited += nft.rate_limited
            unlogged = nft.unlogged
        document = policy.ordered.document() if policy.ordered is not None else None
        counts = self.log.rule_counts(sandbox_id) if document is not None else ()
        # A policy's own mode (default allow with denies is "rules", as the contract's
        # evaluator says), not its address-level lowering (open, less the denies).
        mode = policy.ordered.mode if policy.ordered and policy.observe is None else policy.mode
        return EgressView(
            policy.texts(), mode, allowed, denied, limited, unlogged, document, counts
        )

    def events(self, sandbox_id: str, limit: int) -> list[EgressEvent]:
        return self.log.events(sandbox_id, limit)

    def take_bytes(self) -> dict[str, tuple[int, int]]:
        """(sent, denied) bytes per sandbox since the last take: forwarded from its tap
        out of the host (nft) and relayed upstream by the proxy, never both for one
        byte (proxied traffic is redirected to the host, not forwarded); denied: bytes
        of the packets nft dropped. Counted by the poll (every ``_COUNTERS_EVERY_S``)."""
        return self.log.take_bytes()

    def add_back(self, sandbox_id: str, sent: int, denied: int) -> None:
        """Bytes taken that could not be written: taken again with the next take."""
        self.log.add_bytes(sandbox_id, sent=sent, denied=denied)

    def take_denials(self) -> dict[str, DenialTally]:
        """The denials per sandbox since the last take (see :meth:`EgressLog.take_denials`)."""
        return self.log.take_denials()

    # -- what the resolver, the proxy and the learner ask (the data path's thread) -------

    def lookup(self, addr: IPv4Address) -> SandboxNetInfo | None:
        """The sandbox behind a guest address."""
        return self._published.by_address.get(addr)

    def _published_policy(self, sandbox_id: str) -> EgressPolicy | None:
        info = self._published.by_id.get(sandbox_id)
        return info.policy if info is not None else None

    def _is_host(self, addr: IPv4Address) -> bool:
        """The host's own address: in the last set read, or (asked of the kernel now) an
        address that appeared since."""
        return addr in self._host_addrs or is_host_address(addr)

    def forbidden(self, addr: IPv4Address) -> Forbidden | None:
        """Why a name must not lead to ``addr``."""
        return classify_destination(addr, self.pool, self._is_host)

    # -- internals -----------------------------------------------------------------------

    async def _check_pool_is_ours(self) -> None:
        """Refuse a pool that addresses on other interfaces already use (another daemon
        with the same HUTCH_NET_POOL, a VPN, ...): routes to sandboxes would be ambiguous."""
        out = await links.run_ip(["-j", "addr", "show"])
        prefix = tap_prefix(self.tag)
        pool = self.pool.network
        for link in json.loads(out or "[]"):
            name = str(link.get("ifname", ""))
            if name.startswith(prefix):
                continue
            for info in link.get("addr_info", []):
                if info.get("family") != "inet":
                    continue
                iface = IPv4Interface(f"{info.get('local')}/{info.get('prefixlen')}")
                if iface.network.overlaps(pool):
                    raise NetworkError(
                        f"the sandbox address pool {pool} overlaps "
                        f"{iface} on interface {name}; set HUTCH_NET_POOL to a free range"
                    )

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
                    await self._read_counters()
                    self.summaries.kernel(self._counters)
            await asyncio.sleep(_REFUSALS_EVERY_S)

    async def _read_counters(self, last_of: str | None = None) -> None:
        """Read the nft counters; their growth since the last read goes to the log's
        tallies. ``last_of``: that sandbox is about to be removed (counted now, and
        never again: a read that still sees it must not count it from zero)."""
        with self._account_lock:
            self._reads += 1
            seq = self._reads
        counters = await self.dataplane.counters(self.config())
        with self._account_lock:
            if seq < self._accounted:
                return  # a newer read was counted meanwhile: this one is stale
            self._accounted = seq
            previous = self._counters
            for sid, now in counters.items():
                if sid in self._gone and sid != last_of:
                    continue  # counted to its end already
                before = previous.get(sid, SandboxCounters(0, 0))
                self.log.add_bytes(
                    sid,
                    sent=_grew(before.sent_bytes, now.sent_bytes),
                    denied=_grew(before.denied_bytes, now.denied_bytes),
                    denials=_grew(before.denied, now.denied),
                )
            merged = dict(counters)
            if last_of is not None:
                self._gone[last_of] = seq
                merged.pop(last_of, None)
            for sid in [s for s in self._gone if s not in counters and self._gone[s] < seq]:
                # Gone from the table for a read begun after its removal: no later read
                # sees it (polls run one at a time, so none begun earlier is pending).
                del self._gone[sid]
            self._counters = merged

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
        if tag != f"h{self.tag}":
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


def _grew(before: int, now: int) -> int:
    """How much a counter grew (one that went down was re-created: all of it)."""
    return now - before if now >= before else now
