"""Cold boot, the yardstick of every fast path: ``Sandbox.create`` + ``exec(echo hi)`` on
a side daemon with templates off (``HUTCH_TEMPLATES=0``), so every create boots the
guest kernel. Benchmarks of one run share its samples through ``ctx.cold_boots``.
"""

from __future__ import annotations

from bench.cases.common import SANDBOX_VCPUS, BenchContext, SideDaemon, now
from bench.model import SampleSet
from hutch import Sandbox
from hutch.sdk import Client

__all__ = [
    "COLD_DAEMON",
    "COLD_ENV",
    "ECHO",
    "cold_label",
    "cold_sample",
    "reference_or_measured",
    "time_create_echo",
    "warm_cold",
]

COLD_DAEMON = "cold"
COLD_ENV = {"HUTCH_TEMPLATES": "0", "HUTCH_POOL_SIZE": "0"}
ECHO = ["echo", "hi"]


def time_create_echo(client: Client, image: str, memory_mib: int) -> float:
    """Seconds from ``Sandbox.create`` until ``echo hi``'s output is back; the sandbox is
    killed afterwards (untimed). Raises ``RuntimeError`` on wrong output."""
    t0 = now()
    sb = Sandbox.create(image, vcpus=SANDBOX_VCPUS, memory_mib=memory_mib, client=client)
    try:
        result = sb.exec(ECHO)
        elapsed = now() - t0
        if result.exit_code != 0 or result.stdout != "hi\n":
            raise RuntimeError(
                f"echo hi in {sb.id} gave exit {result.exit_code}, stdout {result.stdout!r}, "
                f"stderr {result.stderr!r}"
            )
    finally:
        sb.kill()
    return elapsed


def cold_label(memory_mib: int) -> str:
    return (
        f"cold boot: Sandbox.create + exec(echo hi), {memory_mib} MiB, "
        "daemon with HUTCH_TEMPLATES=0 (same run)"
    )


def warm_cold(ctx: BenchContext, memory_mib: int) -> SideDaemon:
    """The cold side daemon (started on first use), after one untimed boot at
    ``memory_mib`` (the first boot reads the image into the page cache)."""
    side = ctx.side_daemon(COLD_DAEMON, COLD_ENV)
    warm = f"warm-{memory_mib}"
    if warm not in side.done:
        time_create_echo(side.client, ctx.image, memory_mib)
        side.done.add(warm)
    return side


def cold_sample(ctx: BenchContext, memory_mib: int) -> float:
    """One timed cold boot at ``memory_mib`` on the (warmed) cold side daemon."""
    side = warm_cold(ctx, memory_mib)
    return time_create_echo(side.client, ctx.image, memory_mib)


def reference_or_measured(
    ctx: BenchContext, memory_mib: int, own: list[float], notes: list[str]
) -> SampleSet:
    """The run's cold-boot reference at ``memory_mib``: the samples an earlier benchmark
    of this run measured, else ``own`` (measured by the caller, interleaved with its own
    samples), which then become the run's reference. Says which in ``notes``."""
    cached = ctx.cold_boots.get(memory_mib)
    if cached is not None:
        notes.append(
            f"cold-boot reference: the {cached.summary.n} cold boots of an earlier benchmark "
            "in this run"
        )
        return cached
    if not own:
        raise RuntimeError(f"no cold boots at {memory_mib} MiB were measured")
    ref = SampleSet(cold_label(memory_mib), own)
    ctx.cold_boots[memory_mib] = ref
    notes.append(
        f"cold-boot reference: {len(own)} cold boots measured in this benchmark, "
        "interleaved with its samples"
    )
    return ref
