"""``files``: host→guest and guest→host throughput of one random file, against the
host's ``cat`` of the same bytes on the same disk (nothing dropped from any cache: the
source file is in the page cache for both sides)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from bench.baselines import time_cat
from bench.cases.common import BenchContext, new_sandbox, now
from bench.model import BenchResult, Metric, SampleSet

__all__ = ["run_files"]

GUEST_PATH = "/root/bench-payload.bin"
MIB = 1 << 20


def _random_file(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "wb") as out:
        left = size
        while left:
            block = os.urandom(min(MIB, left))
            digest.update(block)
            out.write(block)
            left -= len(block)
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(MIB):
            digest.update(block)
    return digest.hexdigest()


def run_files(ctx: BenchContext) -> BenchResult:
    size = (16 if ctx.quick else 64) * MIB
    reps = 2 if ctx.quick else 3
    result = BenchResult(
        "files",
        "file throughput host->guest and guest->host",
        ctx.quick,
        {"bytes": size, "repetitions": reps, "guest_path": GUEST_PATH, **ctx.sandbox_params()},
    )
    src = ctx.work_dir / "payload.bin"
    host_copy = ctx.work_dir / "payload.cat"
    downloaded = ctx.work_dir / "payload.download"
    want = _random_file(src, size)
    mb = size / 1e6
    up: list[float] = []
    down: list[float] = []
    cat_up: list[float] = []
    cat_down: list[float] = []
    try:
        with new_sandbox(ctx) as sb:
            for i in range(reps):
                cat_up.append(mb / time_cat(src, host_copy))
                t0 = now()
                with open(src, "rb") as f:
                    written = sb.files.write(GUEST_PATH, f)
                up.append(mb / (now() - t0))
                if written.size != size:
                    raise RuntimeError(f"upload stored {written.size} bytes, sent {size}")

                cat_down.append(mb / time_cat(src, host_copy))
                downloaded.unlink(missing_ok=True)
                t0 = now()
                with sb.files.read_stream(GUEST_PATH) as chunks, open(downloaded, "wb") as out:
                    for chunk in chunks:
                        out.write(chunk)
                down.append(mb / (now() - t0))
                got = _sha256(downloaded)  # untimed: proves the bytes made the round trip
                if got != want:
                    raise RuntimeError(f"download sha256 {got} != uploaded {want}")
                ctx.log(
                    f"  rep {i + 1}/{reps}: up {up[-1]:.1f} MB/s, down {down[-1]:.1f} MB/s, "
                    f"cat {cat_up[-1]:.0f}/{cat_down[-1]:.0f} MB/s"
                )
    finally:
        for path in (src, host_copy, downloaded):
            path.unlink(missing_ok=True)
    cat_label = f"cat src > dst on the host ({size // MIB} MiB, same disk)"
    result.metrics = [
        Metric(
            "upload",
            "MB/s",
            "higher",
            "sb.files.write(path, file object), streamed host->guest",
            SampleSet(f"sb.files.write of {size // MIB} MiB", up),
            SampleSet(cat_label, cat_up),
        ),
        Metric(
            "download",
            "MB/s",
            "higher",
            "sb.files.read_stream(path) written to a host file, guest->host",
            SampleSet(f"sb.files.read_stream of {size // MIB} MiB", down),
            SampleSet(cat_label, cat_down),
        ),
    ]
    result.notes.append("MB = 10^6 bytes; download verified by sha256 after each timing")
    return result
