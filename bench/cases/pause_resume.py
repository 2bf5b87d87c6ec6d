"""``pause_resume``: pause (memory mode) and resume of a 512 MiB sandbox with 256 MiB of
its memory dirtied with random bytes, against the host doing the same I/O with ``cat``.

* dirty: a guest process (``setsid -f python3``) fills a 256 MiB ``bytearray`` with
  ``os.urandom`` (incompressible, so QEMU's zero-page shortcut cannot skip it) and holds
  it until the sandbox dies;
* pause: ``sb.pause("memory")`` until it returns (QEMU stopped, RAM and device state in
  ``<state>/sandboxes/<id>/pause/state.mig``); baseline: ``cat state.mig > f`` with ``f``
  in the daemon's state directory (same bytes, same disk), taken while the sandbox is
  paused. Neither side fsyncs (hutch's pause does not ask for it);
* resume: ``sb.resume()`` + ``exec(["true"])`` until it answers; compared with the
  run's cold boot (target <= 1/10) and with ``cat f > /dev/null`` (the read-back of the
  same byte count; ``f`` was just written, so it comes from the page cache, as the pause
  file a resume reads usually does too: nothing is dropped from any cache).

After every resume the holder process must still be alive (the memory came back).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from pathlib import Path

from bench.baselines import time_cat
from bench.cases.coldboot import cold_sample, reference_or_measured
from bench.cases.common import SANDBOX_VCPUS, BenchContext, now
from bench.model import BenchResult, Metric, SampleSet
from hutch import Sandbox

__all__ = ["HOLDER", "holder_command", "run_pause_resume"]

MEMORY_MIB = 512
DIRTY_MIB = 256
READY_FILE = "/tmp/bench-hold.pid"
#: Runs in the guest: dirty DIRTY_MIB of RAM with random bytes, hold it, say its pid.
HOLDER = (
    "import os, time\n"
    f"n = {DIRTY_MIB} << 20\n"
    "buf = bytearray(n)\n"
    "for i in range(0, n, 1 << 20):\n"
    "    buf[i:i + (1 << 20)] = os.urandom(1 << 20)\n"
    f"open('{READY_FILE}.tmp', 'w').write(str(os.getpid()))\n"
    f"os.rename('{READY_FILE}.tmp', '{READY_FILE}')\n"
    "while True:\n"
    "    time.sleep(3600)\n"
)
DIRTY_WAIT_S = 600.0


def holder_command() -> str:
    """The shell command that starts the holder detached from the exec (``setsid -f``,
    no inherited pipes, so the exec returns at once)."""
    return f"setsid -f python3 -c {shlex.quote(HOLDER)} </dev/null >/dev/null 2>&1"


def _dirty(sb: Sandbox) -> int:
    """Start the holder and wait until its memory is filled; returns its RSS in KiB."""
    started = sb.exec(holder_command())
    if started.exit_code != 0:
        raise RuntimeError(f"could not start the memory holder: {started.stderr!r}")
    deadline = time.monotonic() + DIRTY_WAIT_S
    while time.monotonic() < deadline:
        probe = sb.exec(f"test -s {READY_FILE} && grep VmRSS /proc/$(cat {READY_FILE})/status")
        if probe.exit_code == 0:
            return int(probe.stdout.split()[1])
        time.sleep(1.0)
    raise RuntimeError(f"the guest did not dirty {DIRTY_MIB} MiB within {DIRTY_WAIT_S:.0f} s")


def _holder_alive(sb: Sandbox) -> bool:
    return sb.exec(f"kill -0 $(cat {READY_FILE})").exit_code == 0


def _time_read(path: Path) -> float:
    """Seconds for ``cat path > /dev/null``."""
    start = now()
    done = subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=False)
    elapsed = now() - start
    if done.returncode != 0:
        raise RuntimeError(f"baseline cat {path} > /dev/null exited {done.returncode}")
    return elapsed


def run_pause_resume(ctx: BenchContext) -> BenchResult:
    runs = 2 if ctx.quick else 3
    result = BenchResult(
        "pause_resume",
        "pause/resume of a 512 MiB sandbox with 256 MiB dirty vs cat",
        ctx.quick,
        {
            "runs": runs,
            "image": ctx.image,
            "vcpus": SANDBOX_VCPUS,
            "memory_mib": MEMORY_MIB,
            "dirty_mib": DIRTY_MIB,
            "pause_mode": "memory",
        },
    )
    cat_dst = ctx.daemon.state_dir / "bench-pause-copy.bin"
    pauses: list[float] = []
    resumes: list[float] = []
    resume_calls: list[float] = []
    writes: list[float] = []
    reads: list[float] = []
    colds: list[float] = []
    sizes: list[int] = []
    phases: list[dict[str, float]] = []
    need_cold = MEMORY_MIB not in ctx.cold_boots
    sb = Sandbox.create(ctx.image, vcpus=SANDBOX_VCPUS, memory_mib=MEMORY_MIB, client=ctx.client)
    try:
        rss_kib = _dirty(sb)
        result.params["holder_rss_kib"] = rss_kib
        ctx.log(f"  {sb.id}: holder RSS {rss_kib / 1024:.0f} MiB")
        state_mig = ctx.daemon.state_dir / "sandboxes" / sb.id / "pause" / "state.mig"
        for i in range(runs):
            if need_cold:
                colds.append(cold_sample(ctx, MEMORY_MIB))
            t0 = now()
            sb.pause("memory")
            pauses.append(now() - t0)
            if not state_mig.is_file():
                raise RuntimeError(f"paused, but there is no {state_mig}")
            sizes.append(state_mig.stat().st_size)
            manifest = json.loads((state_mig.parent / "manifest.json").read_text())
            phases.append(manifest.get("timings_ms", {}))
            # Same bytes, same disk, while no guest runs: what writing them costs here.
            writes.append(time_cat(state_mig, cat_dst))
            reads.append(_time_read(cat_dst))
            cat_dst.unlink()
            t0 = now()
            sb.resume()
            t1 = now()
            answer = sb.exec(["true"])
            resumes.append(now() - t0)
            resume_calls.append(t1 - t0)
            if answer.exit_code != 0 or not _holder_alive(sb):
                raise RuntimeError(f"{sb.id}: after resume the memory holder is gone")
            ctx.log(
                f"  run {i + 1}/{runs}: pause {pauses[-1]:.3f} s ({sizes[-1] / 1e6:.0f} MB; "
                f"cat {writes[-1]:.3f} s), resume+exec {resumes[-1]:.3f} s "
                f"(cat read {reads[-1]:.3f} s)"
                + (f", cold boot {colds[-1]:.3f} s" if colds else "")
                + f"; save phases (ms) {phases[-1]}"
            )
    finally:
        sb.kill()
        cat_dst.unlink(missing_ok=True)

    result.params["pause_file_bytes"] = sizes
    result.params["save_phases_ms"] = phases
    cold = reference_or_measured(ctx, MEMORY_MIB, colds, result.notes)
    write = SampleSet("cat state.mig > file on the daemon's disk (same byte count)", writes)
    result.metrics = [
        Metric(
            "pause_vs_cat_write",
            "s",
            "lower",
            "sb.pause('memory') ÷ cat of the pause file's bytes to the same disk (target <= 2)",
            SampleSet("sb.pause('memory')", pauses),
            write,
        ),
        Metric(
            "resume_vs_cold_boot",
            "s",
            "lower",
            "sb.resume() + exec(true) ÷ cold boot create + exec(echo hi) (target <= 0.1)",
            SampleSet("sb.resume() + exec(['true'])", resumes),
            cold,
        ),
        Metric(
            "resume_vs_cat_read",
            "s",
            "lower",
            "sb.resume() + exec(true) ÷ cat of the same byte count to /dev/null (page cache hot)",
            SampleSet("sb.resume() + exec(['true'])", list(resumes)),
            SampleSet("cat file > /dev/null (same byte count, page cache)", reads),
        ),
        Metric(
            "resume_call",
            "s",
            "lower",
            "sb.resume() alone (returns when the restored guest's agent answers)",
            SampleSet("sb.resume()", resume_calls),
        ),
    ]
    result.notes.append(
        "the same sandbox is paused and resumed each run; the page cache is not dropped, "
        "so the cat read-back (and the resume's read of state.mig) come from memory"
    )
    return result
