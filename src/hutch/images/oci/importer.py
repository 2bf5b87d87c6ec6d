"""From an image source to a root filesystem: resolve the manifest (an index picks
linux/amd64), verify every document and blob against its digest, apply the layers in
order and write the tree into a raw ext4 image.

Content cache: ``<images_dir>/oci/sha256-<hex>/`` (``hex`` = the manifest digest), holding
``rootfs.ext4`` (read-only, sparse), ``manifest.json`` + ``config.json`` (the documents as
received) and ``image.json`` (written last: its presence means the directory is complete).
A second import of the same manifest finds it and downloads nothing. The directory is
assembled under a temporary name beside it and renamed into place, so a failed or
interrupted import leaves nothing that looks like an image; :func:`discard_partial`
removes such leftovers. Builds of one digest serialize on ``oci/sha256-<hex>.lock``.

``refs/`` inside a content directory holds one empty file per image record that uses
it (records live in each daemon's database; the images directory may be shared by
several daemons): the content goes when the last reference does.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hutch.errors import InvalidImage
from hutch.images import identity
from hutch.images.cache import atomic_write_text, file_lock, try_file_lock
from hutch.images.oci.compression import decompressed
from hutch.images.oci.digest import (
    Readable,
    VerifyingReader,
    digest_of,
    parse_digest,
    verify_bytes,
)
from hutch.images.oci.layers import MAX_TREE_BYTES, TreeApplier
from hutch.images.oci.manifest import (
    Descriptor,
    ImageConfig,
    Index,
    Manifest,
    parse_config,
    parse_manifest_or_index,
    select_platform,
)
from hutch.images.rootfs import ext4_size_bytes, make_ext4, measure_tree

__all__ = [
    "MOUNT_POINTS",
    "ImportProgress",
    "OciContent",
    "Resolved",
    "add_ref",
    "build_content",
    "content_dir",
    "discard_partial",
    "drop_ref",
    "find_content",
    "load_content",
    "resolve",
]

_FORMAT = "oci-rootfs-v1"
ROOTFS_LABEL = "hutch-root"
_MAX_DOC = 4 << 20
_MAX_NESTING = 4
#: Directories the guest mounts its API filesystems on; made (empty) when an image
#: lacks them, as a container runtime does. Listed in ``image.json`` as ``added``.
MOUNT_POINTS: tuple[tuple[str, int], ...] = (
    ("proc", 0o555),
    ("sys", 0o555),
    ("dev", 0o755),
    ("run", 0o755),
    ("tmp", 0o1777),
)


class Source(Protocol):
    def top(self) -> tuple[bytes, str | None, str | None]: ...

    def open_blob(self, desc: Descriptor) -> contextlib.AbstractContextManager[Readable]: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ImportProgress:
    """``stage``: resolving | layer | filesystem | done. ``done``/``total``: bytes of the
    current layer's blob (layer stage) or of the whole pull so far; total None if
    unknown."""

    stage: str
    message: str
    done: int = 0
    total: int | None = None
    layer: int | None = None  # 1-based
    layers: int | None = None


Progress = Callable[[ImportProgress], None]


@dataclass(frozen=True)
class Resolved:
    manifest_digest: str
    manifest_bytes: bytes
    manifest: Manifest
    config_bytes: bytes
    config: ImageConfig


@dataclass(frozen=True)
class OciContent:
    digest: str  # the manifest digest, "sha256:<hex>"
    path: Path
    config: ImageConfig
    config_digest: str
    size_bytes: int  # virtual size of rootfs.ext4
    layers: int
    added: tuple[str, ...]
    built_at: float

    @property
    def rootfs(self) -> Path:
        return self.path / "rootfs.ext4"


def _noop(_: ImportProgress) -> None:
    return None


def _read_blob(source: Source, desc: Descriptor, what: str) -> bytes:
    if desc.size > _MAX_DOC:
        raise InvalidImage(f"{what} declares {desc.size} bytes; at most {_MAX_DOC}")
    with source.open_blob(desc) as raw:
        data = raw.read(desc.size + 1)
    if len(data) != desc.size:
        raise InvalidImage(
            f"{what}: {len(data)} bytes where its descriptor declares {desc.size}; "
            "truncated or corrupt"
        )
    verify_bytes(data, desc.digest, what)
    return data


def _manifest_blob(source: Source, desc: Descriptor) -> tuple[bytes, str | None]:
    fetch = getattr(source, "manifest", None)
    if fetch is not None:  # a registry serves manifests on their own endpoint
        body, media_type = fetch(desc.digest)
        verify_bytes(body, desc.digest, f"manifest {desc.digest}")
        return body, media_type or desc.media_type
    return _read_blob(source, desc, f"manifest {desc.digest}"), desc.media_type


def resolve(source: Source, what: str) -> Resolved:
    """Find and verify the linux/amd64 manifest and its config."""
    body, media_type, expected = source.top()
    if expected is not None:
        verify_bytes(body, expected, f"{what}: manifest")
    doc: Manifest | Index = parse_manifest_or_index(body, media_type, f"{what}: manifest")
    for _ in range(_MAX_NESTING):
        if isinstance(doc, Manifest):
            break
        desc = select_platform(doc, f"{what}: index")
        body, media_type = _manifest_blob(source, desc)
        doc = parse_manifest_or_index(body, media_type, f"{what}: manifest {desc.digest}")
    if not isinstance(doc, Manifest):
        raise InvalidImage(f"{what}: indexes nested deeper than {_MAX_NESTING}")
    config_bytes = _read_blob(source, doc.config, f"{what}: config {doc.config.digest}")
    config = parse_config(config_bytes, f"{what}: config")
    if len(config.diff_ids) != len(doc.layers):
        raise InvalidImage(
            f"{what}: the manifest has {len(doc.layers)} layers, the config's "
            f"rootfs.diff_ids {len(config.diff_ids)}"
        )
    return Resolved(digest_of(body), body, doc, config_bytes, config)


def content_dir(images_dir: Path, digest: str) -> Path:
    d = parse_digest(digest)
    return images_dir / "oci" / f"{d.algorithm}-{d.hex}"


def load_content(path: Path) -> OciContent | None:
    """The content directory ``path`` if it is complete (``image.json``, a config that
    parses, ``rootfs.ext4``), else None."""
    try:
        meta = json.loads((path / "image.json").read_text())
        config = parse_config((path / "config.json").read_bytes())
    except (FileNotFoundError, NotADirectoryError, ValueError, InvalidImage):
        return None
    if not (path / "rootfs.ext4").is_file():
        return None
    return OciContent(
        digest=meta["digest"],
        path=path,
        config=config,
        config_digest=meta["config_digest"],
        size_bytes=int(meta["size_bytes"]),
        layers=int(meta["layers"]),
        added=tuple(meta.get("added", ())),
        built_at=float(meta["built_at"]),
    )


def find_content(images_dir: Path, digest: str) -> OciContent | None:
    """The complete content directory of manifest ``digest``, or None."""
    return load_content(content_dir(images_dir, digest))


def build_content(
    source: Source,
    resolved: Resolved,
    images_dir: Path,
    *,
    what: str,
    progress: Progress | None = None,
    max_bytes: int = MAX_TREE_BYTES,
) -> OciContent:
    """The content directory for ``resolved``: found in the cache, or built from the
    source's layers. Raises ``InvalidImage`` for bad content (digest mismatch, path
    escaping the root, truncated layer, ...) and ``ImageBuildError`` for host trouble;
    either way nothing of the attempt is left on disk."""
    report = progress or _noop
    final = content_dir(images_dir, resolved.manifest_digest)
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / f"{final.name}.lock"):
        found = load_content(final)
        if found is not None:
            report(ImportProgress("done", f"{what}: already imported ({found.digest})"))
            return found
        work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            built = _build(source, resolved, work, what, report, max_bytes)
            if final.exists():  # a leftover without image.json: not complete
                shutil.rmtree(final)
            os.rename(work, final)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    loaded = load_content(final)
    assert loaded is not None, built
    return loaded


def _build(
    source: Source,
    resolved: Resolved,
    work: Path,
    what: str,
    report: Progress,
    max_bytes: int,
) -> Path:
    root = work / "root"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    applier = TreeApplier(root, max_bytes=max_bytes)
    layers = resolved.manifest.layers
    for i, (desc, diff_id) in enumerate(zip(layers, resolved.config.diff_ids, strict=True), 1):
        label = f"{what}: layer {i}/{len(layers)} ({desc.digest})"
        report(ImportProgress("layer", label, 0, desc.size, i, len(layers)))
        _apply_layer(source, desc, diff_id, applier, label, report, i, len(layers))
    added = _add_mount_points(applier, resolved.config)
    applier.finish()
    report(ImportProgress("filesystem", f"{what}: writing the ext4 filesystem"))
    used, files = measure_tree(root)
    size = ext4_size_bytes(used, files)
    hex_digest = parse_digest(resolved.manifest_digest).hex
    rootfs = work / "rootfs.ext4"
    make_ext4(root, rootfs, size, ROOTFS_LABEL, uuid.UUID(hex=hex_digest[:32]))
    shutil.rmtree(root)
    rootfs.chmod(0o444)
    (work / "manifest.json").write_bytes(resolved.manifest_bytes)
    (work / "config.json").write_bytes(resolved.config_bytes)
    (work / "refs").mkdir()
    meta = {
        "format": _FORMAT,
        "digest": resolved.manifest_digest,
        "config_digest": resolved.manifest.config.digest,
        "size_bytes": size,
        "layers": len(layers),
        "added": added,
        "built_at": time.time(),
        # The content identity (issue 14): hashed once here, where the bytes were just
        # written; a frozen disk made on this rootfs opens only over these bytes.
        "rootfs_sha256": identity.record(rootfs),
    }
    atomic_write_text(work / "image.json", json.dumps(meta, indent=2) + "\n")
    work.chmod(0o755)
    return work


def _apply_layer(
    source: Source,
    desc: Descriptor,
    diff_id: str,
    applier: TreeApplier,
    label: str,
    report: Progress,
    index: int,
    count: int,
) -> None:
    with source.open_blob(desc) as raw:
        blob = VerifyingReader(raw, desc.digest, f"{label} blob", size=desc.size)
        last = [0.0]

        def tick(_: int) -> None:
            now = time.monotonic()
            if now - last[0] > 0.25:
                last[0] = now
                report(ImportProgress("layer", label, blob.seen, desc.size, index, count))

        with decompressed(blob, label) as plain:
            tar = VerifyingReader(plain, diff_id, f"{label} uncompressed (diff_id)")
            applier.apply(tar, label, progress=tick)
            tar.drain()
        blob.drain()
    report(ImportProgress("layer", label, desc.size, desc.size, index, count))


def _add_mount_points(applier: TreeApplier, config: ImageConfig) -> list[str]:
    added: list[str] = []
    for name, mode in MOUNT_POINTS:
        path = applier.root / name
        if not os.path.lexists(path):
            os.mkdir(path)
            os.chmod(path, mode)
            added.append("/" + name)
    if config.working_dir:
        parts = tuple(p for p in config.working_dir.split("/") if p)
        if applier.resolve(parts, "WorkingDir", create=False) is None:
            applier.resolve(parts, "WorkingDir", create=True)
            added.append(config.working_dir)
    return added


def add_ref(content: OciContent, ref: str) -> None:
    """Record that image record ``ref`` uses ``content``."""
    (content.path / "refs").mkdir(exist_ok=True)
    (content.path / "refs" / _ref_file(ref)).touch()


def drop_ref(content_path: Path, ref: str) -> bool:
    """Forget ``ref``; remove the content once nothing refers to it. True if removed."""
    lock = content_path.parent / f"{content_path.name}.lock"
    with file_lock(lock):
        with contextlib.suppress(FileNotFoundError):
            (content_path / "refs" / _ref_file(ref)).unlink()
        try:
            left = os.listdir(content_path / "refs")
        except FileNotFoundError:
            left = []
        if left:
            return False
        shutil.rmtree(content_path, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        lock.unlink()
    return True


def _ref_file(ref: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in ref)[:200]


def discard_partial(images_dir: Path) -> list[str]:
    """Remove what a killed daemon left half made (the caller runs it at start): import
    and fetch work directories in ``oci/`` nobody is building (their content's lock is
    free), and in ``oci-boot/`` every dot entry (a boot set's fetch or build directory,
    the initramfs's, a ``current`` being written) when nobody holds ``oci-boot.lock``,
    under which all of them are made. Returns their paths under ``images_dir``."""
    removed: list[str] = []
    root = images_dir / "oci"
    if root.is_dir():
        for entry in root.iterdir():
            if not entry.name.startswith(".") or not entry.is_dir():
                continue
            final_name = entry.name[1:].split(".", 1)[0]
            with try_file_lock(root / f"{final_name}.lock") as free:
                if free:
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(f"oci/{entry.name}")
    boot = images_dir / "oci-boot"
    leftovers = sorted(e for e in boot.iterdir() if e.name.startswith(".")) if boot.is_dir() else []
    if leftovers:
        with try_file_lock(images_dir / "oci-boot.lock") as free:
            if free:
                for entry in leftovers:
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)
                    removed.append(f"oci-boot/{entry.name}")
    return removed
