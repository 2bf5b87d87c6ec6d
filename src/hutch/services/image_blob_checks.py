"""What a directory fetched from the blob store must be before it is renamed into the
images directory: the checks of meaning that follow the byte checks against the
uploader's record (``storage/blobs/flat.py`` verifies every file's size and sha256 as it
is written; these verify that the files are the image they are fetched as).

- :func:`check_content`: an imported image's content (``oci/sha256-<hex>/``): its
  ``manifest.json`` hashes to the digest, ``image.json`` names it and the config.
- :func:`check_boot`: a boot set (``oci-boot/<key>/``) names its own key.
- :func:`check_builtin`: a built-in image's directory (``<name>/<digest>/``): its
  ``manifest.json`` names that image and digest, and the rootfs it declares.

Each raises ``BlobError`` saying what was wrong; the caller removes the staging
directory then (nothing of a refused fetch is kept).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

from hutch.errors import BlobError
from hutch.images import identity
from hutch.images.build import image_at
from hutch.images.oci.boot import load_boot_set
from hutch.images.oci.digest import digest_of
from hutch.images.oci.importer import load_content

__all__ = [
    "BOOT_FILES",
    "BUILTIN_FILES",
    "CONTENT_FILES",
    "SPARSE",
    "check_boot",
    "check_builtin",
    "check_content",
    "dig_holes",
]

#: What a content directory must hold to be fetched (``refs/`` is each host's own).
CONTENT_FILES = frozenset({"rootfs.ext4", "manifest.json", "config.json", "image.json"})
BOOT_FILES = frozenset({"vmlinux", "initrd.img", "runtime.ext4", "boot.json"})
#: What a built-in image's directory holds (``hutch.images.build``).
BUILTIN_FILES = frozenset({"rootfs.ext4", "vmlinux", "initrd.img", "manifest.json"})
#: Sparse disk images: holes are punched back into the zeros a download wrote.
SPARSE = frozenset({"rootfs.ext4", "runtime.ext4"})


def check_content(staging: Path, digest: str, what: str) -> None:
    """The fetched files are the content ``digest``: ``manifest.json`` hashes to it,
    ``image.json`` names it and the config the manifest names, which is the
    ``config.json`` fetched; and it loads as complete content."""

    def refuse(why: str) -> BlobError:
        return BlobError(f"{what} ({digest}): the fetched content {why}; it is not used")

    names = {f.name for f in staging.iterdir()}
    if not names >= CONTENT_FILES:
        raise refuse(f"lacks {', '.join(sorted(CONTENT_FILES - names))}")
    manifest = (staging / "manifest.json").read_bytes()
    if (got := digest_of(manifest)) != digest:
        raise refuse(f"has a manifest.json of digest {got}")
    try:
        meta = json.loads((staging / "image.json").read_text())
        config_named = json.loads(manifest)["config"]["digest"]
    except (ValueError, KeyError, TypeError) as exc:
        raise refuse(f"has an image.json or manifest.json that does not parse ({exc})") from exc
    if meta.get("digest") != digest:
        raise refuse(f"has an image.json naming {meta.get('digest')!r}")
    declared = meta.get("rootfs_sha256")  # absent: imported before issue 14
    if declared is not None and declared != identity.known(staging / "rootfs.ext4"):
        raise refuse(f"has an image.json naming the rootfs sha256 {declared!r}, not its own")
    config = digest_of((staging / "config.json").read_bytes())
    if not (config == config_named == meta.get("config_digest")):
        raise refuse(
            f"has a config.json of digest {config}, where the manifest names {config_named} "
            f"and image.json {meta.get('config_digest')!r}"
        )
    if load_content(staging) is None:
        raise refuse("is not complete")


def check_boot(staging: Path, key: str) -> None:
    """The fetched boot set is complete and names itself ``key``."""
    names = {f.name for f in staging.iterdir()}
    if not names >= BOOT_FILES:
        raise BlobError(
            f"the fetched boot set {key} lacks {', '.join(sorted(BOOT_FILES - names))}; "
            "it is not used"
        )
    found = load_boot_set(staging)
    if found is None or found.key != key:
        raise BlobError(
            f"the fetched boot set {key} names itself {found.key if found else 'nothing'}; "
            "it is not used"
        )


def check_builtin(staging: Path, name: str, digest: str) -> None:
    """The fetched files are the built-in image ``name`` of ``digest``: its
    ``manifest.json`` names both, the ``rootfs.ext4`` is the size it declares and (where
    it declares one) of the sha256 it declares, and the directory loads as a complete
    image. The bytes themselves were checked against the uploader's record as they
    were written, and the rootfs's identity recorded from it (``identity.known``)."""

    def refuse(why: str) -> BlobError:
        return BlobError(
            f"built-in image {name!r} ({digest}): the fetched directory {why}; it is not used"
        )

    names = {f.name for f in staging.iterdir()}
    if not names >= BUILTIN_FILES:
        raise refuse(f"lacks {', '.join(sorted(BUILTIN_FILES - names))}")
    try:
        manifest = json.loads((staging / "manifest.json").read_text())
        size = int(manifest["size_bytes"])
    except (ValueError, KeyError, TypeError) as exc:
        raise refuse(f"has a manifest.json that does not parse ({exc})") from exc
    if manifest.get("name") != name or manifest.get("digest") != digest:
        raise refuse(
            f"has a manifest.json naming {manifest.get('name')!r} {manifest.get('digest')!r}"
        )
    if (staging / "rootfs.ext4").stat().st_size != size:
        raise refuse(f"has a rootfs.ext4 that is not the {size} bytes its manifest declares")
    declared = manifest.get("rootfs_sha256")  # absent: built before issue 14
    if declared is not None and declared != identity.known(staging / "rootfs.ext4"):
        raise refuse(f"has a manifest.json naming the rootfs sha256 {declared!r}, not its own")
    if image_at(staging) is None:
        raise refuse("is not a complete image")


def dig_holes(path: Path) -> None:
    """Make the zeros of a downloaded disk image holes again (it was sparse where it
    was built); without ``fallocate`` it just stays dense."""
    with contextlib.suppress(OSError):
        subprocess.run(["fallocate", "--dig-holes", str(path)], capture_output=True, check=False)
