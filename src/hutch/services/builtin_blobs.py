"""Built-in images (``base``, ``devbox``) in the blob store (``HUTCH_BLOB_URL``), so that
every host of a cluster holds one content per image digest (:class:`BuiltinBlobs`).

Why: each host builds its own built-in images (``hutch image build``,
``images/build.py``) and those builds are not byte-reproducible (mmdebstrap, mkfs): two
hosts hold other ``rootfs.ext4`` bytes under one ``<name>/<digest>/``, and a frozen VM
state (a pause, a fork parent, a named snapshot) taken over one does not open over the
other (``blob_dirs``: ``ImageMismatch``). A host of another hutch version or with other
apt mirrors has another digest altogether.

Layout in the store (the directory's path under the images directory, under
``builtin/``; the per-prefix machinery is ``blob_prefixes.PrefixBlobs``, which imported
images use too)::

    images/builtin/<name>/<digest>/rootfs.ext4, vmlinux, initrd.img, manifest.json
    images/builtin/<name>/<digest>/index.json      written last

Upload: every complete ``<name>/<digest>/`` on this host (``current``'s and any other),
in the background (``BackgroundUploads``: retried 2/5/15/60 s), at the daemon's start
and again at each resync (every ``RESYNC_S``) for a directory whose upload is not
complete: the prefix claimed in the database (one winner), the files streamed, the
``image_uploads`` record of what was sent, the index, the claim released. Another
host's claim means "wait" (retried) until its upload completes; the first complete
upload of a prefix is the content of that digest for every host.

Converge (:meth:`BuiltinBlobs.converge`): a host whose copy's rootfs identity
(``hutch.images.identity``, recorded when it was built or fetched: no re-hash) differs
from the record's ``rootfs.ext4`` sha256 adopts the bucket's bytes, at the daemon's
start before its templates and pool are made, and at each upload attempt and resync:

1. kept while anything on this host uses the copy (:class:`BuiltinUsers`: a sandbox or
   a frozen fork, snapshot or fetch whose disk chain ends in it, a named snapshot of
   this host frozen over it whose files were evicted), while another hutchd shares the
   images directory (the presence lock ``.hutchd.lock``: its sandboxes are not this
   daemon's to see), while a build of the image runs (``<name>.lock``) or a create or
   a frozen-state fetch holds the copy (``<name>/<digest>.use``, shared): logged once
   per reason, tried again at the next attempt;
2. fetched into ``<name>/.<digest>.fetch-*`` and checked as any fetch (every file
   against the record, the manifest naming that name and digest, the rootfs's declared
   size and sha256), under ``<name>/<digest>.lock``;
3. the image's pool held off (its pooled VMs destroyed, no refill), then under the
   ``.use`` lock taken exclusively and the checks of 1. made again: its templates
   retired (derived state: the pool and the next create make them again from the new
   bytes), and the fetched directory exchanged in for the copy in one step
   (``replace_dir``: renameat2 RENAME_EXCHANGE), the old copy removed after;
4. this host's published identities rewritten (``hosts.images_json``).

A kill at any point leaves the old complete directory or the new one (crash points
``adopt.staged``, ``adopt.retired``, ``adopt.swapped``); the next start removes the
partial fetches and old copies (:meth:`BuiltinBlobs.discard_partial`).

Fetch on demand (:meth:`BuiltinBlobs.hold`, ``fetch_dir``'s ``images``): a frozen
state whose index names ``<images>/<name>/<digest>/rootfs.ext4`` that this host lacks
gets that directory fetched first, verified the same way, without changing
``<name>/current``; without a complete recorded upload nothing is fetched and the
frozen state is refused with ``ImageMissing`` naming the image and digest.

Publication: each host writes the built-in images it holds, name -> digest -> rootfs
sha256, into its ``hosts`` row (:meth:`BuiltinBlobs.publish`: at the start, after an
adoption or a fetch, at each resync when changed) for placement
(``services/image_compat.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

from hutch.crashpoints import crash_point
from hutch.errors import HutchError, ImageMissing
from hutch.images import identity
from hutch.images.build import built_digests, image_at
from hutch.images.cache import file_lock, replace_dir, restore_replaced, try_file_lock
from hutch.images.catalog import IMAGES
from hutch.services.background_uploads import RETRY_S, BackgroundUploads
from hutch.services.blob_cache import unused_content, using_content
from hutch.services.blob_dirs import builtin_of
from hutch.services.blob_prefixes import PrefixBlobs, Staged, image_prefix
from hutch.services.image_adoption import differs_from_upload
from hutch.services.image_blob_checks import check_builtin
from hutch.services.image_blobs import RESYNC_S, ImageBlobs
from hutch.storage.blobs import BlobStore
from hutch.store.hosts import BuiltinIdentities, HostStore
from hutch.store.image_uploads import ImageUploadStore, UploadRecord

__all__ = [
    "PRESENCE_LOCK",
    "BuiltinBlobs",
    "BuiltinUsers",
    "builtin_prefix",
    "uploaded_identity",
]

log = logging.getLogger("hutch.services.builtin_blobs")

#: A built-in image's directory name (its digest: ``hutch.images.build``).
_DIGEST = re.compile(r"^[0-9a-f]{16}$")
#: What the store's names put before a built-in image's directory path.
UNDER = "builtin/"
#: Held shared by every hutchd with a blob store for its life (in its images
#: directory): an adoption proceeds only where it alone holds it.
PRESENCE_LOCK = ".hutchd.lock"


def builtin_prefix(name: str, digest: str) -> str:
    """The store prefix of built-in image ``name`` at ``digest``."""
    return image_prefix(f"{UNDER}{name}/{digest}")


def uploaded_identity(records: ImageUploadStore, name: str, digest: str) -> str | None:
    """The rootfs sha256 of the upload of ``name`` at ``digest`` recorded in the
    database (None: none recorded). One row read, no store request."""
    found = records.get(builtin_prefix(name, digest))
    rootfs = found.files.get("rootfs.ext4") if found is not None else None
    return rootfs.sha256 if rootfs is not None else None


class BuiltinUsers(Protocol):
    """What on this host uses a built-in image's directory (``builtin_users``)."""

    def user(self, name: str, digest: str) -> str | None:
        """What uses ``<name>/<digest>/`` here (None: nothing). Blocking."""
        ...

    def held_off(self, name: str, digest: str) -> contextlib.AbstractAsyncContextManager[None]:
        """No pooled VM of that image for the block."""
        ...

    def retire_templates(self, name: str, digest: str) -> list[str]:
        """Remove its templates (blocking); their names."""
        ...


class BuiltinBlobs:
    """Built-in images in the blob store (see the module docstring)."""

    def __init__(
        self,
        store: BlobStore,
        records: ImageUploadStore,
        images_dir: Path,
        scratch: Path,
        *,
        host: str = "local",
        hosts: HostStore | None = None,
        retry_s: Sequence[float] = RETRY_S,
        resync_s: float = RESYNC_S,
        converge: bool = True,
    ) -> None:
        """``records``: the database's upload records; ``scratch``: where indexes are
        written and read (the state dir); ``host``: this host's id (its claims and its
        ``hosts`` row, where ``hosts`` publishes what it holds; None: nothing is);
        ``converge`` False (``HUTCH_BLOB_BUILTIN_IMAGES=0``): :meth:`start` neither
        uploads nor replaces anything (publication and fetches by digest stay)."""
        self.images_dir = images_dir
        self.host = host
        self.hosts = hosts
        self.converging = converge
        #: What uses a directory here (None: nothing is known to: a test).
        self.users: BuiltinUsers | None = None
        self.uploads: BackgroundUploads[str] = BackgroundUploads(
            "built-in image",
            self._attempt,
            lambda key: image_at(self._dir(*_split(key))) is not None,
            key=lambda key: key,
            log=log,
            task_prefix="hutch-builtin-",
            retry_s=retry_s,
        )
        self.prefixes = PrefixBlobs(
            store, records, images_dir, scratch, host, under=UNDER,
            closed=lambda: self.uploads.closed,
        )  # fmt: skip
        self._guards: dict[str, asyncio.Lock] = {}
        #: Per directory: why its adoption waits, as last logged (logged once).
        self._waiting: dict[str, str] = {}
        self._published: BuiltinIdentities | None = None
        #: Identities hashed here that could not be recorded beside their file.
        self._hashed: dict[Path, tuple[tuple[int, int], str]] = {}
        self._resync_s = resync_s
        self._resync_task: asyncio.Task[None] | None = None
        self._presence: int | None = None

    @classmethod
    def beside(
        cls, blobs: ImageBlobs, hosts: HostStore | None, *, converge: bool = True
    ) -> BuiltinBlobs | None:
        """Sharing the imported images' store, records and host (None without a store)."""
        if blobs.store is None or blobs.records is None:
            return None
        return cls(
            blobs.store, blobs.records, blobs.images_dir, blobs.scratch,
            host=blobs.host, hosts=hosts, converge=converge,
        )  # fmt: skip

    @property
    def store(self) -> BlobStore:
        return self.prefixes.store

    def _dir(self, name: str, digest: str) -> Path:
        return self.images_dir / name / digest

    def local(self) -> list[tuple[str, str]]:
        """(name, digest) of every complete built-in image directory here."""
        return [(n, d) for n in sorted(IMAGES) for d in built_digests(n, self.images_dir)]

    # -- start and close ----------------------------------------------------------------

    async def start(self) -> None:
        """Remove what a crash left, publish what this host holds, converge each
        directory on its upload (before the caller makes templates or a pool), then
        upload in the background what is not uploaded and check again every
        ``resync_s``. Failures are logged (the store or the database away: the
        resync tries again). Without ``converge``: the crash's leftovers and the
        publication only."""
        self.uploads.start()
        await asyncio.to_thread(self._open)
        local = await asyncio.to_thread(self.local)
        try:
            await asyncio.to_thread(self.publish)
        except HutchError as exc:
            log.warning("publishing this host's built-in images failed: %s", exc)
        if not self.converging:
            return
        for name, digest in local:
            try:
                await self.converge(name, digest)
            except (HutchError, OSError) as exc:
                log.warning("built-in image %s %s: not converged on its upload (again at "
                            "the next check): %s", name, digest, exc)  # fmt: skip
        for name, digest in local:
            self.uploads.schedule(_key(name, digest))
        self._resync_task = asyncio.create_task(self._resync_forever(), name="hutch-builtin-sync")

    def _open(self) -> None:
        """Take the presence lock (shared) and remove what a crash left."""
        self.discard_partial()
        if self._presence is None:
            self.images_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.images_dir / PRESENCE_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_SH)
            self._presence = fd

    async def close(self) -> None:
        if self._resync_task is not None:
            self._resync_task.cancel()
            await asyncio.gather(self._resync_task, return_exceptions=True)
        await self.uploads.close()
        if self._presence is not None:
            os.close(self._presence)
            self._presence = None

    def discard_partial(self) -> list[str]:
        """Remove the fetches (``.<digest>.fetch-*``) and old copies (``.<digest>.old-*``,
        putting one back where a crash left no copy) a crash left, for each image whose
        build lock and each digest whose lock is free. Blocking; the names removed."""
        removed: list[str] = []
        for name in sorted(IMAGES):
            root = self.images_dir / name
            if not root.is_dir():
                continue
            with try_file_lock(self.images_dir / f"{name}.lock") as no_build:
                if not no_build:
                    continue
                for entry in sorted(root.glob(".*")):
                    digest, sep, _ = entry.name[1:].partition(".")
                    if not sep or not _DIGEST.match(digest) or not entry.is_dir():
                        continue
                    with try_file_lock(root / f"{digest}.lock") as free:
                        if not free:
                            continue
                        if ".old-" in entry.name:
                            asides = restore_replaced(root / digest)
                            if entry not in asides:
                                continue  # put back as the copy
                        shutil.rmtree(entry, ignore_errors=True)
                        removed.append(f"{name}/{entry.name}")
        for what in removed:
            log.info("removed what an interrupted built-in image fetch left: %s", what)
        return removed

    async def _resync_forever(self) -> None:
        while not self.uploads.closed:
            await asyncio.sleep(self._resync_s)
            try:
                await self.resync()
            except (HutchError, OSError) as exc:  # the store or the database away
                log.warning("checking the built-in images' uploads failed (again in %.0f s): "
                            "%s", self._resync_s, exc)  # fmt: skip

    async def resync(self) -> list[str]:
        """Publish what this host holds if it changed; schedule each directory whose
        upload is not complete or whose copy differs from it (and is not under way);
        the keys (``name/digest``) scheduled."""
        await asyncio.to_thread(self.publish, changed_only=True)
        scheduled = []
        for name, digest in await asyncio.to_thread(self.local):
            key = _key(name, digest)
            if self.uploads.running(key):
                continue
            final = self._dir(name, digest)
            complete = await asyncio.to_thread(self.prefixes.complete, final)
            if complete and await asyncio.to_thread(self._differing_record, name, digest) is None:
                continue  # uploaded, and this host holds those bytes
            self.uploads.schedule(key)
            scheduled.append(key)
        return scheduled

    # -- upload -------------------------------------------------------------------------

    def _guard(self, key: str) -> asyncio.Lock:
        return self._guards.setdefault(key, asyncio.Lock())

    async def wait_uploaded(self, name: str, digest: str) -> None:
        """Until the upload (or convergence) of ``name`` at ``digest`` under way ended."""
        await self.uploads.wait(_key(name, digest))

    async def _attempt(self, key: str) -> None:
        """Upload the directory ``key`` names unless its upload is complete; converge
        on that upload when it is. ``Conflict`` while another host's claim holds it."""
        name, digest = _split(key)
        final = self._dir(name, digest)
        async with self._guard(key):
            if await asyncio.to_thread(self.prefixes.complete, final):
                await self._converge(name, digest)
                return
            started = time.monotonic()
            meta = {"name": name, "digest": digest}
            sent = await asyncio.to_thread(self.prefixes.upload, final, meta)
        if sent is not None:
            log.info("built-in image %s %s uploaded: %d bytes in %.1f s", name, digest, sent,
                     time.monotonic() - started)  # fmt: skip

    # -- one content per digest -----------------------------------------------------------

    async def converge(self, name: str, digest: str) -> bool:
        """Replace this host's copy of ``name`` at ``digest`` by its complete upload if
        they differ and nothing here uses the copy (see the module docstring); True if
        replaced. A copy in use is kept (logged once; False). ``BlobError`` /
        ``ImageMissing`` when the fetch fails: the copy is kept."""
        async with self._guard(_key(name, digest)):
            return await self._converge(name, digest)

    async def _converge(self, name: str, digest: str) -> bool:
        key = _key(name, digest)
        record = await asyncio.to_thread(self._differing_record, name, digest)
        if record is None:
            self._waiting.pop(key, None)
            return False
        why = await asyncio.to_thread(self._why_kept, name, digest)
        if why is not None:
            self._wait(key, why)
            return False
        started = time.monotonic()
        with contextlib.ExitStack() as stack:
            # The digest's lock across the fetch and the swap (a fetch on demand, or a
            # starting daemon's discard_partial, leaves this fetch alone).
            lock = file_lock(self._dir(name, digest).parent / f"{digest}.lock")
            await asyncio.to_thread(stack.enter_context, lock)
            staged = await asyncio.to_thread(self._stage, name, digest, record)
            stack.callback(shutil.rmtree, staged.path, True)  # not swapped in: it goes
            crash_point("adopt.staged")
            held = (
                self.users.held_off(name, digest)
                if self.users is not None
                else contextlib.nullcontext()
            )
            async with held:
                why = await asyncio.to_thread(self._swap, name, digest, staged)
        if why is not None:
            self._wait(key, why)
            return False
        self._waiting.pop(key, None)
        log.info("built-in image %s %s: this host's copy replaced by the upload in %s in "
                 "%.1f s (the same bytes on every host)", name, digest, self.store.url,
                 time.monotonic() - started)  # fmt: skip
        try:
            await asyncio.to_thread(self.publish)
        except HutchError as exc:
            log.warning("publishing this host's built-in images failed: %s", exc)
        return True

    def _differing_record(self, name: str, digest: str) -> UploadRecord | None:
        """The complete upload's record when this host's copy differs from it, else
        None (the same bytes, no complete upload, no copy). Blocking."""
        final = self._dir(name, digest)
        record = self.prefixes.record(final)
        if record is None or image_at(final) is None:
            return None
        if not differs_from_upload(final / "rootfs.ext4", record):
            return None
        return record if self.prefixes.complete(final) else None

    def _why_kept(self, name: str, digest: str) -> str | None:
        """Why the copy must stay now (None: it may be replaced). Blocking."""
        with self._free(name, digest) as why:
            return why

    @contextlib.contextmanager
    def _free(self, name: str, digest: str) -> Iterator[str | None]:
        """For the block: None with the copy free (no other hutchd shares the images
        directory, no build of the image, no create or frozen-state fetch holding it,
        nothing here using it) and kept so (the locks held), else why it is not.
        Blocking."""
        final = self._dir(name, digest)
        with (
            self._exclusive() as alone,
            try_file_lock(self.images_dir / f"{name}.lock") as no_build,
            unused_content(final) as free,
        ):
            if not alone:
                yield f"another hutchd sharing the images directory {self.images_dir}"
            elif not no_build:
                yield f"a build of {name} (hutch image build)"
            elif not free:
                yield "a create or a fetch of a frozen state"
            else:
                yield self.users.user(name, digest) if self.users is not None else None

    def _wait(self, key: str, why: str) -> None:
        if self._waiting.get(key) != why:
            log.info("built-in image %s: this host's copy holds other bytes than its upload "
                     "in %s; kept while %s uses it (tried again at the next check)", key,
                     self.store.url, why)  # fmt: skip
        self._waiting[key] = why

    def _stage(self, name: str, digest: str, record: UploadRecord, what: str = "") -> Staged:
        """The upload of ``<name>/<digest>/`` fetched beside it and checked (what
        ``record`` says, and ``check_builtin``); ``ImageMissing`` when its index is gone.
        ``what``: what it is fetched for, in messages."""
        named = f"built-in image {name!r} ({digest})"
        staged = self.prefixes.stage(
            self._dir(name, digest),
            f"{named}, which {what} was frozen over" if what else named,
            record,
            lambda d: check_builtin(d, name, digest),
        )
        if staged is None:
            raise ImageMissing(
                f"built-in image {name!r} ({digest}): its upload to {self.store.url} is "
                "no longer complete; this host keeps what it has"
            )
        return staged

    def _swap(self, name: str, digest: str, staged: Staged) -> str | None:
        """Exchange ``staged`` in for the copy if it is free now (the checks of
        :meth:`_free` made again, under its locks); why not, else None. Blocking."""
        final = self._dir(name, digest)
        with self._free(name, digest) as why:
            if why is not None:
                return why
            if self.users is not None:
                for template in self.users.retire_templates(name, digest):
                    log.info("template %s retired: its image's bytes are replaced", template)
            crash_point("adopt.retired")
            old = replace_dir(staged.path, final)
            crash_point("adopt.swapped")
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return None

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[bool]:
        """The presence lock held exclusively for the block (True: no other hutchd
        shares the images directory), or not (False). Blocking."""
        if self._presence is None:
            self._open()
        fd = self._presence
        assert fd is not None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # A failed conversion may have dropped the shared lock: take it again.
            fcntl.flock(fd, fcntl.LOCK_SH)
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_SH)

    # -- fetch on demand ------------------------------------------------------------------

    def hold(self, path: Path, what: str) -> contextlib.AbstractContextManager[None]:
        """``blob_dirs.BaseImages``: ``path`` a built-in image's rootfs (else nothing to
        do): its directory fetched first if this host lacks it and the store has its
        complete recorded upload, then held from an adoption for the block. Blocking;
        ``BlobError`` when the fetch fails (nothing of it kept)."""
        found = builtin_of(path, self.images_dir)
        if found is None:
            return contextlib.nullcontext()
        name, digest = found
        final = self._dir(name, digest)
        if image_at(final) is None:
            self.fetch(name, digest, what)
        # Held from this daemon's adoptions (another daemon's wait for the presence lock).
        return using_content(final) if self.converging else contextlib.nullcontext()

    def fetch(self, name: str, digest: str, what: str) -> bool:
        """Fetch ``<name>/<digest>/`` into place, verified (``<name>/current`` stays);
        True if fetched, False when it is here already or the store has no complete
        recorded upload of it. Blocking; ``BlobError`` when the store fails or a blob
        fails its check (nothing kept)."""
        final = self._dir(name, digest)
        with file_lock(final.parent / f"{digest}.lock"):
            if image_at(final) is not None:
                return False
            record = self.prefixes.record(final)
            if record is None:
                return False
            started = time.monotonic()
            try:
                staged = self._stage(name, digest, record, what)
            except ImageMissing:
                return False  # not complete: the check that follows refuses it
            self.prefixes.install(staged, final)
        log.info("built-in image %s %s fetched from %s in %.1f s (for %s)", name, digest,
                 self.store.url, time.monotonic() - started, what)  # fmt: skip
        try:
            self.publish()
        except HutchError as exc:
            log.warning("publishing this host's built-in images failed: %s", exc)
        return True

    # -- publication ----------------------------------------------------------------------

    def identities(self) -> BuiltinIdentities:
        """name -> digest -> rootfs sha256 of every built-in image here. Blocking (a
        rootfs without a recorded identity is hashed once: where the images directory
        cannot be written, the hash is kept here, by the file's size and mtime)."""
        found: BuiltinIdentities = {}
        for name, digest in self.local():
            with contextlib.suppress(OSError):  # removed meanwhile
                rootfs = self._dir(name, digest) / "rootfs.ext4"
                st = rootfs.stat()
                stamp = (st.st_size, st.st_mtime_ns)
                cached = self._hashed.get(rootfs)
                sha = identity.known(rootfs)
                if sha is None and cached is not None and cached[0] == stamp:
                    sha = cached[1]
                if sha is None:
                    sha = identity.identity(rootfs)
                    self._hashed[rootfs] = (stamp, sha)
                found.setdefault(name, {})[digest] = sha
        return found

    def publish(self, *, changed_only: bool = False) -> BuiltinIdentities:
        """Write what this host holds into its ``hosts`` row (placement reads it);
        with ``changed_only``, only if it changed since the last time. Blocking."""
        held = self.identities()
        if self.hosts is not None and not (changed_only and held == self._published):
            self.hosts.set_images(self.host, held)
            self._published = held
        return held


def _key(name: str, digest: str) -> str:
    return f"{name}/{digest}"


def _split(key: str) -> tuple[str, str]:
    name, _, digest = key.partition("/")
    return name, digest
