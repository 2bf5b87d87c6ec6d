"""qcow2 backing chains: reading them, and keeping them short while the guest runs.

Every fork and named snapshot freezes a sandbox's disk and gives it a new overlay on
top, so a sandbox forked again and again sits on a chain that grows by one layer each
time; every read that misses the top layer walks down it. When a VM starts on a chain
deeper than the daemon allows, QEMU's ``block-stream`` job copies the data of the
middle layers into the top one while the guest keeps running, then rewrites the top's
header to point straight at the image's raw base. The frozen layers stay untouched
(other clones may use them) and are removed by snapshot collection once nothing
references them. A save cancels a running job first: a cancelled stream leaves a valid
disk with the chain it had.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from pathlib import Path

from hutch.errors import HutchError, SnapshotError, VmError
from hutch.vm.process import QemuVm

__all__ = ["COMPACT_JOB", "compact_if_deep", "disk_chain", "qcow2_backing_file", "stop_disk_jobs"]

log = logging.getLogger(__name__)

COMPACT_JOB = "hutch-compact"
_DRIVE = "root"  # the -drive id in hutch.vm.argv
_MAX_DEPTH = 64  # a chain deeper than this is a bug, not a reason to hang


def qcow2_backing_file(path: Path) -> str | None:
    """The backing file name recorded in a qcow2 header (None: no backing file).

    Read from the header directly (magic, version, backing_file_offset/size: big-endian
    at bytes 0-20) so a clone check costs microseconds, not a ``qemu-img`` run.
    """
    try:
        with path.open("rb") as f:
            header = f.read(20)
            if len(header) < 20 or header[:4] != b"QFI\xfb":
                raise SnapshotError(f"{path} is not a qcow2 image")
            offset, size = struct.unpack(">QI", header[8:20])
            if offset == 0:
                return None
            f.seek(offset)
            return f.read(size).decode()
    except OSError as exc:
        raise SnapshotError(f"cannot read the disk {path}: {exc.strerror}") from exc


def disk_chain(disk: Path) -> tuple[list[Path], Path | None]:
    """The qcow2 layers under ``disk``, top first, and the raw image at the bottom (None
    when the chain ends in a qcow2 without a backing file or in a missing file)."""
    layers: list[Path] = []
    current: Path | None = disk
    for _ in range(_MAX_DEPTH):
        if current is None or not current.exists():
            return layers, None
        try:
            backing = qcow2_backing_file(current)
        except SnapshotError:
            return layers, current.resolve()  # not qcow2: the raw base image
        layers.append(current.resolve())
        current = Path(backing) if backing else None
    return layers, None


async def compact_if_deep(vm: QemuVm, max_layers: int) -> bool:
    """Start streaming the VM's disk chain into its top layer if it has more than
    ``max_layers`` qcow2 layers; True if a job was started. Never raises: a chain left
    long is slower, not broken."""
    layers, base = await asyncio.to_thread(disk_chain, vm.cfg.disk)
    if len(layers) <= max_layers:
        return False
    args: dict[str, object] = {"job-id": COMPACT_JOB, "device": _DRIVE}
    try:
        if base is not None:
            # By node, not by file name: QEMU matches names with realpath(), which fails
            # once -runas has dropped it to a user who cannot see the state dir.
            args |= {"base-node": await _node_of(vm, base), "backing-file": str(base)}
        await vm.qmp("block-stream", **args)
    except HutchError as exc:
        log.warning("vm %s: cannot compact its %d-layer disk: %s", vm.cfg.name, len(layers), exc)
        return False
    log.info("vm %s: compacting a %d-layer disk chain", vm.cfg.name, len(layers))
    return True


async def _block_jobs(vm: QemuVm) -> list[str]:
    """The names (devices) of the VM's block jobs now."""
    jobs = await vm.qmp("query-block-jobs")
    return [str(j["device"]) for j in jobs if j.get("device")] if isinstance(jobs, list) else []


async def _node_of(vm: QemuVm, raw_image: Path) -> str:
    nodes = await vm.qmp("query-named-block-nodes", flat=True)
    for node in nodes if isinstance(nodes, list) else []:
        if node.get("drv") == "raw" and node.get("file") == str(raw_image):
            return str(node["node-name"])
    raise SnapshotError(f"VM {vm.cfg.name}: no block node for {raw_image} in its disk chain")


async def stop_disk_jobs(vm: QemuVm, timeout_s: float = 30.0) -> None:
    """Cancel the VM's block jobs and wait until they are gone."""
    deadline = time.monotonic() + timeout_s
    cancelled: set[str] = set()
    while True:
        jobs = await _block_jobs(vm)
        if not jobs:
            return
        for name in jobs:
            if name not in cancelled:
                try:
                    await vm.qmp("block-job-cancel", device=name, force=True)
                except VmError:
                    # A job that ended between the query and the cancel is gone on its
                    # own ("Block job ... not found"): that is what was wanted. One
                    # still there refused for another reason.
                    if name in await _block_jobs(vm):
                        raise
                cancelled.add(name)
        if time.monotonic() > deadline:
            raise SnapshotError(f"VM {vm.cfg.name}: disk jobs still running after {timeout_s:g}s")
        await asyncio.sleep(0.01)
