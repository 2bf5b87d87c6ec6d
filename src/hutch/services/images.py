"""Which guest images this host can start sandboxes from: hutch's own (built from
Debian packages, ``hutch image build``), which every project sees, and the images a
project imported or built (``POST /v1/images``: records in the store, content in the
images directory), which only that project sees and boots. A name is looked up in the
caller's project: two projects may each have an image of the same name, and a built-in
name cannot be taken by any.

With a blob store (``HUTCH_BLOB_URL``) an imported image's content is uploaded by
digest and a host without it fetches it before first use
(:meth:`HostImages.ensure_local`, :mod:`hutch.services.image_blobs`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hutch.errors import Conflict, UnknownImage
from hutch.images.build import ImageArtifacts, find_image, list_images
from hutch.images.cache import short_digest
from hutch.images.catalog import IMAGES
from hutch.images.oci.boot import BootSet, find_boot_set
from hutch.images.oci.importer import content_dir, find_content
from hutch.services.blob_cache import touch_content, using_content
from hutch.services.image_blobs import ImageBlobs
from hutch.store.images import ImageRow, ImageStore


@dataclass(frozen=True)
class ImageView:
    name: str
    description: str
    built: bool
    digest: str | None
    size_bytes: int | None
    kernel_release: str | None
    #: Where it came from: {"type": "builtin"} | {"type": "registry", "ref", "digest"} |
    #: {"type": "archive", "format", "filename", "digest"}.
    source: dict[str, Any] = field(default_factory=lambda: {"type": "builtin"})
    #: The image config's defaults (imported images): env, working_dir, user,
    #: entrypoint, cmd, exposed_ports.
    config: dict[str, Any] | None = None
    start: bool = False
    created_at: float | None = None
    #: The project it belongs to (None: a built-in image, every project's).
    project: str | None = None


@dataclass(frozen=True)
class ImageDefaults:
    """What a sandbox takes from its image: exec environment, working directory and
    user, and the start command run at boot (opted in per image)."""

    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None
    start_command: tuple[str, ...] = ()

    @classmethod
    def of(cls, row: ImageRow) -> ImageDefaults:
        cfg = row.config
        start = (*cfg.get("entrypoint", ()), *cfg.get("cmd", ())) if row.start else ()
        return cls(
            env=dict(cfg.get("env") or {}),
            cwd=cfg.get("working_dir") or None,
            user=cfg.get("user") or None,
            start_command=tuple(start),
        )


NO_DEFAULTS = ImageDefaults()
#: Names of the step layers a Dockerfile build boots (no image name may start with ".").
EPHEMERAL_PREFIX = ".build-"


class ImageSource(Protocol):
    """Images by name in a project (built-ins are in every project); ``list`` with
    ``project`` None lists every project's (the admin's view)."""

    def find(self, name: str, project: str) -> ImageArtifacts | None: ...

    def names(self, project: str) -> list[str]: ...

    def list(self, project: str | None) -> list[ImageView]: ...

    def defaults(self, name: str, project: str) -> ImageDefaults: ...

    async def ensure_local(self, name: str, project: str) -> None:
        """Make the content of image ``name`` present on this host when it can be
        fetched (a no-op where there is nothing to fetch: :func:`resolve` then says
        what is missing)."""
        ...

    def using(self, name: str, project: str) -> contextlib.AbstractContextManager[None]:
        """Keep image ``name``'s files on this host for the block (a create from it:
        from before :meth:`ensure_local` until its row names the image)."""
        ...


class LocalImages:
    """Images built on this host under ``images_dir`` (see ``hutch image build``)."""

    def __init__(self, images_dir: Path) -> None:
        self.images_dir = images_dir

    def find(self, name: str, project: str = "") -> ImageArtifacts | None:
        return find_image(name, self.images_dir)

    def names(self, project: str = "") -> list[str]:
        return sorted(IMAGES)

    def defaults(self, name: str, project: str = "") -> ImageDefaults:
        del name
        return NO_DEFAULTS

    async def ensure_local(self, name: str, project: str = "") -> None:
        """Built-in images are built on each host (``hutch image build``)."""
        del name, project

    def using(self, name: str, project: str = "") -> contextlib.AbstractContextManager[None]:
        """Built-in images are never evicted."""
        del name, project
        return contextlib.nullcontext()

    def list(self, project: str | None = None) -> list[ImageView]:
        views = []
        for info in list_images(self.images_dir):
            built = find_image(info.name, self.images_dir) if info.built else None
            views.append(
                ImageView(
                    name=info.name,
                    description=info.description,
                    built=built is not None,
                    digest=info.digest,
                    size_bytes=info.size_bytes,
                    kernel_release=built.kernel_release if built else None,
                )
            )
        return views


class BootSets(Protocol):
    """Where imported images get their kernel, initramfs and agent runtime."""

    def find(self) -> BootSet | None: ...

    def prepare(self) -> BootSet: ...


class LocalBootSets:
    def __init__(self, images_dir: Path) -> None:
        self.images_dir = images_dir

    def find(self) -> BootSet | None:
        return find_boot_set(self.images_dir)

    def prepare(self) -> BootSet:
        from hutch.images.oci.boot import prepare_boot_set

        return prepare_boot_set(self.images_dir)


def oci_artifacts(row: ImageRow, rootfs: Path, size_bytes: int, boot: BootSet) -> ImageArtifacts:
    """What the VM layer boots for an imported image. ``digest`` covers the content and
    the boot set: templates of one do not serve the other."""
    return ImageArtifacts(
        name=row.name,
        digest=short_digest("oci-image-v1", row.digest, boot.key),
        kernel=boot.kernel,
        initrd=boot.initrd,
        rootfs=rootfs,
        kernel_release=boot.kernel_release,
        cmdline=boot.cmdline,
        size_bytes=size_bytes,
        runtime_disk=boot.runtime,
    )


class HostImages:
    """hutch's own images (``builtin``) and the images imported into this daemon's
    store (global today; per project once projects exist)."""

    def __init__(
        self,
        builtin: ImageSource,
        store: ImageStore,
        images_dir: Path,
        boot: BootSets,
        blobs: ImageBlobs | None = None,
    ) -> None:
        """``blobs``: where imported content is uploaded and fetched (None or without
        a store: it stays on the host that imported it)."""
        self.builtin = builtin
        self.store = store
        self.images_dir = images_dir
        self.boot = boot
        self.blobs = blobs if blobs is not None else ImageBlobs(None, images_dir, images_dir)
        # Step layers of Dockerfile builds a build sandbox boots from: found, not listed.
        self._ephemeral: dict[str, ImageArtifacts] = {}
        #: A built-in image's directory may be replaced by the blob store's bytes here
        #: (``builtin_blobs``, set where the services are composed): a create holds it.
        self.hold_builtins = False

    def add_ephemeral(self, image: ImageArtifacts) -> None:
        """Let a sandbox be created from ``image`` (``ephemeral``, named ``.build-*``)
        until :meth:`drop_ephemeral`; it is never listed."""
        assert image.ephemeral and image.name.startswith(EPHEMERAL_PREFIX), image.name
        self._ephemeral[image.name] = image

    def drop_ephemeral(self, name: str) -> None:
        self._ephemeral.pop(name, None)

    def find(self, name: str, project: str) -> ImageArtifacts | None:
        if name.startswith(EPHEMERAL_PREFIX):
            return self._ephemeral.get(name)
        if name in self.builtin.names(project):
            return self.builtin.find(name, project)
        row = self.store.get(name, project)
        if row is None:
            return None
        return self.artifacts(row)

    def artifacts(self, row: ImageRow) -> ImageArtifacts | None:
        """What ``row`` boots, if its content and the boot set are on this host."""
        content = find_content(self.images_dir, row.digest)
        boot = self.boot.find()
        if content is None or boot is None:
            return None
        return oci_artifacts(row, content.rootfs, content.size_bytes, boot)

    def names(self, project: str) -> list[str]:
        return sorted({*self.builtin.names(project), *(r.name for r in self.store.list(project))})

    async def ensure_local(self, name: str, project: str) -> None:
        """With a blob store: fetch ``project``'s image ``name`` when its content (or
        the boot set imported images boot with) is not on this host, verified against
        its digest before anything uses it. ``ImageMissing`` when it is in the store
        neither; ``BlobError`` when the store fails or a blob fails its check. A
        built-in, a build step's layer or an unknown name: nothing to do here."""
        if not self.blobs.enabled or name.startswith(EPHEMERAL_PREFIX):
            return
        row = self.row(name, project)
        if row is None:
            return
        need_boot = self.boot.find() is None
        if not need_boot and find_content(self.images_dir, row.digest) is not None:
            touch_content(content_dir(self.images_dir, row.digest))  # the cache's LRU
            return
        await self.blobs.ensure(row.digest, f"image {name!r}", boot=need_boot)

    def using(self, name: str, project: str) -> contextlib.AbstractContextManager[None]:
        """Keep ``project``'s image ``name``'s content from the blob cache's eviction
        for the block (:func:`hutch.services.blob_cache.using_content`), or a built-in
        image's directory from its replacement by the blob store's bytes
        (``builtin_blobs``); a build step's layer or an unknown name: nothing to keep."""
        if not self.blobs.enabled or name.startswith(EPHEMERAL_PREFIX):
            return contextlib.nullcontext()
        if name in self.builtin.names(project):
            built = self.builtin.find(name, project) if self.hold_builtins else None
            return using_content(built.rootfs.parent) if built else contextlib.nullcontext()
        row = self.row(name, project)
        if row is None:
            return contextlib.nullcontext()
        return using_content(content_dir(self.images_dir, row.digest))

    def defaults(self, name: str, project: str) -> ImageDefaults:
        row = self.row(name, project)
        return ImageDefaults.of(row) if row is not None else NO_DEFAULTS

    def row(self, name: str, project: str) -> ImageRow | None:
        """The project's image ``name`` (None: a built-in, or none)."""
        return None if name in self.builtin.names(project) else self.store.get(name, project)

    def view(self, row: ImageRow) -> ImageView:
        arts = self.artifacts(row)
        return ImageView(
            name=row.name,
            description=_describe(row.source),
            built=arts is not None,
            digest=row.digest,
            size_bytes=row.size_bytes,
            kernel_release=arts.kernel_release if arts else None,
            source={**row.source, "digest": row.digest},
            config=row.config,
            start=row.start,
            created_at=row.created_at,
            project=row.project,
        )

    def list(self, project: str | None) -> list[ImageView]:
        """The built-ins and ``project``'s images (None: every project's)."""
        rows = self.store.list(project) if project is not None else self.store.list_all()
        return [*self.builtin.list(project), *(self.view(r) for r in rows)]


def _describe(source: dict[str, Any]) -> str:
    if source.get("type") == "registry":
        return f"pulled from {source.get('ref')}"
    if source.get("type") == "dockerfile":
        return f"built from {source.get('dockerfile')} (FROM {source.get('base')})"
    fmt = source.get("format", "archive")
    filename = source.get("filename")
    return f"imported from {fmt}" + (f" {filename}" if filename else "")


def resolve(images: ImageSource, name: str, project: str) -> ImageArtifacts:
    """The built image ``name`` of ``project`` (or a built-in), or an error saying how to
    get it. Another project's image is unknown here, exactly as a missing one."""
    if name.startswith(EPHEMERAL_PREFIX):
        found = images.find(name, project)
        if found is not None:
            return found
    names = images.names(project)
    if name not in names:
        raise UnknownImage(f"unknown image {name!r}; available: {', '.join(names)}")
    image = images.find(name, project)
    if image is None:
        if name in IMAGES:
            raise Conflict(
                f"image {name!r} is not built on this host; run `hutch image build {name}`"
            )
        raise Conflict(
            f"image {name!r} is imported but its files are missing on this host (its "
            "content or hutch's boot files for imported images); import it again"
        )
    return image
