"""Host-side reference work that each hutch number is divided by, measured in the same
run (these machines are shared and noisy: only same-run ratios mean anything)."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

__all__ = [
    "BWRAP",
    "SpawnLoad",
    "spawn_load",
    "time_cat",
    "time_spawn",
]

#: A bubblewrap namespace sandbox over the host's own root: what design.md names as the
#: yardstick for a warm-pool create ("within 3x of spawning a bubblewrap sandbox").
BWRAP = ["bwrap", "--unshare-all", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]


def time_spawn(argv: list[str], expect_stdout: str | None = None) -> float:
    """Seconds to spawn ``argv`` and wait for it. Raises ``RuntimeError`` when it fails
    or prints something other than ``expect_stdout`` (a baseline that silently failed
    would make every ratio a lie)."""
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(
            f"baseline {' '.join(argv)!r} exited {done.returncode}: "
            f"{done.stderr.decode(errors='replace').strip()}"
        )
    if expect_stdout is not None and done.stdout.decode() != expect_stdout:
        raise RuntimeError(f"baseline {argv!r} printed {done.stdout!r}, not {expect_stdout!r}")
    return elapsed


def time_cat(src: Path, dst: Path) -> float:
    """Seconds for ``cat src > dst`` (dst removed first, so every run writes a new file
    on the same disk, as an upload or download does)."""
    dst.unlink(missing_ok=True)
    start = time.perf_counter()
    with open(dst, "wb") as out:
        done = subprocess.run(["cat", str(src)], stdout=out, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"baseline cat {src} > {dst} exited {done.returncode}")
    return elapsed


class SpawnLoad:
    """What ``spawn_load`` measured: seconds, per-spawn latencies, and when each spawn
    finished (seconds from the start)."""

    def __init__(self, elapsed_s: float, latencies: list[float], finish_times: list[float]):
        self.elapsed_s = elapsed_s
        self.latencies = latencies
        self.finish_times = finish_times

    @property
    def completed(self) -> int:
        return len(self.latencies)

    @property
    def rate(self) -> float:
        return self.completed / self.elapsed_s if self.elapsed_s > 0 else 0.0


async def spawn_load(argv: list[str], workers: int, duration_s: float) -> SpawnLoad:
    """``workers`` tasks spawning ``argv`` back to back for ``duration_s``: the host's
    rate at the same concurrency as the hutch exec load."""
    latencies: list[float] = []
    finish_times: list[float] = []
    start = time.perf_counter()
    deadline = start + duration_s

    async def worker() -> None:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            code = await proc.wait()
            if code != 0:
                raise RuntimeError(f"baseline {' '.join(argv)!r} exited {code}")
            t1 = time.perf_counter()
            latencies.append(t1 - t0)
            finish_times.append(t1 - start)

    await asyncio.gather(*(worker() for _ in range(workers)))
    return SpawnLoad(time.perf_counter() - start, latencies, finish_times)
