"""``snapshot_blobs``: a named snapshot's files uploaded to and downloaded from a real
S3-compatible server (SeaweedFS on loopback, ``tests/s3server.py``) through the blob
store seam the daemon uses (``S3BlobStore``: multipart, sha256 while reading; the
download verified against the recorded size + sha256 before its rename), against
``cat`` of the same bytes to a file on the same disk, in the same run.

The snapshot is a real one: a 256 MiB sandbox with 128 MiB of guest memory dirtied
(random bytes in /dev/shm), snapshotted by the benchmark daemon; its directory
(``state.mig``, ``disk.qcow2``, ``vm.json``, ``manifest.json``) is what is moved.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.s3server import S3Server

from bench.baselines import time_cat
from bench.cases.common import BenchContext, new_sandbox, now
from bench.model import BenchResult, Metric, SampleSet
from hutch.storage.blobs import file_sha256

__all__ = ["run_snapshot_blobs"]

MIB = 1 << 20


def _cat_all(files: list[Path], dst: Path) -> float:
    """Seconds to ``cat`` every file to ``dst`` (one new file per source, same disk)."""
    return sum(time_cat(f, dst.with_name(f"{dst.name}.{f.name}")) for f in files)


def run_snapshot_blobs(ctx: BenchContext) -> BenchResult:
    reps = 2 if ctx.quick else 3
    dirty_mib = 64 if ctx.quick else 128
    result = BenchResult(
        "snapshot_blobs",
        "named snapshot upload/download to S3 (SeaweedFS on loopback) vs cat",
        ctx.quick,
        {"repetitions": reps, "dirty_mib": dirty_mib, **ctx.sandbox_params()},
    )
    server = S3Server(ctx.work_dir / "s3")
    up: list[float] = []
    down: list[float] = []
    cat_up: list[float] = []
    cat_down: list[float] = []
    one_stream: list[float] = []
    scratch = ctx.daemon.state_dir / "bench-blobs"
    scratch.mkdir(exist_ok=True)
    server.start()
    try:
        with new_sandbox(ctx) as sb:
            sb.exec(["sh", "-c", f"head -c {dirty_mib}M /dev/urandom > /dev/shm/dirty"])
            snap = sb.snapshot("bench-blobs")
            snap_dir = ctx.daemon.state_dir / "snapshots" / snap.id
            files = sorted(f for f in snap_dir.iterdir() if f.is_file())
            size = sum(f.stat().st_size for f in files)
            mb = size / 1e6
            store = server.blob_store(scratch / "journal", prefix="bench", part_size=16 * MIB)
            # The same store with every download one GET stream (what get did before
            # ranged downloads): the baseline of snapshot_download_ranged.
            single = server.blob_store(
                scratch / "journal", prefix="bench", part_size=16 * MIB, range_size=1 << 62
            )
            for i in range(reps):
                cat_up.append(mb / _cat_all(files, scratch / "cat"))
                t0 = now()
                infos = {f.name: store.put(f"snap-{i}/{f.name}", f) for f in files}
                up.append(mb / (now() - t0))

                cat_down.append(mb / _cat_all(files, scratch / "cat"))
                out = scratch / f"down-{i}"
                t0 = now()
                for name, info in infos.items():
                    store.get(f"snap-{i}/{name}", out / name, expect=info)
                down.append(mb / (now() - t0))
                alone = scratch / f"one-{i}"
                t0 = now()
                for name, info in infos.items():
                    single.get(f"snap-{i}/{name}", alone / name, expect=info)
                one_stream.append(mb / (now() - t0))
                shutil.rmtree(alone)
                for f in files:  # untimed: the bytes made the round trip
                    if file_sha256(out / f.name) != infos[f.name].sha256:
                        raise RuntimeError(f"downloaded {f.name} differs from the snapshot")
                shutil.rmtree(out)
                ctx.log(
                    f"  rep {i + 1}/{reps}: {size / MIB:.0f} MiB up {up[-1]:.0f} MB/s, "
                    f"down {down[-1]:.0f} MB/s (one stream {one_stream[-1]:.0f}), "
                    f"cat {cat_up[-1]:.0f}/{cat_down[-1]:.0f} MB/s"
                )
            ctx.client.delete_snapshot(snap.id)
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(server.root, ignore_errors=True)
    result.params["snapshot_bytes"] = size
    cat_label = "cat of the snapshot's files to new files on the same disk"
    result.metrics = [
        Metric(
            "snapshot_upload",
            "MB/s",
            "higher",
            "S3BlobStore.put of every file of the snapshot (multipart 16 MiB, sha256)",
            SampleSet(f"upload of {size / MIB:.0f} MiB to SeaweedFS", up),
            SampleSet(cat_label, cat_up),
        ),
        Metric(
            "snapshot_download",
            "MB/s",
            "higher",
            "S3BlobStore.get of every file, verified (size + sha256) before the rename",
            SampleSet(f"download of {size / MIB:.0f} MiB from SeaweedFS", down),
            SampleSet(cat_label, cat_down),
        ),
        Metric(
            "snapshot_download_ranged",
            "MB/s",
            "higher",
            "the same downloads in 8 MiB ranged GETs, four side by side (the default)",
            SampleSet(f"ranged download of {size / MIB:.0f} MiB", down),
            SampleSet("each file one GET stream", one_stream),
        ),
    ]
    result.notes.append(
        "MB = 10^6 bytes; the S3 server runs on this host (loopback, its data on the same "
        "disk), so the ratio is hutch's client path + the server's, not a network's"
    )
    return result
