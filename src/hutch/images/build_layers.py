"""Disk layers of Dockerfile builds: the step cache, the base a build starts from, and
the flat image a build ends with.

A step that changes the filesystem (RUN, COPY, ADD, a WORKDIR to create) leaves a qcow2
overlay on the layer before it: the build sandbox's own disk, taken once the guest has
put back its boot-time files, synced and frozen its filesystem, and QEMU has quit. It is
kept read-only under its step key::

    <state>/build-cache/<key>/disk.qcow2   backing file: the previous layer (absolute path)
                              layer.json   key, parent, base digest, step, times (last)
    <state>/build-cache/.work-*/           a step being committed (removed at start)

The bottom of every chain is a raw ext4 *base* in the images directory's content store
(``oci/sha256-<hex>/rootfs.ext4``, :mod:`hutch.images.oci.importer`): an imported or
pulled image's own, or the package tree of one of hutch's built-in images (FROM base)
made into one here, without hutch's agent or init. The build cache holds a reference
(``refs/<daemon>-build-cache``) on every base it has layers on, dropped when the last
such layer is pruned.

The image a build makes is the top layer's chain flattened into a raw ext4
(``qemu-img convert``: QEMU reads the qcow2 metadata it wrote itself; the guest-written
ext4 inside is copied, never parsed on the host) in a content directory of its own,
digest = the build's key, laid out as imports are, so it boots, lists and deletes as
they do.

Nothing here mounts or parses a filesystem a guest wrote.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hutch.errors import ImageBuildError
from hutch.images import _proc, identity
from hutch.images.cache import atomic_write_text, file_lock
from hutch.images.catalog import get_recipe
from hutch.images.oci.importer import (
    MOUNT_POINTS,
    ROOTFS_LABEL,
    OciContent,
    add_ref,
    content_dir,
    drop_ref,
    find_content,
)
from hutch.images.rootfs import ext4_size_bytes, make_ext4, prepare_tree
from hutch.images.sources import host_mirror_lines

__all__ = [
    "BASE_FORMAT",
    "Layer",
    "LayerStore",
    "builtin_base",
    "flatten",
    "oci_config",
    "scratch_base",
]

LAYER_FORMAT = "hutch-build-layer-v1"
BASE_FORMAT = "hutch-builtin-tree-v1"
_QEMU_IMG = "qemu-img"


@dataclass(frozen=True)
class Layer:
    """A disk state a step can start from: the base (raw) or a step's qcow2 overlay."""

    key: str  # the step key (hex), for the base: the key of the FROM step
    disk: Path
    format: str  # "raw" (the base) or "qcow2"
    base: str  # digest of the base content at the bottom of the chain
    virtual_size: int


def _qemu_img(argv: list[str], what: str, timeout: float = 3600) -> str:
    try:
        done = subprocess.run(
            [_QEMU_IMG, *argv], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ImageBuildError(f"{what}: cannot run qemu-img: {exc} (install qemu-utils)") from exc
    if done.returncode != 0:
        raise ImageBuildError(f"{what} failed: qemu-img {' '.join(argv)}\n{done.stderr[-2000:]}")
    return done.stdout


def _virtual_size(disk: Path) -> int:
    info = json.loads(_qemu_img(["info", "--output=json", "-U", str(disk)], f"reading {disk}"))
    return int(info["virtual-size"])


def oci_config(config: dict[str, Any], created: float, history: list[str]) -> bytes:
    """An OCI image config (linux/amd64, no layer diff_ids: the content is one disk)."""
    doc = {
        "architecture": "amd64",
        "os": "linux",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": []},
        "history": [{"created_by": line} for line in history],
    }
    return json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"


def _write_content(work: Path, digest: str, config_bytes: bytes, extra: dict[str, Any]) -> None:
    """manifest.json + config.json + refs/ + image.json (last) beside work/rootfs.ext4."""
    config_digest = "sha256:" + hashlib.sha256(config_bytes).hexdigest()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": len(config_bytes),
        },
        "layers": [],
    }
    (work / "config.json").write_bytes(config_bytes)
    (work / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (work / "refs").mkdir(exist_ok=True)
    rootfs = work / "rootfs.ext4"
    meta = {
        "format": "oci-rootfs-v1",
        "digest": digest,
        "config_digest": config_digest,
        "size_bytes": rootfs.stat().st_size,
        "layers": 0,
        "added": [],
        "built_at": time.time(),
        # The content identity (issue 14), hashed once where the bytes were made.
        "rootfs_sha256": identity.record(rootfs),
        **extra,
    }
    atomic_write_text(work / "image.json", json.dumps(meta, indent=2) + "\n")
    work.chmod(0o755)


def _publish(final: Path, work: Path) -> None:
    if final.exists():  # a leftover without image.json: not complete
        shutil.rmtree(final)
    os.rename(work, final)


def _content_once(
    images_dir: Path, digest: str, what: str, fill: Callable[[Path], None]
) -> OciContent:
    """The content directory of ``digest``, made by ``fill(work)`` (which writes
    ``rootfs.ext4`` and the content files into ``work``) unless it exists: made once
    under a lock, published by a rename, nothing left behind if ``fill`` fails."""
    final = content_dir(images_dir, digest)
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / f"{final.name}.lock"):
        found = find_content(images_dir, digest)
        if found is not None:
            return found
        work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            fill(work)
            _publish(final, work)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    loaded = find_content(images_dir, digest)
    if loaded is None:
        raise ImageBuildError(f"{what} was made but is not found in {final}")
    return loaded


SCRATCH_FORMAT = "hutch-scratch-v1"


def scratch_base(images_dir: Path) -> OciContent:
    """The base for ``FROM scratch``: an empty filesystem with the mount points a guest
    needs (/proc /sys /dev /run /tmp), made once."""
    hexd = hashlib.sha256(SCRATCH_FORMAT.encode()).hexdigest()
    digest = f"sha256:{hexd}"

    def fill(work: Path) -> None:
        root = work / "root"
        root.mkdir(mode=0o755)
        os.chmod(root, 0o755)
        for name, mode in MOUNT_POINTS:
            (root / name).mkdir()
            os.chmod(root / name, mode)
        size = ext4_size_bytes(0, len(MOUNT_POINTS))
        make_ext4(root, work / "rootfs.ext4", size, ROOTFS_LABEL, uuid.UUID(hex=hexd[:32]))
        shutil.rmtree(root)
        (work / "rootfs.ext4").chmod(0o444)
        _write_content(work, digest, oci_config({"Env": []}, 0.0, ["FROM scratch"]),
                       {"scratch": True})  # fmt: skip

    return _content_once(images_dir, digest, "the scratch base", fill)


def builtin_base(name: str, images_dir: Path) -> OciContent:
    """The base for ``FROM <built-in image>``: its package tree (mmdebstrap, cached; no
    hutch agent, init or resolver file) as a raw ext4 content directory, made once per
    tree digest. Raises ``ImageBuildError``."""
    recipe = get_recipe(name)
    with file_lock(images_dir / f"{recipe.name}.lock"):
        tree = prepare_tree(recipe, host_mirror_lines(recipe.suite), images_dir)
    hexd = hashlib.sha256(f"{BASE_FORMAT}\0{name}\0{tree.digest}".encode()).hexdigest()
    digest = f"sha256:{hexd}"

    def fill(work: Path) -> None:
        root = work / "root"
        _proc.run(["cp", "-al", tree.root, root], what="linking the package tree")
        # mmdebstrap leaves the build host's resolver config; a guest gets its own.
        (root / "etc/resolv.conf").unlink(missing_ok=True)
        size = ext4_size_bytes(tree.size_bytes, tree.files)
        make_ext4(root, work / "rootfs.ext4", size, ROOTFS_LABEL, uuid.UUID(hex=hexd[:32]))
        shutil.rmtree(root)
        (work / "rootfs.ext4").chmod(0o444)
        config = {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]}
        history = [f"hutch built-in image {name} (packages: {', '.join(recipe.packages)})"]
        _write_content(work, digest, oci_config(config, time.time(), history),
                       {"builtin": name, "tree_digest": tree.digest})  # fmt: skip

    return _content_once(images_dir, digest, f"the base of {name}", fill)


def flatten(
    top: Layer,
    images_dir: Path,
    digest: str,
    config_bytes: bytes,
    build: dict[str, Any],
) -> OciContent:
    """The image of a build: ``top``'s whole chain as one raw ext4 in the content
    directory of ``digest`` (found there if an earlier build made it)."""

    def fill(work: Path) -> None:
        rootfs = work / "rootfs.ext4"
        _qemu_img(
            ["convert", "-q", "-f", top.format, "-O", "raw", str(top.disk), str(rootfs)],
            "flattening the build's layers",
        )
        rootfs.chmod(0o444)
        _write_content(work, digest, config_bytes, {"build": build})

    return _content_once(images_dir, digest, f"the built image {digest}", fill)


class LayerStore:
    """The step cache of one daemon (``root``: ``<state>/build-cache``)."""

    def __init__(self, root: Path, images_dir: Path, ref: str) -> None:
        """``ref``: this daemon's reference name on the bases it builds on."""
        self.root = root
        self.images_dir = images_dir
        self.ref = ref

    def start(self) -> None:
        """Remove the steps a stopped daemon was committing."""
        if self.root.is_dir():
            for d in self.root.glob(".work-*"):
                shutil.rmtree(d, ignore_errors=True)

    def base_layer(self, key: str, content: OciContent) -> Layer:
        """The FROM layer of a build on ``content``; the cache references the content
        from now on (its layers sit on it)."""
        add_ref(content, self.ref)
        return Layer(key, content.rootfs, "raw", content.digest, content.size_bytes)

    def _meta(self, key: str) -> dict[str, Any] | None:
        try:
            meta = json.loads((self.root / key / "layer.json").read_text())
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return None
        return meta if isinstance(meta, dict) and meta.get("format") == LAYER_FORMAT else None

    def find(self, key: str, parent: Layer) -> Layer | None:
        """The cached layer of step ``key`` on ``parent``, or None (also when its files are
        gone or it was made on another disk)."""
        meta = self._meta(key)
        disk = self.root / key / "disk.qcow2"
        if meta is None or meta.get("parent") != str(parent.disk) or not disk.is_file():
            return None
        if not parent.disk.is_file():
            return None
        self._touch(key, meta)
        return Layer(key, disk, "qcow2", parent.base, int(meta["virtual_size"]))

    def _touch(self, key: str, meta: dict[str, Any]) -> None:
        meta["used_at"] = time.time()
        with contextlib.suppress(OSError):
            atomic_write_text(self.root / key / "layer.json", json.dumps(meta, indent=2) + "\n")

    def work_dir(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        return Path(tempfile.mkdtemp(prefix=".work-", dir=self.root))

    def commit(self, key: str, parent: Layer, disk: Path, step: str) -> Layer:
        """Keep ``disk`` (a qcow2 on ``parent``, in a :meth:`work_dir`) as step ``key``'s
        layer. It is checked (``qemu-img check``) and made read-only; if another build
        committed the same key meanwhile, that one is kept and ``disk`` dropped."""
        work = disk.parent
        try:
            _qemu_img(["check", "-q", str(disk)], f"checking the layer of {step}")
            info = json.loads(_qemu_img(["info", "--output=json", str(disk)], "reading a layer"))
            backing = info.get("full-backing-filename") or info.get("backing-filename")
            if backing is None or Path(backing).resolve() != parent.disk.resolve():
                raise ImageBuildError(
                    f"the layer of {step} sits on {backing}, not on {parent.disk}"
                )
            disk.chmod(0o444)
            now = time.time()
            meta = {
                "format": LAYER_FORMAT,
                "key": key,
                "parent": str(parent.disk),
                "parent_key": parent.key,
                "base": parent.base,
                "step": step,
                "virtual_size": int(info["virtual-size"]),
                "created_at": now,
                "used_at": now,
            }
            atomic_write_text(work / "layer.json", json.dumps(meta, indent=2) + "\n")
            final = self.root / key
            if self._meta(key) is None:
                if final.exists():
                    shutil.rmtree(final)
                os.rename(work, final)
            else:
                shutil.rmtree(work, ignore_errors=True)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        found = self.find(key, parent)
        if found is None:
            raise ImageBuildError(f"the layer of {step} was committed but cannot be found")
        return found

    # -- size bound ---------------------------------------------------------------------

    def layers(self) -> dict[str, dict[str, Any]]:
        out = {}
        if self.root.is_dir():
            for d in self.root.iterdir():
                if not d.name.startswith("."):
                    meta = self._meta(d.name)
                    if meta is not None:
                        out[d.name] = meta
        return out

    def disk_bytes(self) -> int:
        total = 0
        for key in self.layers():
            with contextlib.suppress(OSError):
                total += (self.root / key / "disk.qcow2").stat().st_blocks * 512
        return total

    def remove(self, keys: set[str]) -> None:
        """Remove these layers (a --no-cache build's, once its image is made)."""
        for key in keys:
            shutil.rmtree(self.root / key, ignore_errors=True)

    def prune(self, limit_bytes: int, keep: set[str], keep_bases: set[str]) -> list[str]:
        """Remove least recently used layers until the cache holds at most
        ``limit_bytes`` (never one in ``keep``, nor one another layer sits on); then
        drop the cache's reference on bases no layer sits on any more (but those in
        ``keep_bases``: builds running now)."""
        removed: list[str] = []
        while True:
            layers = self.layers()
            size = sum(
                (self.root / k / "disk.qcow2").stat().st_blocks * 512
                for k in layers
                if (self.root / k / "disk.qcow2").exists()
            )
            if size <= limit_bytes:
                break
            parents = {m.get("parent_key") for m in layers.values()}
            leaves = [
                (float(m.get("used_at", 0)), k)
                for k, m in layers.items()
                if k not in parents and k not in keep
            ]
            if not leaves:
                break
            _, victim = min(leaves)
            shutil.rmtree(self.root / victim, ignore_errors=True)
            removed.append(victim)
        self.drop_unused_bases({m.get("base") for m in self.layers().values()} | keep_bases)
        return removed

    def drop_unused_bases(self, used: set[Any]) -> None:
        oci = self.images_dir / "oci"
        if not oci.is_dir():
            return
        marker = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.ref)
        for content in oci.iterdir():
            if content.name.startswith(".") or not (content / "refs" / marker).exists():
                continue
            found = find_content(self.images_dir, content.name.replace("-", ":", 1))
            if found is not None and found.digest not in used:
                drop_ref(content, self.ref)
