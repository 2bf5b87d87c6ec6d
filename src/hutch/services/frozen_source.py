"""The frozen VM state a paused sandbox or a fork's parent restores from, as placement
needs it (:class:`~hutch.services.placement.Frozen`): the host that froze it (its QEMU
build and CPU model) and, for a built-in image, the rootfs bytes it was frozen over and
those of the blob store's upload of that digest (``image_compat``)."""

from __future__ import annotations

from hutch.models import SandboxRecord
from hutch.services.builtin_blobs import uploaded_identity
from hutch.services.image_compat import frozen_identity
from hutch.services.placement import Frozen
from hutch.store.hosts import HostStore
from hutch.store.image_uploads import ImageUploadStore

__all__ = ["frozen_sandbox"]


def frozen_sandbox(
    hosts: HostStore,
    uploads: ImageUploadStore,
    rec: SandboxRecord,
    host: str,
    what: str,
    *,
    anywhere: bool = True,
) -> Frozen:
    """``rec`` frozen on ``host`` (a pause, a fork's parent, or a named snapshot of it),
    its files in the blob store (``anywhere``: any compatible host may fetch them; else
    only ``host`` holds them). Two row reads, no store request."""
    source = hosts.get(host)
    digest = rec.image_digest
    sha = frozen_identity(source, rec.image, digest) if source is not None else None
    uploaded = uploaded_identity(uploads, rec.image, digest) if sha and digest else None
    return Frozen(host, anywhere, what, rec.image, digest, sha, uploaded)
