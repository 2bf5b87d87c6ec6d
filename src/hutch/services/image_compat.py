"""Which hosts can open a frozen VM state of a built-in image (issue 14), for placement:
pure functions over ``hosts`` rows (:func:`compatible_image`, :func:`frozen_identity`).

A pause, a fork parent or a named snapshot of a sandbox of ``base`` or ``devbox`` opens
only over the rootfs bytes it was frozen over (``blob_dirs``: ``ImageMismatch``, 409
``image_mismatch``). Each host publishes the built-in images it holds
(``hosts.images_json``, :attr:`HostRow.images`: name -> digest -> rootfs sha256,
written by ``builtin_blobs`` at its start and after an adoption or a fetch), so that a
move, a fork child or a create from a snapshot is placed only where it will open::

    source = hosts.get(rec.host)                     # where the state is frozen now
    sha = frozen_identity(source, rec.image, rec.image_digest)
    uploaded = uploaded_identity(records, rec.image, rec.image_digest)  # builtin_blobs
    ok = [h for h in candidates
          if compatible_image(h, rec.image, rec.image_digest, sha, uploaded=uploaded)]

The source host's published identity is the frozen state's: a host never replaces a
copy that a sandbox, fork or snapshot on it still uses (``builtin_users``).
"""

from __future__ import annotations

from hutch.images.catalog import IMAGES
from hutch.store.hosts import HostRow

__all__ = ["compatible_image", "frozen_identity", "image_identity"]


def image_identity(host: HostRow, name: str, digest: str | None) -> str | None:
    """The rootfs sha256 of the built-in image ``name`` at ``digest`` that ``host``
    published (None: it holds none, or published nothing)."""
    if digest is None:
        return None
    return host.images.get(name, {}).get(digest)


def frozen_identity(source: HostRow, name: str, digest: str | None) -> str | None:
    """The bytes a frozen state of image ``name`` at ``digest`` on host ``source`` was
    taken over: the source's copy (None: not a built-in image, or not published)."""
    return image_identity(source, name, digest) if name in IMAGES else None


def compatible_image(
    host: HostRow,
    name: str,
    digest: str | None,
    sha256: str | None,
    *,
    uploaded: str | None,
) -> bool:
    """``host`` can open a frozen state of image ``name`` at ``digest`` taken over the
    rootfs bytes ``sha256``: it holds that digest with those bytes, or it lacks that
    digest and the blob store's complete upload of it (``uploaded``: its rootfs sha256
    recorded in the database, None: none) is those bytes, which it then fetches. True
    when there is nothing to compare (not a built-in image: imported images converge
    through the blob store on their own; no digest or ``sha256`` known): the arrival's
    own check (``ImageMismatch``) still guards. A host that published nothing yet
    holds nothing as far as placement knows."""
    if name not in IMAGES or digest is None or sha256 is None:
        return True
    held = image_identity(host, name, digest)
    if held is not None:
        return held == sha256
    return uploaded == sha256
