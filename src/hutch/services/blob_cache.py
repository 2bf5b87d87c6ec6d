"""This host's copies of imported images' content as part of the blob cache
(``HUTCH_BLOB_CACHE_BYTES``), evicted least recently used first (:class:`ImageCache`).

The one budget and the one LRU order are :meth:`SnapshotBlobs.evict`'s: it adds the
copies here to the local copies of uploaded named snapshots, sorts them all by last
use and removes the oldest until the total is under the budget. An image's copy
counts (and can go) only once its upload is complete (``ImageBlobs.uploaded``: the
store's index and the database's record): a copy never uploaded is the only one.

Last use is the content directory's mtime (``oci/sha256-<hex>/``), renewed by
:func:`touch_content` whenever ``ImageBlobs.ensure`` or ``HostImages.ensure_local``
finds or fetches it, which every create, cross-host resume and fork child does.

Never evicted while anything on this host may read it:

- a sandbox row in a live state (``LIVE_STATES``: creating, running, paused, ...; in
  the shared database, so of any host) or a named snapshot row (ready or being saved,
  any project) naming an image row whose digest it is: their disks are qcow2 chains
  onto its ``rootfs.ext4``;
- a template of such an image on this host (``Templates.of_image``; pooled VMs are
  restored from one), or a Dockerfile build cache's reference on it (``refs/*-build-cache``:
  cached step layers sit on it);
- a create between its fetch and its row (``HostImages.using``: a shared flock on
  ``oci/sha256-<hex>.use``, held by the create from before ``ensure_local`` to its
  end; across daemons sharing the images directory too), a fetch of it in this daemon
  (its per-digest lock), an import, build or fetch in any daemon (the content's
  ``oci/sha256-<hex>.lock``, tried without waiting).

An eviction takes the content's lock and the ``.use`` lock exclusively without waiting
(either busy: skipped), checks all of the above again under them, renames the
directory to ``oci/.sha256-<hex>.evict-*`` (what a crash leaves there is removed at the
next start by ``discard_partial``) and only then, unlocked, removes it. The image's
database row is never touched: it stays listed (``built`` false here) and its next use
fetches and verifies it again. Built-in images and boot sets are never candidates (they
are not content directories of image rows).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hutch.errors import HutchError
from hutch.images.cache import try_file_lock
from hutch.images.catalog import IMAGES
from hutch.images.oci.importer import content_dir, load_content
from hutch.store.db import LIVE_STATES

if TYPE_CHECKING:
    from hutch.images.build import ImageArtifacts
    from hutch.services.images import HostImages
    from hutch.services.registry import SandboxRegistry

__all__ = [
    "CachedImage",
    "ImageCache",
    "touch_content",
    "unused_content",
    "using_content",
    "using_image",
]

log = logging.getLogger("hutch.services.blob_cache")

#: The marker a Dockerfile build cache leaves in ``refs/`` of every base it builds on.
_BUILD_CACHE_REF = "-build-cache"


def _use_lock(content: Path) -> Path:
    return content.parent / f"{content.name}.use"


@contextlib.contextmanager
def using_content(content: Path) -> Iterator[None]:
    """Hold ``content`` (a content directory, present or not yet) from eviction for the
    block: a shared flock on its ``.use`` file. Waits only while an eviction holds it
    (a check and a rename: milliseconds)."""
    content.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(_use_lock(content), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def unused_content(content: Path) -> contextlib.AbstractContextManager[bool]:
    """The ``.use`` lock of ``content`` held exclusively for the block if no create
    holds it (True), without waiting (False: a create between its fetch and its row);
    what an eviction or an adoption of the content (``ImageBlobs.adopt``) takes."""
    return try_file_lock(_use_lock(content))


def using_image(
    images_dir: Path, image: ImageArtifacts, *, builtin: bool = False
) -> contextlib.AbstractContextManager[None]:
    """:func:`using_content` for the content ``image`` boots from, if it is an imported
    image's, or with ``builtin`` (a blob store: a built-in image's directory may be
    replaced by its upload, ``builtin_blobs``) a built-in image's (never evicted)."""
    content = image.rootfs.parent
    if content.name.startswith("."):
        return contextlib.nullcontext()
    if content.parent == images_dir / "oci":
        return using_content(content)
    if builtin and content.parent.parent == images_dir and content.parent.name in IMAGES:
        return using_content(content)
    return contextlib.nullcontext()


def touch_content(content: Path) -> None:
    """Mark ``content`` used now (the cache's LRU order: the directory's mtime)."""
    with contextlib.suppress(OSError):
        os.utime(content)


@dataclass(frozen=True)
class CachedImage:
    """A copy of an uploaded image's content on this host."""

    last_used: float  # the directory's mtime (epoch seconds)
    digest: str
    path: Path
    size: int  # bytes allocated (rootfs.ext4 is sparse)


class ImageCache:
    """The image side of the blob cache on this host (see the module docstring)."""

    def __init__(self, core: SandboxRegistry, images: HostImages) -> None:
        self.core = core
        self.images = images

    @property
    def images_dir(self) -> Path:
        return self.images.images_dir

    def copies(self) -> list[CachedImage]:
        """Each complete, uploaded content directory here that an image row names.
        Blocking (a stat in the store per digest); a store that fails: not counted."""
        out = []
        for digest in sorted({r.digest for r in self.images.store.list_all()}):
            d = content_dir(self.images_dir, digest)
            if load_content(d) is None:
                continue
            try:
                if not self.images.blobs.uploaded(digest):
                    continue
            except HutchError:
                continue
            try:
                used = d.stat().st_mtime
                size = sum(f.stat().st_blocks * 512 for f in d.rglob("*") if f.is_file())
            except OSError:
                continue
            out.append(CachedImage(used, digest, d, size))
        return out

    def user(self, digest: str, *, here: bool = False) -> str | None:
        """What may read the content ``digest`` now (None: nothing). ``here`` False (an
        eviction): any host's live sandbox or any snapshot row naming it counts, as a
        resume or fork may come here; True (an adoption, ``ImageBlobs.adopt``): only the
        sandboxes of this host and the snapshots whose files are here."""
        rows = [r for r in self.images.store.list_all() if r.digest == digest]
        named = {(r.project, r.name) for r in rows}
        mine = self.core.hosts.ids_on(self.core.host_id) if here else set()
        for rec in self.core.store.list_sandboxes(states=LIVE_STATES):
            if (rec.project, rec.image) in named and (not here or rec.id in mine):
                return f"sandbox {rec.id}"
        for snap in self.core.store.list_snapshots(ready=None):
            if (snap.project, snap.image) in named and (
                not here or self._snapshot_here(snap.path, snap.id)
            ):
                return f"snapshot {snap.id}"
        for name in sorted({r.name for r in rows}):
            if templates := self.core.backend.templates.of_image(name):
                return f"template {templates[0]}"
        refs = content_dir(self.images_dir, digest) / "refs"
        with contextlib.suppress(OSError):
            for ref in os.listdir(refs):
                if ref.endswith(_BUILD_CACHE_REF):
                    return f"build cache {ref}"
        if self.images.blobs.fetching(digest):
            return "a fetch"
        return None

    def _snapshot_here(self, path: str, snapshot_id: str) -> bool:
        """The snapshot's files (its own or a fetched copy) are on this host."""
        own = self.core.backend.fork_dir(snapshot_id)
        saved = Path(path)
        state = self.core.settings.state_dir.resolve()
        return own.exists() or (saved.resolve().is_relative_to(state) and saved.exists())

    def evict(self, copy: CachedImage) -> bool:
        """Remove ``copy`` from this host unless something may read it (checked before
        and again under its locks); True if removed. Blocking; on a worker thread."""
        if self.user(copy.digest) is not None:
            return False
        d = copy.path
        with try_file_lock(d.parent / f"{d.name}.lock") as free:
            if not free:
                return False  # an import, build or fetch of it
            with try_file_lock(_use_lock(d)) as unused:
                if not unused:
                    return False  # a create between its fetch and its row
                if (
                    self.user(copy.digest) is not None
                    or load_content(d) is None
                    or not self.images.blobs.recorded(copy.digest)
                ):
                    return False
                aside = d.parent / f".{d.name}.evict-{secrets.token_hex(4)}"
                try:
                    os.rename(d, aside)
                except OSError as exc:  # kept: an eviction never fails what called it
                    log.warning("image %s: not evicted: %s", copy.digest, exc)
                    return False
        shutil.rmtree(aside, ignore_errors=True)
        log.info("image %s: local copy evicted (%d bytes; in the blob store)", copy.digest,
                 copy.size)  # fmt: skip
        return True
