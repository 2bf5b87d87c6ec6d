"""What an imported image boots with besides its own disk: hutch's kernel, the OCI
initramfs (``guest_files/initramfs-init-oci``) and the agent runtime disk
(:mod:`hutch.images.agent_runtime`). One *boot set* serves every imported image.

Cached in ``<images_dir>/oci-boot/<key>/`` (``vmlinux`` hard-linked from the kernel
layer, ``initrd.img``, ``runtime.ext4`` hard-linked from the runtime layer, ``boot.json``
written last); ``oci-boot/current`` names the key in use. ``key`` covers the kernel,
the initramfs bytes, the runtime (package tree + agent) and the command line, so a
change to any of them makes a new boot set; old ones stay for the sandboxes and
snapshots that were started from them (their ``vm.json`` names these files).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hutch.errors import ImageBuildError
from hutch.images import _proc, identity
from hutch.images.agent_runtime import prepare_runtime
from hutch.images.build import (
    DEFAULT_AGENT_PATH,
    KERNEL_CMDLINE,
    agent_files,
    agent_sha256,
)
from hutch.images.cache import atomic_write_text, file_lock, file_sha256, short_digest
from hutch.images.catalog import get_recipe
from hutch.images.initramfs import OCI_APPLETS, build_initramfs, init_script
from hutch.images.kernel import prepare_kernel, resolve_kernel_package
from hutch.images.rootfs import prepare_tree
from hutch.images.sources import host_mirror_lines

__all__ = ["BootSet", "find_boot_set", "load_boot_set", "prepare_boot_set"]

_FORMAT = "oci-boot-v1"
INIT_SCRIPT = "initramfs-init-oci"
#: Where the runtime's package tree comes from: the built-in image with Python in it.
RUNTIME_TREE_IMAGE = "base"


@dataclass(frozen=True)
class BootSet:
    key: str
    kernel: Path
    initrd: Path
    runtime: Path
    kernel_release: str
    cmdline: str


def load_boot_set(d: Path) -> BootSet | None:
    """The boot set in ``d`` if it is complete (``boot.json`` and its three files)."""
    try:
        meta = json.loads((d / "boot.json").read_text())
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    boot = BootSet(
        key=str(meta["key"]),
        kernel=d / "vmlinux",
        initrd=d / "initrd.img",
        runtime=d / "runtime.ext4",
        kernel_release=str(meta["kernel_release"]),
        cmdline=str(meta["cmdline"]),
    )
    if not all(p.is_file() for p in (boot.kernel, boot.initrd, boot.runtime)):
        return None
    return boot


def find_boot_set(images_dir: Path) -> BootSet | None:
    """The boot set ``oci-boot/current`` names, or None (no apt, no building)."""
    root = images_dir / "oci-boot"
    try:
        key = (root / "current").read_text().strip()
    except FileNotFoundError:
        return None
    return load_boot_set(root / key)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def prepare_boot_set(
    images_dir: Path,
    *,
    mirrors: Sequence[str] | None = None,
    agent_path: Path = DEFAULT_AGENT_PATH,
) -> BootSet:
    """Build what is missing of the boot set for the current kernel, agent and
    initramfs, make it ``current`` and return it. Reuses the cached kernel and the
    ``base`` image's package tree (running mmdebstrap only if that is missing).
    Raises ``ImageBuildError``."""
    tools = _proc.require_tools()
    images_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(images_dir / "kernel.lock"):
        kernel = prepare_kernel(images_dir, resolve_kernel_package())
    recipe = get_recipe(RUNTIME_TREE_IMAGE)
    lines = list(mirrors) if mirrors is not None else host_mirror_lines(recipe.suite)
    with file_lock(images_dir / f"{recipe.name}.lock"):
        tree = prepare_tree(recipe, lines, images_dir)
    if not (agent_path / "agent.py").is_file():
        raise ImageBuildError(f"guest agent source {agent_path} does not exist")
    agent_sha = agent_sha256(agent_path)
    runtime = prepare_runtime(images_dir, tree, agent_path, agent_files(agent_path), agent_sha)
    root = images_dir / "oci-boot"
    root.mkdir(exist_ok=True)
    with file_lock(images_dir / "oci-boot.lock"):
        with tempfile.TemporaryDirectory(dir=root, prefix=".initrd.") as tmp:
            initrd = Path(tmp) / "initrd.img"
            build_initramfs(
                tools["busybox"], kernel.modules, initrd, init_script(INIT_SCRIPT), OCI_APPLETS
            )
            key = short_digest(
                _FORMAT, kernel.key, file_sha256(initrd), runtime.key, KERNEL_CMDLINE
            )
            final = root / key
            if load_boot_set(final) is None:
                work = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
                try:
                    shutil.copyfile(initrd, work / "initrd.img")
                    (work / "initrd.img").chmod(0o444)
                    _link_or_copy(kernel.vmlinux, work / "vmlinux")
                    _link_or_copy(runtime.path, work / "runtime.ext4")
                    # Its identity (issue 14): a frozen guest that read this runtime
                    # opens only over the same bytes on another host.
                    identity.record(work / "runtime.ext4")
                    meta = {
                        "key": key,
                        "kernel_release": kernel.release,
                        "kernel_key": kernel.key,
                        "runtime_key": runtime.key,
                        "python": runtime.python,
                        "cmdline": KERNEL_CMDLINE,
                    }
                    atomic_write_text(work / "boot.json", json.dumps(meta, indent=2) + "\n")
                    work.chmod(0o755)
                    if final.exists():
                        shutil.rmtree(final)
                    os.rename(work, final)
                except BaseException:
                    shutil.rmtree(work, ignore_errors=True)
                    raise
        atomic_write_text(root / "current", key + "\n")
    boot = load_boot_set(final)
    if boot is None:
        raise ImageBuildError(f"boot set {key}: built but not found in {root}")
    return boot
