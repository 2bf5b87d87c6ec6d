"""``/v1/hosts``: the hosts of a cluster (admin only). A drain is served by the host
drained (the cluster router forwards it there, :mod:`hutch.api.cluster_router`)."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field
from starlette.requests import HTTPConnection

from hutch.api.deps import snapshots
from hutch.errors import StateError
from hutch.services.cluster import ClusterService, HostView
from hutch.services.snapshots import SnapshotService

__all__ = ["Host", "HostList", "router"]

router = APIRouter(prefix="/v1/hosts", tags=["hosts"])


def cluster(conn: HTTPConnection) -> ClusterService:
    found: ClusterService = conn.app.state.services.cluster
    return found


Cluster = Annotated[ClusterService, Depends(cluster)]
Snapshots = Annotated[SnapshotService, Depends(snapshots)]


class HostCapacity(BaseModel):
    vcpus: int
    memory_mib: int = Field(description="MiB its sandboxes may reserve together.")
    disk_gib: int = Field(description="Free disk of its state directory at registration.")
    max_sandboxes: int


class HostUse(BaseModel):
    sandboxes: int = Field(description="Live sandboxes (paused ones too).")
    running: int = Field(description="Sandboxes with a VM (creating, running, pausing, ...).")
    vcpus: int
    memory_mib: int


class Host(BaseModel):
    id: str
    address: str = Field(description="Where the other hosts reach its API.")
    role: str
    state: str = Field(description="`up`, `draining` (takes no new sandboxes) or `down`.")
    this: bool = Field(description="The host that answered this request.")
    accel: str
    qemu_version: str
    cpu_model: str
    labels: dict[str, str]
    capacity: HostCapacity
    use: HostUse
    started_at: dt.datetime
    renewed_at: dt.datetime
    lease_until: dt.datetime
    down_at: dt.datetime | None = None
    down_reason: str | None = None

    @classmethod
    def of(cls, v: HostView) -> Host:
        h = v.row

        def iso(ts: float) -> dt.datetime:
            return dt.datetime.fromtimestamp(ts, dt.UTC)

        return cls(
            id=h.id, address=h.address, role=h.role, state=h.state, this=v.this,
            accel=h.accel, qemu_version=h.qemu_version, cpu_model=h.cpu_model,
            labels=dict(h.labels),
            capacity=HostCapacity(
                vcpus=h.vcpus, memory_mib=h.memory_mib, disk_gib=h.disk_gib,
                max_sandboxes=h.max_sandboxes,
            ),
            use=HostUse(
                sandboxes=v.use.sandboxes, running=v.use.running, vcpus=v.use.vcpus,
                memory_mib=v.use.memory_mib,
            ),
            started_at=iso(h.started_at), renewed_at=iso(h.renewed_at),
            lease_until=iso(h.lease_until),
            down_at=iso(h.down_at) if h.down_at is not None else None,
            down_reason=h.down_reason,
        )  # fmt: skip


class HostList(BaseModel):
    hosts: list[Host]


@router.get("", response_model=HostList)
async def list_hosts(svc: Cluster) -> HostList:
    return HostList(hosts=[Host.of(v) for v in svc.views()])


@router.get("/{host_id}", response_model=Host)
async def get_host(host_id: str, svc: Cluster) -> Host:
    return Host.of(svc.view(host_id))


def _here(svc: ClusterService, host_id: str) -> None:
    """A drain acts on the host's own sandboxes: it must reach that host (the router
    forwards it there); one that did not is down (or unknown)."""
    v = svc.view(host_id)
    if not v.this:
        raise StateError(f"host {host_id}", v.row.state, ["up", "draining"], "it is not reachable")


@router.post("/{host_id}/drain", response_model=Host)
async def drain_host(host_id: str, svc: Cluster) -> Host:
    """The host takes no new sandboxes and pauses each running one (memory mode); with
    a blob store, each is resumed at once on another host (its processes kept)."""
    _here(svc, host_id)
    return Host.of(await svc.drain())


@router.post("/{host_id}/undrain", response_model=Host)
async def undrain_host(host_id: str, svc: Cluster) -> Host:
    """The host takes new sandboxes again (paused ones stay paused)."""
    _here(svc, host_id)
    return Host.of(svc.undrain())


class RemoteClonesRequest(BaseModel):
    fork: str = Field(max_length=64)
    parent: str = Field(max_length=64)
    children: list[str] = Field(max_length=64)


class RemoteClonesResult(BaseModel):
    failed: list[str]


@router.post("/{host_id}/clones", response_model=RemoteClonesResult, include_in_schema=False)
async def remote_clones(
    host_id: str, body: RemoteClonesRequest, svc: Cluster, snaps: Snapshots
) -> RemoteClonesResult:
    """Host to host (a fork on another host placed these children here): start them
    from the fork's upload in the blob store. Not for clients (not in the schema)."""
    _here(svc, host_id)
    failed = await snaps.remote.clone_here(body.fork, body.parent, body.children)
    return RemoteClonesResult(failed=failed)
