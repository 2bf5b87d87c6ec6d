"""The root filesystem: a package tree from ``mmdebstrap`` (cached), then a raw ext4 image
with the hutch files added (``mkfs.ext4 -d``).

Package tree cache: ``<images_dir>/cache/trees/<key>/root`` + ``tree.json`` (written last).
``<key>`` = recipe suite + packages + mirror lines + the customize steps below; the tree's
own *digest* is the hash of its dpkg status file, i.e. what was actually installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hutch.errors import ImageBuildError
from hutch.images import _proc
from hutch.images.cache import atomic_write_text, short_digest
from hutch.images.catalog import ImageRecipe

__all__ = [
    "CUSTOMIZE_HOOKS",
    "DPKG_EXCLUDES",
    "PackageTree",
    "ext4_size_bytes",
    "make_ext4",
    "measure_tree",
    "prepare_tree",
    "tree_key",
]

_FORMAT = "tree-v1"
GUEST_UID = 1000

#: Documentation nobody reads inside a sandbox; dropping it saves ~15% of the tree.
#: dpkg keeps applying these to packages installed later in the guest.
DPKG_EXCLUDES: tuple[str, ...] = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/lintian/*",
)

#: Run by mmdebstrap inside the new tree (``$1`` is its root).
CUSTOMIZE_HOOKS: tuple[str, ...] = (
    f'chroot "$1" useradd --create-home --uid {GUEST_UID} --user-group --shell /bin/bash user',
    'mkdir -p "$1/opt/hutch" "$1/root" && chmod 0700 "$1/root"',
    # A sandbox is disposable: let `pip install` work without --break-system-packages.
    'rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED',
    # Identity is set per boot by hutch-init and per restore by the agent.
    'rm -f "$1/etc/hostname" && : > "$1/etc/machine-id"',
    'rm -rf "$1"/var/cache/apt/*.bin "$1"/var/log/apt/* "$1"/var/log/dpkg.log',
)


@dataclass(frozen=True)
class PackageTree:
    key: str
    root: Path
    digest: str  # sha256 of var/lib/dpkg/status + key: what is installed
    size_bytes: int  # disk blocks used, hard links counted once
    files: int


def tree_key(recipe: ImageRecipe, mirrors: Sequence[str]) -> str:
    """Cache key of the package tree (pure): everything that goes into mmdebstrap."""
    return short_digest(
        _FORMAT,
        recipe.suite,
        *sorted(recipe.packages),
        "--",
        *mirrors,
        "--",
        *DPKG_EXCLUDES,
        "--",
        *CUSTOMIZE_HOOKS,
    )


def measure_tree(root: Path) -> tuple[int, int]:
    """(bytes of disk blocks used, number of inodes) under ``root``."""
    seen: set[int] = set()
    used = 0
    count = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            st = os.lstat(os.path.join(dirpath, name))
            if st.st_ino in seen:
                continue
            seen.add(st.st_ino)
            used += st.st_blocks * 512
            count += 1
    return used, count


def _load(tdir: Path) -> PackageTree | None:
    meta = tdir / "tree.json"
    if not meta.is_file():
        return None
    m = json.loads(meta.read_text())
    return PackageTree(
        key=m["key"],
        root=tdir / "root",
        digest=m["digest"],
        size_bytes=m["size_bytes"],
        files=m["files"],
    )


def prepare_tree(
    recipe: ImageRecipe, mirrors: Sequence[str], images_dir: Path, force: bool = False
) -> PackageTree:
    """Make sure the package tree for ``recipe`` exists; return it. The caller holds the
    image's lock. Raises ``ImageBuildError`` (with mmdebstrap's stderr tail; an unknown
    package shows up there as "Unable to locate package")."""
    key = tree_key(recipe, mirrors)
    tdir = images_dir / "cache" / "trees" / key
    if not force and (found := _load(tdir)) is not None:
        return found
    tdir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=tdir.parent))
    try:
        root = work / "root"
        argv: list[str] = [
            "mmdebstrap",
            "--mode=root",
            "--variant=minbase",
            "--format=directory",
            "--include=" + ",".join(recipe.packages),
            # The host's apt config may relax date checks for a snapshot mirror.
            '--aptopt=Acquire::Check-Valid-Until "false"',
            *(f"--dpkgopt={opt}" for opt in DPKG_EXCLUDES),
            *(f"--customize-hook={hook}" for hook in CUSTOMIZE_HOOKS),
            recipe.suite,
            str(root),
            *mirrors,
        ]
        try:
            _proc.run(argv, what=f"mmdebstrap for image {recipe.name}", timeout=3600)
        except ImageBuildError as exc:
            missing = re.findall(r"Unable to locate package (\S+)", exc.message)
            if not missing:
                raise
            raise ImageBuildError(
                f"image {recipe.name}: apt has no package {', '.join(sorted(set(missing)))} "
                f"in {recipe.suite} (mirrors: {'; '.join(mirrors)}); fix the recipe.\n"
                + exc.message
            ) from exc
        status = (root / "var/lib/dpkg/status").read_bytes()
        digest = hashlib.sha256(key.encode() + b"\0" + status).hexdigest()[:16]
        used, files = measure_tree(root)
        atomic_write_text(
            work / "tree.json",
            json.dumps(
                {
                    "key": key,
                    "image": recipe.name,
                    "digest": digest,
                    "size_bytes": used,
                    "files": files,
                    "packages": list(recipe.packages),
                    "mirrors": list(mirrors),
                },
                indent=2,
            )
            + "\n",
        )
        if tdir.exists():
            shutil.rmtree(tdir)
        os.rename(work, tdir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    found = _load(tdir)
    assert found is not None
    return found


def ext4_size_bytes(used_bytes: int, files: int) -> int:
    """Filesystem size for a tree (pure): contents + 10% + metadata + 64 MiB free,
    rounded up to 16 MiB. Small on purpose: the guest grows it to the disk at boot."""
    mib = 1 << 20
    inode_bytes = files * 256  # one ext4 inode table entry each
    size = used_bytes * 11 // 10 + inode_bytes * 2 + 64 * mib
    return -(-size // (16 * mib)) * (16 * mib)


def make_ext4(root: Path, out: Path, size_bytes: int, label: str, fs_uuid: uuid.UUID) -> None:
    """A sparse raw ext4 image of ``root`` at ``out``. UUID and hash seed are fixed by the
    caller so a rebuild of the same inputs makes the same filesystem identity."""
    with out.open("wb") as f:
        f.truncate(size_bytes)
    _proc.run(
        [
            "mkfs.ext4",
            "-q",
            "-F",
            "-L",
            label,
            "-U",
            str(fs_uuid),
            "-E",
            f"hash_seed={fs_uuid},root_owner=0:0",
            "-m",
            "0",
            "-i",
            "8192",
            "-d",
            root,
            out,
        ],
        what=f"mkfs.ext4 for {out.name}",
    )
