"""Installing a template fetched from another host.

``services/template_blobs.py`` downloads it into a staging directory beside the
templates with ``blob_dirs.fetch_dir``: every file checked against its index and the
index against the uploader's record in the database, ``memory.ram`` recreated from its
non-zero extents, the disk rebased onto this host's image (whose identity must be the
one recorded), the stream checked against its manifest, the manifest's disk and memory
stamps renewed for the final directory (the memory's sealed digest kept).

What is left is this host's word: the template must be the one this host would build
(its key file names this host's key; its manifest's QEMU build and VM config are the
ones this host restores with; its disk sits on this host's image), its ``vm.json`` must
name only this host's files (kernel, initrd, runtime disk, disk, memory file: the
saving host's paths replaced), and its memory file is sealed again here, which re-hashes
it and refuses other bytes than the saving host sealed. Only then is the staging
directory renamed into place, in one step: a kill at any point leaves no template (the
staging directory, which ``QemuTemplates.discard_unfinished`` removes at the next
start) or a whole one, never a half one that a clone could map.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

from hutch.crashpoints import crash_point
from hutch.errors import SnapshotError
from hutch.runtime.backend import TemplateInfo
from hutch.runtime.qemu.host import read_config, write_config
from hutch.runtime.qemu.template_key import keyed_complete, read_key_file
from hutch.vm.argv import VmConfig
from hutch.vm.disk_chain import disk_chain
from hutch.vm.snapshot_dir import FROZEN_MARKER, load_manifest
from hutch.vm.snapshot_manifest import MEMORY_FILE, compat_fields, compat_mismatches, fsync_path
from hutch.vm.snapshot_seal import seal_memory

__all__ = ["install"]

#: The VM config fields a fetched template must share with this host's (the paths and
#: the per-host knobs are rewritten; the rest is the machine the stream restores into).
_SAME = ("vcpus", "memory_mib", "cmdline", "accel", "tsc_khz", "nic", "memory_shared")


def install(staging: Path, info: TemplateInfo, cfg: VmConfig, rootfs: Path) -> Path:
    """Check, rehome and seal the fetched template in ``staging`` (see the module
    docstring) and rename it to ``info.path``; return that directory. ``cfg``: the VM
    this host would build the template as, its files in ``info.path``; ``rootfs``: the
    image's root filesystem here. ``SnapshotError`` naming what differs (``staging`` is
    then the caller's to remove)."""
    final = info.path
    what = f"the template of {info.image} at {info.shape} fetched into {staging}"
    kept = read_key_file(staging)
    if kept is None or kept.key != info.key:
        raise SnapshotError(
            f"{what} is keyed {kept.key[:16] if kept else 'nothing'}..., not {info.key[:16]}"
            "... as this host would build it; it is not used"
        )
    manifest = load_manifest(staging)
    qemu = info.inputs.get("qemu")
    if manifest.qemu_version != qemu:
        raise SnapshotError(
            f"{what} was saved by QEMU {manifest.qemu_version!r}; this host runs {qemu!r}"
        )
    problems = compat_mismatches(manifest.compat, compat_fields(cfg))
    if problems:
        raise SnapshotError(f"{what} does not fit this host's VM: " + "; ".join(problems))
    _layers, base = disk_chain(staging / "disk.qcow2")
    if base is None or base != rootfs.resolve():
        raise SnapshotError(f"{what} has its disk on {base}, not on this host's {rootfs}")
    _rehome(staging, final, cfg, what)
    if not (staging / FROZEN_MARKER).exists():
        (staging / FROZEN_MARKER).write_text("fetched\n")
    # Sealed last: the seal records the memory file's ctime, which a chmod would move.
    seal_memory(staging)
    fsync_path(staging, directory=True)
    crash_point("template.staged")
    if final.exists():
        if keyed_complete(final, info.key):  # installed or built meanwhile: that one stays
            shutil.rmtree(staging, ignore_errors=True)
            return final
        # Published only in part (a build's publish cut short): no clone maps it, since a
        # template counts only once its vm.json, moved in last, is there.
        shutil.rmtree(final)
    os.rename(staging, final)
    fsync_path(final.parent, directory=True)
    return final


def _rehome(staging: Path, final: Path, cfg: VmConfig, what: str) -> None:
    """``vm.json`` with this host's files, once the machine it describes is checked."""
    fetched = read_config(staging / "vm.json")
    if fetched is None:
        raise SnapshotError(f"{what} has no readable vm.json")
    differs = [f for f in _SAME if getattr(fetched, f) != getattr(cfg, f)]
    if fetched.volumes or fetched.shares:
        differs.append("volumes")
    if differs:
        raise SnapshotError(f"{what} has another VM config ({', '.join(differs)}) than this host")
    rehomed = dataclasses.replace(
        cfg,
        disk=final / "disk.qcow2",
        memory_file=final / MEMORY_FILE if fetched.memory_file is not None else None,
    )
    write_config(staging / "vm.json", rehomed)
    os.chmod(staging / "vm.json", 0o444)
