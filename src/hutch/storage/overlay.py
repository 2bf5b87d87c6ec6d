"""qcow2 overlays: a sandbox disk on top of a read-only raw image, copying nothing."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from hutch.errors import InvalidArgument, StoreError
from hutch.models import DISK_GIB_RANGE

__all__ = ["create_overlay", "overlay_info"]

QEMU_IMG = "qemu-img"


def _run(argv: list[str], what: str) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StoreError(f"{what}: cannot run {argv[0]}: {exc} (install qemu-utils)") from exc
    if done.returncode != 0:
        raise StoreError(f"{what} failed: {' '.join(argv)}\n{done.stderr.strip()}")
    return done.stdout


def create_overlay(base: Path, path: Path, size_gib: int, backing_format: str = "raw") -> None:
    """Create ``path`` as a qcow2 overlay of the image ``base`` with a virtual size of
    ``size_gib`` GiB (it may exceed the base: the guest grows its filesystem).

    ``backing_format``: ``raw`` (an image's ext4), or ``qcow2`` (a Dockerfile build's step
    layer, written by hutch's own QEMU). Always given, never probed: a guest-written raw
    image could pose as qcow2.

    ``base`` is recorded by absolute path and must stay where it is and unchanged.
    Raises ``InvalidArgument`` for a size out of range, ``StoreError`` when the base is
    missing, ``path`` exists, or qemu-img fails (its stderr is in the message).
    """
    lo, hi = DISK_GIB_RANGE
    if isinstance(size_gib, bool) or not isinstance(size_gib, int) or not lo <= size_gib <= hi:
        raise InvalidArgument(f"disk size {size_gib!r} GiB is out of range; accepted: {lo}-{hi}")
    base = base.resolve()
    if not base.is_file():
        raise StoreError(f"base image {base} does not exist; build the image first")
    if path.exists():
        raise StoreError(f"{path} already exists; refusing to overwrite a sandbox disk")
    if backing_format not in ("raw", "qcow2"):
        raise StoreError(f"base image format {backing_format!r}; accepted: raw, qcow2")
    if backing_format == "raw":
        base_size = base.stat().st_size
    else:
        base_size = int(overlay_info(base)["virtual-size"])
    if base_size > size_gib << 30:
        raise InvalidArgument(
            f"disk size {size_gib} GiB is smaller than the image ({base_size / (1 << 30):.2f} "
            "GiB); ask for a larger disk"
        )
    _run(
        [
            QEMU_IMG,
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            backing_format,
            "-b",
            str(base),
            str(path),
            f"{size_gib}G",
        ],
        f"creating overlay {path}",
    )


def overlay_info(path: Path) -> dict[str, Any]:
    """``qemu-img info --output=json`` for ``path``: ``virtual-size`` and ``actual-size``
    (bytes allocated on the host), ``backing-filename``, ... Raises ``StoreError``."""
    # -U: readable while a running QEMU holds the image lock.
    out = _run([QEMU_IMG, "info", "-U", "--output=json", str(path)], f"reading {path}")
    try:
        info = json.loads(out)
    except json.JSONDecodeError as exc:
        raise StoreError(f"qemu-img info {path}: unparsable output: {exc}") from exc
    if not isinstance(info, dict):
        raise StoreError(f"qemu-img info {path}: unexpected output {out[:200]!r}")
    return info
