from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Response

from hutch.api.deps import Caller, lifecycle, networking, sandboxes, snapshots, volumes
from hutch.api.net_schemas import PolicyDocument, SandboxNet
from hutch.api.schemas import (
    CreateSandbox,
    ForkRequest,
    PauseRequest,
    ResumeRequest,
    Sandbox,
    SandboxList,
    Snapshot,
    SnapshotList,
    SnapshotRequest,
)
from hutch.api.volume_schemas import PatchSandbox
from hutch.contract.auth import Permission
from hutch.contract.enums import DEFAULT_PAUSE_MODE
from hutch.contract.limits import DEFAULT_FORK_COUNT
from hutch.errors import Forbidden, InvalidArgument
from hutch.models import SandboxRecord, SandboxSpec, SandboxState, Shape
from hutch.services.lifecycle import LifecycleService
from hutch.services.networking import NetworkingService
from hutch.services.sandboxes import SandboxService
from hutch.services.snapshots import SnapshotService
from hutch.services.volumes import VolumeService

router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"])
Service = Annotated[SandboxService, Depends(sandboxes)]
Lifecycle = Annotated[LifecycleService, Depends(lifecycle)]
Snapshots = Annotated[SnapshotService, Depends(snapshots)]
Net = Annotated[NetworkingService, Depends(networking)]
Volumes = Annotated[VolumeService, Depends(volumes)]


def _egress(egress: list[str] | PolicyDocument | None) -> list[str] | dict[str, Any] | None:
    if isinstance(egress, PolicyDocument):
        return egress.model_dump(exclude_none=True)
    return None if egress is None else list(egress)


def _view(net: NetworkingService, rec: SandboxRecord) -> Sandbox:
    """The sandbox as the API shows it, with its network block."""
    return Sandbox.of(rec, SandboxNet.of(net.sandbox_net(rec)))


@router.post("", status_code=201, response_model=Sandbox)
async def create_sandbox(body: CreateSandbox, svc: Service, net: Net, who: Caller) -> Sandbox:
    if body.volumes:
        # Mounting a volume is using it: writing to it, or reading for read-only mounts.
        needed = (
            Permission.VOLUME_READ
            if all(m.read_only for m in body.volumes)
            else Permission.VOLUME_WRITE
        )
        if not who.may(needed):
            raise Forbidden(f"role {who.role} may not mount volumes (permission {needed!r})")
    spec = SandboxSpec(
        image=body.image,
        shape=Shape(vcpus=body.vcpus, memory_mib=body.memory_mib, disk_gib=body.disk_gib),
        env=body.env,
        metadata=body.metadata,
        name=body.name,
        timeout_s=body.timeout_s,
        auto_resume=body.auto_resume,
        auto_pause_s=body.auto_pause_s,
        auto_delete_s=body.auto_delete_s,
        snapshot_id=body.snapshot,
        network=body.network,
        egress=_egress(body.egress),
        egress_policy=body.egress_policy,
        networks=list(body.networks),
        volumes=[m.to_mount() for m in body.volumes],
        project=who.project,
        env_secrets=dict(body.env_secrets),
        placement_labels=dict(body.placement.labels or {}) if body.placement else {},
    )
    return _view(net, await svc.create(spec))


@router.get("", response_model=SandboxList)
async def list_sandboxes(
    svc: Service,
    net: Net,
    who: Caller,
    state: SandboxState | None = None,
    metadata: Annotated[
        list[str] | None,
        Query(description="Filter by metadata, as key=value; repeat to require several."),
    ] = None,
) -> SandboxList:
    wanted: dict[str, str] = {}
    for item in metadata or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidArgument(f"metadata filter {item!r} is not key=value")
        wanted[key] = value
    return SandboxList(
        sandboxes=[_view(net, r) for r in svc.list_sandboxes(state, wanted, project=who.project)]
    )


@router.get("/{sandbox_id}", response_model=Sandbox)
async def get_sandbox(sandbox_id: str, svc: Service, net: Net) -> Sandbox:
    return _view(net, svc.get(sandbox_id))


@router.patch("/{sandbox_id}", response_model=Sandbox)
async def patch_sandbox(
    sandbox_id: str, body: PatchSandbox, svc: Service, vols: Volumes, net: Net
) -> Sandbox:
    """Grow the running sandbox's own disk (`disk_gib`) live: QMP `block_resize`, then the
    guest agent grows the root filesystem; `df` in the guest sees it at once."""
    if body.volumes is not None:
        raise InvalidArgument(
            "volumes are mounted at create only: QEMU microvm (7.2) has no device "
            "hot-plug (its virtio-mmio bus refuses device_add), so a running sandbox "
            "cannot be given a disk; create a new sandbox with 'volumes'"
        )
    rec = svc.get(sandbox_id)
    if body.disk_gib is not None:
        rec = await vols.grow_sandbox_disk(sandbox_id, body.disk_gib)
    return _view(net, rec)


@router.delete("/{sandbox_id}", status_code=204, response_class=Response)
async def delete_sandbox(sandbox_id: str, svc: Service) -> Response:
    await svc.delete(sandbox_id)
    return Response(status_code=204)


@router.post("/{sandbox_id}/pause", response_model=Sandbox)
async def pause_sandbox(
    sandbox_id: str, svc: Lifecycle, net: Net, body: PauseRequest | None = None
) -> Sandbox:
    """Pause: `memory` keeps processes where they are; `disk` keeps only the disk."""
    mode = body.mode if body else DEFAULT_PAUSE_MODE
    return _view(net, await svc.pause(sandbox_id, mode))


@router.post("/{sandbox_id}/resume", response_model=Sandbox)
async def resume_sandbox(
    sandbox_id: str, svc: Lifecycle, net: Net, body: ResumeRequest | None = None
) -> Sandbox:
    """Resume a paused sandbox (a running one is answered as it is). `placement` is
    where in a cluster: the API host routes the call there before it reaches this."""
    del body  # placement was applied by the cluster router (api/cluster_router.py)
    return _view(net, await svc.resume(sandbox_id))


@router.post("/{sandbox_id}/fork", status_code=201, response_model=SandboxList)
async def fork_sandbox(
    sandbox_id: str, svc: Snapshots, net: Net, body: ForkRequest | None = None
) -> SandboxList:
    """New sandboxes, each a copy-on-write clone of this one (memory, processes, disk)."""
    count = body.count if body else DEFAULT_FORK_COUNT
    return SandboxList(sandboxes=[_view(net, r) for r in await svc.fork(sandbox_id, count)])


@router.post("/{sandbox_id}/snapshots", status_code=201, response_model=Snapshot)
async def snapshot_sandbox(sandbox_id: str, body: SnapshotRequest, svc: Snapshots) -> Snapshot:
    """Save memory, devices and disk under a name; start new sandboxes from it with
    `POST /v1/sandboxes {"snapshot": id}`."""
    return Snapshot.of(await svc.snapshot(sandbox_id, body.name))


snapshots_router = APIRouter(prefix="/v1/snapshots", tags=["snapshots"])


@snapshots_router.get("", response_model=SnapshotList)
async def list_snapshots(svc: Snapshots, who: Caller) -> SnapshotList:
    return SnapshotList(snapshots=[Snapshot.of(s) for s in svc.list_snapshots(who.project)])


@snapshots_router.get("/{snapshot_id}", response_model=Snapshot)
async def get_snapshot(snapshot_id: str, svc: Snapshots) -> Snapshot:
    return Snapshot.of(svc.get_snapshot(snapshot_id))


@snapshots_router.delete("/{snapshot_id}", status_code=204, response_class=Response)
async def delete_snapshot(snapshot_id: str, svc: Snapshots) -> Response:
    """Refused (409) while a sandbox's disk is built on the snapshot."""
    await svc.delete_snapshot(snapshot_id)
    return Response(status_code=204)
