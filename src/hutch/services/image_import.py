"""Importing images (an uploaded archive or a pull from a registry) and deleting them.

The work runs in a worker thread (it is disk- and network-bound), reporting progress
through a callback that the REST layer turns into NDJSON. A name is reserved while its
import runs, so two imports of one name cannot race. An import either ends with a row
in the store and a complete content directory, or leaves neither (the content may stay
cached if another image uses it).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import logging
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hutch.config import Settings
from hutch.contract.auth import DEFAULT_PROJECT
from hutch.errors import Conflict, HutchError, ImageBuildError, InvalidArgument, NotFound
from hutch.images.catalog import IMAGES
from hutch.images.oci.archives import open_archive
from hutch.images.oci.auth import Credentials
from hutch.images.oci.compression import sniff
from hutch.images.oci.importer import (
    ImportProgress,
    OciContent,
    add_ref,
    build_content,
    content_dir,
    discard_partial,
    drop_ref,
    resolve,
)
from hutch.images.oci.ref import parse_ref
from hutch.images.oci.registry import RegistryClient, RegistrySource
from hutch.services.images import HostImages, ImageView
from hutch.services.registry import SandboxRegistry
from hutch.services.template_blobs import TemplateBlobs
from hutch.store.db import LIVE_STATES
from hutch.store.images import ImageRow

__all__ = [
    "IMAGE_NAME_RE",
    "Credentials",
    "ImageImporter",
    "ImportProgress",
    "Progress",
    "plain_archive",
    "remove_spool",
]

log = logging.getLogger(__name__)

IMAGE_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")

Progress = Callable[[ImportProgress], None]

_CHUNK = 1 << 20


def check_name(name: str) -> str:
    if not isinstance(name, str) or not IMAGE_NAME_RE.match(name):
        raise InvalidArgument(
            f"image name {name!r} is not valid; use 1-32 lowercase letters, digits and '-', "
            "starting with a letter or digit"
        )
    if name in IMAGES:
        raise Conflict(f"{name!r} is a built-in image; pick another name for an import")
    return name


class ImageImporter:
    def __init__(
        self,
        settings: Settings,
        images: HostImages,
        core: SandboxRegistry,
        template_blobs: TemplateBlobs | None = None,
    ) -> None:
        """``core``: the sandboxes' registry (for the images' users);
        ``template_blobs``: where the templates of an image whose last row goes are
        removed from the blob store (None: none are uploaded)."""
        self.settings = settings
        self.images = images
        self.core = core
        self.template_blobs = template_blobs
        self._busy: set[tuple[str, str]] = set()  # (project, name)
        self._busy_lock = threading.Lock()
        # Records in this daemon's store that use a content directory, by file name
        # under refs/: the images dir may be shared with other daemons.
        self._ref_prefix = hashlib.sha256(str(settings.state_dir.resolve()).encode()).hexdigest()[
            :16
        ]

    @property
    def spool_dir(self) -> Path:
        return self.settings.state_dir / "imports"

    def start(self) -> None:
        """Remove what a daemon killed mid-import left (spooled uploads, work dirs),
        and, when there are imported images, bring the boot set (kernel, initramfs,
        agent runtime) up to this hutch's in the background: until then new sandboxes
        boot the one they had, which still works."""
        shutil.rmtree(self.spool_dir, ignore_errors=True)
        for name in discard_partial(self.images.images_dir):
            log.info("removed what an interrupted image import or fetch left: %s", name)
        rows = self.images.store.list_all()
        if rows:
            threading.Thread(target=self._refresh_boot, name="hutch-oci-boot", daemon=True).start()
        # Uploads to the blob store a stopped daemon left (or never began) continue.
        blobs = self.images.blobs
        blobs.on_uploaded = self._uploaded
        blobs.start(lambda: [r.digest for r in self.images.store.list_all()])

    async def close(self) -> None:
        """Stop the uploads under way (an S3 upload resumes at the next start)."""
        await self.images.blobs.close()

    def _uploaded(self, type: str, data: dict[str, Any]) -> None:
        with contextlib.suppress(HutchError):
            self.core.events.record(type, project=DEFAULT_PROJECT, sandbox_id=None, data=data)

    def _refresh_boot(self) -> None:
        try:
            boot = self.images.boot.prepare()
            log.info("boot set for imported images: %s", boot.key)
        except HutchError as exc:
            log.warning("could not refresh the boot set for imported images: %s", exc)

    def new_spool(self) -> Path:
        self.spool_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        return self.spool_dir / f"{uuid.uuid4().hex}.tar"

    @contextlib.contextmanager
    def reserve(self, name: str, project: str, what: str = "import") -> Any:
        """Hold ``name`` in ``project`` for one import (or build). Runs with the work (an
        import's worker thread), so a caller that goes away (a cancelled request) never
        frees the name while its import still runs. A built-in name is refused."""
        check_name(name)
        if os.geteuid() != 0:
            raise Conflict(
                f"image {what}s need hutchd to run as root: layers carry file owners, "
                "setuid bits and device nodes that only root can create"
            )
        if name in IMAGES:
            raise Conflict(f"{name!r} is a built-in image; pick another name")
        held = (project, name)
        with self._busy_lock:
            if held in self._busy:
                raise Conflict(f"an import or build of image {name!r} is already running")
            existing = self.images.store.get(name, project)
            if existing is not None:
                raise Conflict(
                    f"an image named {name!r} already exists ({existing.digest}); delete it "
                    "first (DELETE /v1/images/{name}) or pick another name"
                )
            self._busy.add(held)
        try:
            yield
        finally:
            with self._busy_lock:
                self._busy.discard(held)

    async def import_archive(
        self,
        name: str,
        archive: Path,
        *,
        filename: str | None = None,
        start: bool = False,
        progress: Progress | None = None,
        project: str = DEFAULT_PROJECT,
    ) -> ImageView:
        """Import the archive file at ``archive`` (removed afterwards, whatever happens)
        as ``project``'s image ``name``."""

        def work() -> ImageView:
            try:
                with self.reserve(name, project):
                    return self._import_archive(name, archive, filename, start, progress, project)
            finally:
                remove_spool(archive)

        return await asyncio.to_thread(work)

    async def pull(
        self,
        name: str,
        ref: str,
        *,
        credentials: Credentials | None = None,
        start: bool = False,
        progress: Progress | None = None,
        project: str = DEFAULT_PROJECT,
    ) -> ImageView:
        parsed = parse_ref(ref)

        def work() -> ImageView:
            with self.reserve(name, project):
                return self._pull(
                    name, parsed, credentials or Credentials(), start, progress, project
                )

        return await asyncio.to_thread(work)

    # -- the blocking work (worker thread) ----------------------------------------------

    def _import_archive(
        self,
        name: str,
        archive: Path,
        filename: str | None,
        start: bool,
        progress: Progress | None,
        project: str,
    ) -> ImageView:
        report = progress or (lambda _: None)
        report(ImportProgress("resolving", f"reading archive {filename or archive.name}"))
        plain = plain_archive(archive, self.settings.max_image_bytes)
        with open_archive(plain, filename) as source:
            what = f"archive {filename or 'upload'}"
            resolved = resolve(source, what)
            return self._finish(name, source, resolved, what, start, report, project)

    def _pull(
        self,
        name: str,
        ref: Any,
        credentials: Credentials,
        start: bool,
        progress: Progress | None,
        project: str,
    ) -> ImageView:
        report = progress or (lambda _: None)
        report(ImportProgress("resolving", f"resolving {ref}"))
        client = RegistryClient(ref, credentials)
        try:
            source = RegistrySource(client)
            resolved = resolve(source, str(ref))
            return self._finish(name, source, resolved, str(ref), start, report, project)
        finally:
            client.close()

    def _finish(
        self,
        name: str,
        source: Any,
        resolved: Any,
        what: str,
        start: bool,
        report: Callable[[ImportProgress], None],
        project: str,
    ) -> ImageView:
        try:
            content = build_content(
                source,
                resolved,
                self.images.images_dir,
                what=what,
                progress=report,
                max_bytes=self.settings.max_image_bytes,
            )
            report(ImportProgress("boot", "preparing hutch's kernel and agent runtime"))
            self.images.boot.prepare()
        except HutchError:
            raise
        except OSError as exc:
            raise ImageBuildError(f"importing {what}: {exc}") from exc
        view = self.record(name, content, source.describe(), start, project)
        report(ImportProgress("done", f"image {name} is {content.digest}"))
        return view

    def record(
        self,
        name: str,
        content: OciContent,
        source: dict[str, Any],
        start: bool,
        project: str = DEFAULT_PROJECT,
    ) -> ImageView:
        """List ``content`` as ``project``'s image ``name`` (held with :meth:`reserve`):
        the content is referenced, then the row inserted (a failed insert drops the
        reference)."""
        ref = self._ref(name, project)
        add_ref(content, ref)
        row = ImageRow(
            name=name,
            digest=content.digest,
            source=source,
            config=content.config.to_dict(),
            start=start,
            size_bytes=content.size_bytes,
            created_at=time.time(),
            project=project,
        )
        try:
            self.images.store.insert(row)
        except BaseException:
            drop_ref(content.path, ref)
            raise
        # Any host may run it once its upload completes (with HUTCH_BLOB_URL).
        self.images.blobs.schedule(content.digest)
        return self.images.view(row)

    def _ref(self, name: str, project: str) -> str:
        """The reference file of an image record. ``default``'s are named as before
        projects had images (their refs on disk stay valid); another project's carry
        its name after an ``@``, which neither names nor projects contain."""
        if project == DEFAULT_PROJECT:
            return f"{self._ref_prefix}-{name}"
        return f"{self._ref_prefix}-{project}@{name}"

    def ref_name(self, what: str) -> str:
        """This daemon's name for a reference on content (``refs/<name>``) held by
        something other than an image record (the build cache)."""
        return f"{self._ref_prefix}-{what}"

    # -- delete ----------------------------------------------------------------------------

    def users(self, name: str, project: str) -> tuple[list[str], list[str]]:
        """(live sandboxes, named snapshots) of ``project`` made from its image ``name``."""
        store = self.core.store
        sandboxes = [
            r.id
            for r in store.list_sandboxes(states=LIVE_STATES, project=project)
            if r.image == name
        ]
        snapshots = [s.id for s in store.list_snapshots(project=project) if s.image == name]
        return sandboxes, snapshots

    async def delete(self, name: str, project: str = DEFAULT_PROJECT) -> None:
        """Delete ``project``'s image ``name`` (another project's is not found)."""
        if name in IMAGES:
            raise Conflict(f"{name!r} is a built-in image; built-in images cannot be deleted")
        row = self.images.store.get(name, project)
        if row is None:
            raise NotFound(f"no image called {name!r}")
        if (project, name) in self._busy:
            raise Conflict(f"image {name!r} is being imported or built")
        # Under the create gate: no create can insert a sandbox of it meanwhile.
        async with self.core.create_gate:
            sandboxes, snapshots = self.users(name, project)
            if sandboxes or snapshots:
                parts = []
                if sandboxes:
                    parts.append(f"sandboxes {', '.join(sandboxes)}")
                if snapshots:
                    parts.append(f"snapshots {', '.join(snapshots)}")
                raise Conflict(
                    f"image {name!r} is in use by {' and '.join(parts)}; delete them first"
                )
            self.images.store.delete(name, project)
        removed = await asyncio.to_thread(
            drop_ref, content_dir(self.images.images_dir, row.digest), self._ref(name, project)
        )
        if self.images.blobs.enabled:
            # No image of any project names the content now: its blobs go too.
            try:
                await self.images.blobs.delete_unused(
                    row.digest, lambda: not self.images.store.uses(row.digest)
                )
            except HutchError as exc:
                log.warning("image %s: its blobs (%s) were not all removed: %s",
                            name, row.digest, exc)  # fmt: skip
        await asyncio.to_thread(self.core.backend.templates.remove, name)
        if self.template_blobs is not None and not self.images.store.uses(row.digest):
            # Built on this content, by any host: no row names it any more.
            content = content_dir(self.images.images_dir, row.digest)
            rel = content.relative_to(self.images.images_dir).as_posix()
            try:
                await self.template_blobs.delete_content(rel)
            except HutchError as exc:
                log.warning("image %s: its templates in the blob store were not all "
                            "removed: %s", name, exc)  # fmt: skip
        log.info("deleted image %s (%s; content %s)", name, row.digest,
                 "removed" if removed else "kept: other images use it")  # fmt: skip


def remove_spool(archive: Path) -> None:
    archive.unlink(missing_ok=True)
    archive.with_suffix(".plain").unlink(missing_ok=True)


def plain_archive(path: Path, limit: int) -> Path:
    """``path`` itself, or a decompressed copy beside it for a gzip or zstd archive
    (``docker save | gzip``): tar members are read by seeking."""
    with path.open("rb") as f:
        kind = sniff(f.read(4))
    if kind == "none":
        return path
    out = path.with_suffix(".plain")
    written = 0
    try:
        with out.open("wb") as dst:
            if kind == "gzip":
                with gzip.open(path, "rb") as src:
                    while chunk := src.read(_CHUNK):
                        written += len(chunk)
                        if written > limit:
                            raise InvalidArgument(
                                f"the archive unpacks to more than {limit} bytes "
                                "(HUTCH_MAX_IMAGE_BYTES)"
                            )
                        dst.write(chunk)
            else:
                proc = subprocess.run(
                    ["zstd", "-d", "-c", "-q", str(path)], stdout=dst, stderr=subprocess.PIPE,
                    check=False,
                )  # fmt: skip
                if proc.returncode != 0:
                    raise InvalidArgument(
                        "the archive is not valid zstd data: "
                        + proc.stderr.decode(errors="replace")[-300:]
                    )
    except (OSError, EOFError) as exc:
        out.unlink(missing_ok=True)
        if isinstance(exc, EOFError | gzip.BadGzipFile):
            raise InvalidArgument(f"the archive is not valid gzip data: {exc}") from exc
        raise
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out
