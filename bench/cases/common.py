"""What every benchmark gets: the daemon to drive, its client, the run's options."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.daemon import PrivateDaemon
from bench.model import BenchResult
from hutch import Sandbox
from hutch.sdk import Client

__all__ = ["SANDBOX_MEMORY_MIB", "SANDBOX_VCPUS", "BenchContext", "Benchmark", "new_sandbox"]

#: Every benchmark sandbox has the smallest useful shape (the issue's: 256 MiB, 1 vCPU).
SANDBOX_MEMORY_MIB = 256
SANDBOX_VCPUS = 1


@dataclass
class BenchContext:
    daemon: PrivateDaemon
    client: Client
    image: str
    quick: bool
    work_dir: Path
    log: Callable[[str], None]

    def sandbox_params(self) -> dict[str, object]:
        return {"image": self.image, "vcpus": SANDBOX_VCPUS, "memory_mib": SANDBOX_MEMORY_MIB}


@dataclass(frozen=True)
class Benchmark:
    name: str
    title: str
    run: Callable[[BenchContext], BenchResult]


def new_sandbox(ctx: BenchContext) -> Sandbox:
    return Sandbox.create(
        ctx.image, vcpus=SANDBOX_VCPUS, memory_mib=SANDBOX_MEMORY_MIB, client=ctx.client
    )


def now() -> float:
    return time.perf_counter()
