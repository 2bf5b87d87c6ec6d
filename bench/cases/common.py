"""What every benchmark gets: the daemon to drive, its client, the run's options."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bench.daemon import PrivateDaemon
from bench.model import BenchResult, SampleSet
from hutch import Sandbox
from hutch.sdk import Client

__all__ = [
    "SANDBOX_MEMORY_MIB",
    "SANDBOX_VCPUS",
    "BenchContext",
    "Benchmark",
    "SideDaemon",
    "new_sandbox",
    "now",
]

#: Every benchmark sandbox has the smallest useful shape (the issue's: 256 MiB, 1 vCPU).
SANDBOX_MEMORY_MIB = 256
SANDBOX_VCPUS = 1


@dataclass
class SideDaemon:
    """A second private daemon with settings of its own (e.g. templates off), started
    by a benchmark that compares daemon configurations in one run."""

    daemon: PrivateDaemon
    client: Client
    #: What a benchmark already did on it once (e.g. an untimed warm-up per shape).
    done: set[str] = field(default_factory=set)


@dataclass
class BenchContext:
    daemon: PrivateDaemon
    client: Client
    image: str
    quick: bool
    work_dir: Path
    log: Callable[[str], None]
    #: Side daemons by name; the harness stops any still running at the end of the run.
    side: dict[str, SideDaemon] = field(default_factory=dict)
    #: Side daemons already stopped (the harness checks them for leaked QEMU).
    stopped: list[PrivateDaemon] = field(default_factory=list)
    #: Cold-boot create -> first output samples by memory MiB, shared between the
    #: benchmarks of one run so that every "x / cold boot" ratio uses the same run's boots.
    cold_boots: dict[int, SampleSet] = field(default_factory=dict)

    def sandbox_params(self) -> dict[str, object]:
        return {"image": self.image, "vcpus": SANDBOX_VCPUS, "memory_mib": SANDBOX_MEMORY_MIB}

    def side_daemon(
        self, name: str, env: Mapping[str, str], repo: Path | None = None
    ) -> SideDaemon:
        """The side daemon ``name`` (started on first use with ``env`` added to its
        environment; later calls return it as it is). Its state is under
        ``work_dir/name``, its images are the main daemon's; ``repo``: run the daemon
        from that source tree instead of this one (before/after comparisons)."""
        if name in self.side:
            return self.side[name]
        main = self.daemon
        daemon = PrivateDaemon(
            repo or main.repo, self.work_dir / name, main.images_dir, main.accel, env
        )
        daemon.start()
        self.log(f"  side daemon {name!r} ({dict(env)}) at {daemon.base_url}")
        self.side[name] = SideDaemon(daemon, daemon.client())
        return self.side[name]

    def stop_side_daemon(self, name: str) -> None:
        """Stop ``name`` (deleting its sandboxes); a no-op when it is not running."""
        side = self.side.pop(name, None)
        if side is None:
            return
        with contextlib.suppress(Exception):
            side.client.close()
        side.daemon.stop()
        self.stopped.append(side.daemon)

    def stop_side_daemons(self) -> None:
        for name in list(self.side):
            self.stop_side_daemon(name)


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
