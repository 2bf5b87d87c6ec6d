"""The networking use case: each sandbox's address lease, egress policy, private networks
and exposed ports, kept in the store (:mod:`hutch.store.net`) and pushed to the host's
enforcement (:class:`hutch.net.enforcer.Enforcer`: taps, the nft table and the data path
with its resolver and proxy) and the port forwarder (:mod:`hutch.net.inbound`).

This is the only place that knows both the rows and the host: the drivers under
``hutch.net`` take plain values (a sandbox's ``SandboxNet`` view and block, member
addresses, the QEMU uid) and a :class:`~hutch.net.enforcer.Snapshot` of who is behind
each address, which this service rebuilds from its state and publishes after every
change, under its lock, so snapshots are published in the order the changes were made.

The sandbox services call it through one attribute (``net``); the names and signatures
they use (``attach``, ``detach``, ``set_policy``, ``join``, ``leave``, ``expose``, ...)
are this class's public surface.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address
from urllib.parse import urlsplit

from hutch.config import Settings
from hutch.contract.limits import MAX_NETWORKS_PER_SANDBOX
from hutch.contract.names import NETWORK_ID_RE as _NETWORK_ID_RE
from hutch.contract.views import EgressEvent, EgressView, NetworkView, PortView
from hutch.errors import Conflict, HutchError, InvalidArgument, NetworkError, NotFound
from hutch.models import NAME_RE
from hutch.net.addressing import AddressPool, Block, guest_mac, tap_name
from hutch.net.dataplane import Dataplane
from hutch.net.dns import INTERNAL_SUFFIX, SandboxNetInfo
from hutch.net.enforcer import Enforcer, Entry, Snapshot, default_upstream
from hutch.net.inbound import PortForwarder
from hutch.net.nft_common import SandboxNet
from hutch.net.rules import EgressPolicy, policy_from_stored
from hutch.net.tunnel import TunnelConfig
from hutch.services.overlay import POLL_S, Overlay, overlay_of
from hutch.store.db import Store
from hutch.store.net import NetStore, NetworkRow, TunnelRow
from hutch.vm.runas import qemu_uid

__all__ = ["NetworkService"]

log = logging.getLogger(__name__)


@dataclass
class _Attached:
    """A sandbox with network ``default``."""

    sandbox_id: str
    block: Block
    tap: str
    policy: EgressPolicy
    project: str = "default"  # whose secrets the proxy's transforms read

    def dataplane_view(self) -> SandboxNet:
        return SandboxNet(self.sandbox_id, self.tap, self.block.guest, self.policy)


class NetworkService:
    """See the module docstring. ``names(sandbox_id)`` gives a sandbox's name (private
    DNS answers it); ``dataplane`` defaults to the real taps + nftables (the component
    tier passes :class:`hutch.net.dataplane.MemoryDataplane`)."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        names: Callable[[str], str | None],
        dataplane: Dataplane | None = None,
    ) -> None:
        self.settings = settings
        self._store = store
        self.db = NetStore(store, settings.host_id)
        self.pool = AddressPool(settings.net_pool)
        self.enforcer = Enforcer(
            tag=settings.daemon_tag,
            pool=self.pool,
            limits=settings.net_limits,
            upstream=settings.dns_upstream or default_upstream(),
            dataplane=dataplane,
            ca_dir=settings.egress_ca_dir,
            upstream_ca=settings.egress_upstream_ca,
            tunnel=tunnel_config(settings),
        )
        #: The egress log (written by the data path, read here and by tests).
        self.log = self.enforcer.log
        #: Exposed ports; the sandbox services set ``forwarder.activity`` (auto-pause).
        self.forwarder = PortForwarder(settings.ports_bind)
        self._names = names
        self._attached: dict[str, _Attached] = {}
        # Orders the service's changes: rows, what is attached, the host, the publish.
        self._lock = asyncio.Lock()
        # The members on the other hosts (private networks across hosts), and the task
        # that reads them from the shared store every POLL_S.
        self._overlay = Overlay()
        self._overlay_applied = False
        self._overlay_task: asyncio.Task[None] | None = None

    # -- daemon lifecycle ----------------------------------------------------------------

    async def start(self, live_ids: Collection[str]) -> None:
        """Bring the host in line with the store: leases of sandboxes not in ``live_ids``
        are dropped, taps and the table rebuilt, exposed ports listened on again."""
        await self.enforcer.start(vmm_uid=qemu_uid(self.settings) if self.enforcer.real else None)
        try:
            tunnel = self.enforcer.tunnel
            if tunnel is not None:
                # What a crashed daemon left goes first; the overlay is rebuilt below.
                await self.enforcer.drop_tunnel()
                self.db.set_tunnel(
                    TunnelRow(
                        self.settings.host_id,
                        str(tunnel.local),
                        tunnel.port,
                        tunnel.mac,
                        str(self.pool.network),
                    )
                )
            await self._reconcile(set(live_ids))
            if tunnel is not None:
                async with self._lock:
                    try:
                        await self._sync_overlay(force=True)
                    except NetworkError:
                        # The tunnel failed closed (members elsewhere unreachable); the
                        # rest of the host serves, and the poll tries again.
                        log.exception("private networks across hosts: the overlay failed")
                self._overlay_task = asyncio.create_task(self._poll_overlay())
        except BaseException:
            await self.forwarder.shutdown()
            with contextlib.suppress(HutchError):
                await self.enforcer.drop_tunnel()
            await self.enforcer.close(drop_table=False)
            raise

    async def _reconcile(self, live: set[str]) -> None:
        for sid in set(self.db.leases()) - live:
            self.db.forget_sandbox(sid)
        for sid, lease in self.db.leases().items():
            self._attached[sid] = _Attached(
                sid,
                self.pool.block(lease.block),
                lease.tap,
                policy_from_stored(self.db.rules(sid)),
                self._project_of(sid),
            )
        async with self._lock:
            await self.enforcer.install(
                [a.dataplane_view() for a in self._attached.values()],
                {sid: a.block for sid, a in self._attached.items()},
                self._network_addresses(),
                self._snapshot(),
            )
        for sid, guest_port, old in self.db.ports():
            if sid in self._attached:
                try:
                    await self._expose(sid, guest_port, old)
                except (HutchError, OSError):
                    # The old host port is taken now: a new one (the store learns it).
                    with contextlib.suppress(HutchError, OSError):
                        await self._expose(sid, guest_port)

    async def close(self) -> None:
        """Stop the servers and readers. With sandboxes left, the nft table and taps
        stay (their traffic fails closed until a restart); with none, the table goes.
        The overlay device always goes (members elsewhere are unreachable until the
        next start rebuilds it)."""
        if self._overlay_task is not None:
            self._overlay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._overlay_task
            self._overlay_task = None
        if self.enforcer.cfg is not None:
            with contextlib.suppress(HutchError):
                await self.enforcer.drop_tunnel()
        await self.enforcer.close(drop_table=not self.db.leases())
        await self.forwarder.shutdown()

    # -- private networks across hosts ---------------------------------------------------

    async def _poll_overlay(self) -> None:
        last = ""  # the last failure's message: a lasting one is logged once
        while True:
            await asyncio.sleep(POLL_S)
            try:
                async with self._lock:
                    await self._sync_overlay()
                last = ""
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a database hiccup or a failed `ip`: next tick again
                if str(exc) != last:
                    log.exception("private networks across hosts: the overlay sync failed")
                last = str(exc)

    async def _sync_overlay(self, *, force: bool = False) -> None:
        """Read the other hosts' members and ends; when they changed, push them: the
        DNS view, the member sets, the always-denied pools/endpoints and the tunnel's
        routes. Called under _lock (after every local change, and every POLL_S)."""
        if self.enforcer.tunnel is None:
            return
        new = overlay_of(
            self._attached, self.db.memberships(), self.db.remote_members(), self.db.tunnels()
        )
        if new == self._overlay and self._overlay_applied and not force:
            return
        self._overlay = new
        try:
            self._publish()
            await self.enforcer.set_networks(self._network_addresses())
            await self.enforcer.set_cluster(new.pools, new.endpoints, new.tunnel)
        except BaseException:
            # Not applied (the tunnel fails closed): the next poll tries again.
            self._overlay_applied = False
            raise
        self._overlay_applied = True

    # -- what the guest is told ----------------------------------------------------------

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

    def shown_address(self, sandbox_id: str) -> IPv4Address | None:
        """The guest address a view shows: this host's lease, else the lease another
        host of the cluster holds, in that host's pool."""
        mine = self.address_of(sandbox_id)
        if mine is not None:
            return mine
        found = self.db.other_host_lease(sandbox_id)
        if found is None:
            return None
        block, pool = found
        try:
            return AddressPool(pool).block(block).guest
        except InvalidArgument as exc:  # a pool or block this host cannot read
            log.warning("sandbox %s: lease %s of pool %r unreadable: %s", sandbox_id, block,
                        pool, exc)  # fmt: skip
            return None

    # -- sandboxes -----------------------------------------------------------------------

    def check_networks(self, ids_or_names: list[str], project: str) -> list[str]:
        """The network ids for ``ids_or_names`` (NotFound names the unknown one)."""
        if len(ids_or_names) > MAX_NETWORKS_PER_SANDBOX:
            raise InvalidArgument(
                f"{len(ids_or_names)} networks given; a sandbox joins at most "
                f"{MAX_NETWORKS_PER_SANDBOX}"
            )
        return list(dict.fromkeys(self._network(n, project).id for n in ids_or_names))

    async def attach(
        self,
        sandbox_id: str,
        policy: EgressPolicy,
        network_ids: Sequence[str] = (),
    ) -> None:
        """Give ``sandbox_id`` an address, a tap and its policy; join ``network_ids``."""
        self.enforcer.config()  # not started: refused before anything is stored
        async with self._lock:
            used = {lease.block for lease in self.db.leases().values()}
            block = self.pool.block(self.pool.first_free(used))
            tap = tap_name(self.settings.daemon_tag, sandbox_id)
            self.db.add_lease(sandbox_id, block.index, tap)
            self.db.set_rules(sandbox_id, policy.stored())
            att = _Attached(sandbox_id, block, tap, policy, self._project_of(sandbox_id))
            try:
                await self.enforcer.add(att.dataplane_view(), block)
            except BaseException:
                self.db.forget_sandbox(sandbox_id)
                raise
            self._attached[sandbox_id] = att
            for nid in network_ids:
                self.db.add_member(nid, sandbox_id)
            self._publish()
            if network_ids:
                await self.enforcer.set_networks(self._network_addresses())
                await self._sync_overlay()

    async def detach(self, sandbox_id: str) -> None:
        """Take everything back. Safe to call twice and for sandboxes never attached."""
        self.enforcer.config()
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
                await self.enforcer.remove(att.dataplane_view())
            if had_networks:
                await self.enforcer.set_networks(self._network_addresses())
                await self._sync_overlay()
        await self.enforcer.forget(sandbox_id)

    async def moved_away(self, sandbox_id: str) -> None:
        """The sandbox now runs on another host (a cross-host resume): this host's tap
        and nft entry go; its rows (rules, networks, its lease, now the new host's)
        stay. Safe for a sandbox this host never attached."""
        self.enforcer.config()
        await self.forwarder.close_all(sandbox_id)
        async with self._lock:
            att = self._attached.pop(sandbox_id, None)
            self._publish()
            if att is not None:
                await self.enforcer.remove(att.dataplane_view())
        await self.enforcer.forget(sandbox_id)

    # -- egress --------------------------------------------------------------------------

    def policy_of(self, sandbox_id: str) -> EgressPolicy:
        att = self._attached.get(sandbox_id)
        return att.policy if att else policy_from_stored(self.db.rules(sandbox_id))

    async def set_policy(self, sandbox_id: str, policy: EgressPolicy) -> EgressView:
        """Swap the rules live. What the new rules no longer allow stops at once: the
        nft flows of older rules are checked again on their next packet (see
        :mod:`hutch.net.nft`) and the proxy cuts the connections it relays for names
        no longer allowed; addresses learned for names still allowed are carried over."""
        att = self._require(sandbox_id)
        async with self._lock:
            new = _Attached(att.sandbox_id, att.block, att.tap, policy, att.project)
            # In the data path's loop, ordered against its learnings (hutch.net.learning).
            await self.enforcer.swap_policy(new.dataplane_view(), policy)
            # Stored only once the host enforces it: a failure keeps the old rules.
            self.db.set_rules(sandbox_id, policy.stored())
            self._attached[sandbox_id] = new
            self._publish()
            # After the publish: a connection decided under the old rules and registered
            # after this cut meets the new rules when it registers (see the proxy).
            await self.enforcer.revalidate(sandbox_id, policy)
        return self.egress_view(sandbox_id)

    def egress_ca_pem(self, project: str) -> bytes | None:
        """The TLS-inspection CA certificate of ``project`` (PEM; what its guests trust),
        made on first use; None before the enforcer started. Raises NetworkError when
        the CA cannot be read or made."""
        cas = self.enforcer.proxy.ca
        return cas.cert_pem(project) if cas is not None else None

    def egress_view(self, sandbox_id: str) -> EgressView:
        return self.enforcer.egress_view(sandbox_id, self.policy_of(sandbox_id))

    def events(self, sandbox_id: str, limit: int) -> list[EgressEvent]:
        return self.enforcer.events(sandbox_id, limit)

    # -- private networks ----------------------------------------------------------------

    def create_network(self, name: str, project: str) -> NetworkView:
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise InvalidArgument(
                f"network name {name!r} is not valid; use 1-63 lower-case letters, digits "
                "and '-', starting and ending with a letter or digit"
            )
        if _NETWORK_ID_RE.match(name):
            raise InvalidArgument(f"network name {name!r} looks like a network id; pick another")
        row = NetworkRow("net-" + secrets.token_hex(6), name, time.time(), project)
        self.db.insert_network(row)
        return self.network_view(row.id, project)

    def list_networks(self, project: str) -> list[NetworkView]:
        return [self._view(row) for row in self.db.networks(project)]

    def network_view(self, id_or_name: str, project: str) -> NetworkView:
        return self._view(self._network(id_or_name, project))

    async def delete_network(self, id_or_name: str, project: str) -> None:
        row = self._network(id_or_name, project)
        async with self._lock:
            self.db.delete_network(row.id)
            self._publish()
            await self.enforcer.set_networks(self._network_addresses(), removed=[row.id])

    async def join(self, sandbox_id: str, id_or_name: str, project: str) -> NetworkView:
        self._require(sandbox_id)
        row = self._network(id_or_name, project)
        current = self.db.networks_of(sandbox_id)
        if row.id not in current and len(current) >= MAX_NETWORKS_PER_SANDBOX:
            raise Conflict(f"sandbox {sandbox_id} is already on {len(current)} networks (the most)")
        async with self._lock:
            self.db.add_member(row.id, sandbox_id)
            self._publish()
            await self.enforcer.set_networks(self._network_addresses())
            await self._sync_overlay()
        return self._view(row)

    async def leave(self, sandbox_id: str, id_or_name: str, project: str) -> None:
        row = self._network(id_or_name, project)
        if row.id not in self.db.networks_of(sandbox_id):
            raise NotFound(f"sandbox {sandbox_id} is not on network {row.id} ({row.name})")
        async with self._lock:
            self.db.remove_member(row.id, sandbox_id)
            self._publish()
            await self.enforcer.set_networks(self._network_addresses())
            await self._sync_overlay()

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

    def _require(self, sandbox_id: str) -> _Attached:
        att = self._attached.get(sandbox_id)
        if att is None:
            raise Conflict(
                f'sandbox {sandbox_id} has no network (created with network "none"); '
                'create it with network "default" to use egress rules, ports or networks'
            )
        return att

    def _snapshot(self) -> Snapshot:
        return Snapshot.of(
            Entry(SandboxNetInfo(sid, a.policy, self._peers(sid), a.project), a.block.guest, a.tap)
            for sid, a in self._attached.items()
        )

    def _publish(self) -> None:
        """Replace the data path's view of the sandboxes. Called under _lock, so
        snapshots are published in the order the changes were made."""
        self.enforcer.publish(self._snapshot())

    def _project_of(self, sandbox_id: str) -> str:
        rec = self._store.get_sandbox(sandbox_id)
        return rec.project if rec is not None else "default"

    def _network(self, id_or_name: str, project: str) -> NetworkRow:
        row = self.db.network(id_or_name, project) if isinstance(id_or_name, str) else None
        if row is None:
            raise NotFound(f"no network {id_or_name!r}; GET /v1/networks lists them")
        return row

    def _view(self, row: NetworkRow) -> NetworkView:
        return NetworkView(row.id, row.name, row.created_at, self.db.members(row.id))

    def _network_addresses(self) -> dict[str, list[IPv4Address]]:
        """Each network's member addresses: this host's and (the overlay) the others'."""
        out: dict[str, list[IPv4Address]] = {}
        for nid, members in self.db.memberships().items():
            out[nid] = [self._attached[m].block.guest for m in members if m in self._attached]
            out[nid] += self._overlay.members.get(nid, {}).values()
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
            # Members on other hosts, reached through the overlay.
            for member, address in self._overlay.members.get(nid, {}).items():
                for label in (member, self._names(member)):
                    if label:
                        peers[label.lower()] = address
                        peers[f"{label.lower()}.{INTERNAL_SUFFIX}"] = address
        return peers

    def _port_view(self, guest: int, host_port: int) -> PortView:
        host = self.settings.ports_bind
        shown = f"[{host}]" if ":" in host else host
        return PortView(guest, host, host_port, f"http://{shown}:{host_port}")


def tunnel_config(settings: Settings) -> TunnelConfig | None:
    """This host's end of the overlay, or None (a single host, or HUTCH_TUNNEL_PORT=0).
    The underlay address is HUTCH_TUNNEL_ADDRESS, else the host of HUTCH_HOST_ADDRESS
    (resolved when a name). Raises InvalidArgument when neither gives an IPv4 address."""
    port = settings.cluster.tunnel_udp_port
    if not port:
        return None
    text = settings.cluster.tunnel_address
    if not text:
        name = urlsplit(settings.host_address).hostname or ""
        try:
            text = socket.gethostbyname(name) if name else ""
        except OSError:
            text = ""
    try:
        local = IPv4Address(text)
    except ValueError as exc:
        raise InvalidArgument(
            f"no IPv4 address for this host's end of the tunnel between hosts (from "
            f"HUTCH_HOST_ADDRESS={settings.host_address!r}); set HUTCH_TUNNEL_ADDRESS, or "
            "HUTCH_TUNNEL_PORT=0 for no private networks across hosts"
        ) from exc
    return TunnelConfig(settings.daemon_tag, settings.host_id, local, port)
