"""Frozen directories for blob tests without a VM: the files a snapshot's freeze leaves
(``disk.qcow2`` on some backing chain, ``vm.json``, ``state.mig``, the manifest, the
frozen marker, everything read-only), made with qemu-img and qemu-io."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from hutch.vm.snapshot_dir import FROZEN_MARKER
from hutch.vm.snapshot_manifest import (
    MANIFEST_FORMAT,
    CompatFields,
    FileStamp,
    SnapshotManifest,
    fd_digest,
    write_atomic,
)

__all__ = ["qemu_tool", "seal_frozen"]


def qemu_tool(*argv: str) -> None:
    """Run qemu-img/qemu-io; a failure raises with its output."""
    subprocess.run(argv, check=True, capture_output=True)


def seal_frozen(snap: Path, state_bytes: int) -> None:
    """Finish the frozen directory ``snap`` whose ``disk.qcow2`` and ``vm.json`` are
    written: ``state_bytes`` random bytes of ``state.mig``, a manifest naming both, the
    frozen marker, every file read-only."""
    state = snap / "state.mig"
    state.write_bytes(os.urandom(state_bytes))
    with state.open("rb") as stream:
        digest, size = fd_digest(stream.fileno())
    (snap / FROZEN_MARKER).write_text("")
    manifest = SnapshotManifest(
        format=MANIFEST_FORMAT,
        name=snap.name,
        created_ns=1,
        qemu_version="7.2.0",
        compat=CompatFields("microvm", "max", "tcg", 256, 1, "ram", "0" * 64, None),
        cmdline="",
        initrd_sha256="0" * 64,
        state_size=size,
        state_digest=digest,
        ram_in_file=False,
        memory=None,
        disk=FileStamp.of((snap / "disk.qcow2").resolve()),
    )
    write_atomic(snap / "manifest.json", manifest.to_json(), fsync=False)
    for f in snap.iterdir():
        os.chmod(f, 0o444)
