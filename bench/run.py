"""The harness: one private daemon, the chosen benchmarks, result files, the table."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import traceback
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

from bench.cases import BENCHMARKS, BenchContext
from bench.daemon import PrivateDaemon
from bench.host import foreign_qemu_count, host_facts, loadavg
from bench.model import BenchResult
from bench.report import render_table, utc_stamp, write_results

__all__ = ["main"]

REPO = Path(__file__).resolve().parent.parent


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark hutch against same-run host baselines.",
    )
    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"benchmarks to run (default: all): {', '.join(BENCHMARKS)}",
    )
    parser.add_argument("--quick", action="store_true", help="fewer runs, smaller payloads")
    parser.add_argument("--image", default="base", help="guest image (default: base)")
    parser.add_argument(
        "--images-dir",
        type=Path,
        help="built images (default: $HUTCH_IMAGES_DIR, else $HUTCH_STATE_DIR/images, "
        "else ./var/images)",
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=REPO / "bench" / "results",
        help="where result JSON goes (default: bench/results)",
    )
    parser.add_argument(
        "--no-save", action="store_true", help="print the table, write no result files"
    )
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
    return args


def _images_dir(explicit: Path | None) -> Path:
    if explicit is not None:
        return explicit.resolve()
    if os.environ.get("HUTCH_IMAGES_DIR"):
        return Path(os.environ["HUTCH_IMAGES_DIR"]).resolve()
    state = Path(os.environ.get("HUTCH_STATE_DIR") or REPO / "var")
    return (state / "images").resolve()


def _ensure_image(name: str, images_dir: Path) -> None:
    """Build the image if it is missing (cached and lock-protected, so this is cheap
    when another build already made it)."""
    from hutch.images.build import build_image, find_image

    if find_image(name, images_dir) is not None:
        return
    _log(f"image {name!r} is not built in {images_dir}; building it (minutes, once)")
    build_image(name, images_dir)


def _pin_image(name: str, images_dir: Path, work_dir: Path) -> tuple[Path, str]:
    """A private images directory holding only the version of ``name`` that is current
    now (files hard-linked, copied across file systems), and its digest.

    Other engineers rebuild the shared images while a run goes on; a new ``current``
    would make the daemons cold-boot the new version and build new templates in the
    middle of a measurement, so every daemon of the run reads the pinned copy.
    """
    from hutch.images.build import find_image

    arts = find_image(name, images_dir)
    if arts is None:
        raise SystemExit(f"image {name!r} vanished from {images_dir}; rerun to rebuild it")
    source = arts.rootfs.parent
    pinned = work_dir / "images"
    dest = pinned / name / arts.digest
    dest.mkdir(parents=True)
    for item in source.iterdir():
        try:
            os.link(item, dest / item.name)
        except OSError:
            shutil.copy2(item, dest / item.name)
    (pinned / name / "current").write_text(arts.digest + "\n")
    return pinned, arts.digest


def _check_tools() -> None:
    missing = [t for t in ("bwrap", "qemu-system-x86_64", "cat", "true") if not shutil.which(t)]
    if missing:
        raise SystemExit(
            f"missing host tools {missing}: apt-get install bubblewrap qemu-system-x86"
        )


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Turn SIGTERM into an exception so the finally blocks delete sandboxes and stop
    # the daemon instead of leaving QEMU processes behind.
    raise KeyboardInterrupt(f"signal {signum}")


def _busy_note(host: dict[str, Any]) -> str | None:
    cores = host.get("cores") or 1
    load = host.get("loadavg_start") or [0.0]
    foreign = host.get("foreign_qemu_at_start") or 0
    if foreign or load[0] > cores * 0.75:
        return (
            f"host was busy when this started (load {load[0]}, {foreign} other QEMU "
            "processes); ratios are same-run, but rerun on a quieter host if they look off"
        )
    return None


def _run_one(ctx: BenchContext, name: str, base_facts: dict[str, Any], marker: str) -> BenchResult:
    bench = BENCHMARKS[name]
    _log(f"== {name}: {bench.title}")
    started = datetime.now(UTC)
    host = {
        **base_facts,
        "loadavg_start": loadavg(),
        "foreign_qemu_at_start": foreign_qemu_count(marker),
    }
    try:
        result = bench.run(ctx)
    except Exception as exc:  # one broken benchmark must not hide the others' numbers
        traceback.print_exc()
        result = BenchResult(name, bench.title, ctx.quick, {}, error=f"{type(exc).__name__}: {exc}")
    result.started_at = started.isoformat(timespec="seconds")
    result.finished_at = datetime.now(UTC).isoformat(timespec="seconds")
    host["loadavg_end"] = loadavg()
    host["foreign_qemu_at_end"] = foreign_qemu_count(marker)
    result.host = host
    note = _busy_note(host)
    if note:
        result.notes.append(note)
    leftovers = ctx.daemon.delete_all_sandboxes()
    for side in ctx.side.values():
        leftovers += side.daemon.delete_all_sandboxes()
    if leftovers:
        result.notes.append(f"harness deleted {len(leftovers)} sandboxes the benchmark left")
    return result


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    names = args.names or list(BENCHMARKS)
    _check_tools()
    images_dir = _images_dir(args.images_dir)
    _ensure_image(args.image, images_dir)
    signal.signal(signal.SIGTERM, _on_sigterm)

    stamp = utc_stamp()
    work_dir = Path(tempfile.mkdtemp(prefix="hutch-bench-"))
    pinned_images, digest = _pin_image(args.image, images_dir, work_dir)
    daemon = PrivateDaemon(REPO, work_dir, pinned_images, os.environ.get("HUTCH_ACCEL") or None)
    results: list[BenchResult] = []
    ctx: BenchContext | None = None
    try:
        daemon.start()
        _log(f"hutchd at {daemon.base_url} (accel {daemon.accel_in_use}), state {daemon.state_dir}")
        facts = host_facts(REPO, daemon.accel_in_use)
        facts["image_digest"] = digest
        for key in ("loadavg_start", "foreign_qemu_at_start"):
            facts.pop(key, None)  # recorded per benchmark instead
        with daemon.client() as client:
            ctx = BenchContext(daemon, client, args.image, args.quick, work_dir, _log)
            for name in names:
                # The work dir holds the state of the main and every side daemon, so
                # their QEMUs are never counted as other engineers' load.
                result = _run_one(ctx, name, facts, str(work_dir))
                results.append(result)
                if not args.no_save:
                    write_results(args.results_dir, [result], stamp)
    finally:
        side_daemons: list[PrivateDaemon] = []
        if ctx is not None:
            ctx.stop_side_daemons()
            side_daemons = ctx.stopped
        daemon.stop()
        survivors = daemon.remaining_qemu()
        leaked = list(daemon.leaked_qemu)
        for side in side_daemons:
            survivors += side.remaining_qemu()
            leaked += side.leaked_qemu
        shutil.rmtree(work_dir, ignore_errors=True)
    print(render_table(results))
    if not args.no_save and results:
        _log(f"results: {args.results_dir}/<name>-{stamp}.json and latest.json")
    if leaked or survivors:
        _log(
            f"ERROR: QEMU processes outlived their sandboxes: killed {leaked}, "
            f"still alive {survivors}"
        )
        return 1
    return 1 if any(r.error for r in results) else 0
