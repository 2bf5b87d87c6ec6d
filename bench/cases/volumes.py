"""``volumes``: sequential write throughput inside the guest (``dd`` of zeros ending in
``fsync``) to an exclusive volume (a raw file) against the sandbox's own disk (a qcow2
overlay), in the same sandbox and run; the same to a shared volume (FUSE in the guest,
served by hutchd over a virtio-serial port) against the exclusive one; and the time of a
live grow (QMP block_resize + the guest's online ext4 resize) against the guest's
``sync``."""

from __future__ import annotations

from bench.cases.common import SANDBOX_MEMORY_MIB, SANDBOX_VCPUS, BenchContext, now
from bench.model import BenchResult, Metric, SampleSet
from hutch.sdk import Sandbox

__all__ = ["run_volumes"]

MIB = 1 << 20


def _dd_mbps(sb: Sandbox, path: str, mib: int) -> float:
    script = (
        f"rm -f {path}; sync; s=$(date +%s.%N); "
        f"dd if=/dev/zero of={path} bs=1M count={mib} conv=fsync 2>/dev/null; "
        f"e=$(date +%s.%N); rm -f {path}; echo $s $e"
    )
    out = sb.exec(["sh", "-c", script], timeout_s=600)
    if out.exit_code != 0:
        raise RuntimeError(f"dd to {path} failed: {out.stderr}")
    start, end = (float(x) for x in out.stdout.split())
    return mib * MIB / 1e6 / (end - start)


def run_volumes(ctx: BenchContext) -> BenchResult:
    mib = 32 if ctx.quick else 128
    reps = 2 if ctx.quick else 3
    result = BenchResult(
        "volumes",
        "exclusive volume vs own disk and shared vs exclusive write throughput; live grow",
        ctx.quick,
        {"mib": mib, "repetitions": reps, **ctx.sandbox_params()},
    )
    name = f"bench-{int(now() * 1000) % 10**9}"
    ctx.client.volumes.create(name, "1G")
    shared = f"{name}-sh"
    ctx.client.volumes.create(shared, "1G", kind="shared")
    shared_mbps: list[float] = []
    volume_mbps: list[float] = []
    disk_mbps: list[float] = []
    grow_s: list[float] = []
    sync_s: list[float] = []
    try:
        with Sandbox.create(
            ctx.image,
            vcpus=SANDBOX_VCPUS,
            memory_mib=SANDBOX_MEMORY_MIB,
            volumes=[f"{name}:/vol", f"{shared}:/shared"],
            client=ctx.client,
        ) as sb:
            for i in range(reps):
                volume_mbps.append(_dd_mbps(sb, "/vol/bench.bin", mib))
                disk_mbps.append(_dd_mbps(sb, "/root/bench.bin", mib))
                shared_mbps.append(_dd_mbps(sb, "/shared/bench.bin", mib))
                t0 = now()
                sb.exec(["sync"])
                sync_s.append(now() - t0)
                t0 = now()
                ctx.client.volumes.grow(name, f"{1024 + 256 * (i + 1)}M")
                grow_s.append(now() - t0)
                ctx.log(
                    f"  rep {i + 1}/{reps}: volume {volume_mbps[-1]:.0f} MB/s, disk "
                    f"{disk_mbps[-1]:.0f} MB/s, shared {shared_mbps[-1]:.1f} MB/s, "
                    f"grow {grow_s[-1] * 1000:.0f} ms"
                )
    finally:
        ctx.client.volumes.delete(name)
        ctx.client.volumes.delete(shared)
    result.metrics = [
        Metric(
            "volume_write",
            "MB/s",
            "higher",
            f"dd of {mib} MiB + fsync in the guest to an exclusive volume (raw virtio-blk)",
            SampleSet("dd to the volume", volume_mbps),
            SampleSet("dd to the sandbox's own disk (qcow2 overlay), same sandbox", disk_mbps),
        ),
        Metric(
            "shared_write",
            "MB/s",
            "higher",
            f"dd of {mib} MiB + fsync in the guest to a shared volume (FUSE over a "
            "virtio-serial port, one request at a time, at most 128 KiB each)",
            SampleSet("dd to the shared volume", shared_mbps),
            SampleSet("dd to an exclusive volume, same sandbox", volume_mbps),
        ),
        Metric(
            "live_grow",
            "s",
            "lower",
            "PATCH /v1/volumes/{v} (block_resize + online ext4 resize in the guest)",
            SampleSet("volumes.grow by 256 MiB", grow_s),
            SampleSet("sb.exec(['sync']) in the same sandbox", sync_s),
        ),
    ]
    result.notes.append("MB = 10^6 bytes; both disks cache=writeback on the same host disk")
    return result
