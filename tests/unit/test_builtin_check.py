"""What a built-in image's directory fetched from the blob store must be before it is
renamed in (``image_blob_checks.check_builtin``), beyond its bytes matching the
uploader's record: the image and digest it is fetched as, and complete."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hutch.errors import BlobError
from hutch.services.image_blob_checks import check_builtin
from tests.component.builtin_kit import DIGEST, built


def _edit(d: Path, **changes: object) -> None:
    manifest = json.loads((d / "manifest.json").read_text())
    manifest.update(changes)
    (d / "manifest.json").write_text(json.dumps(manifest))


def test_a_complete_directory_of_that_image_and_digest_passes(tmp_path: Path) -> None:
    check_builtin(built(tmp_path, b"A "), "base", DIGEST)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"digest": "fedcba9876543210"}, "naming 'base' 'fedcba9876543210'"),
        ({"name": "devbox"}, "naming 'devbox'"),
        ({"size_bytes": 1}, "not the 1 bytes its manifest declares"),
        ({"rootfs_sha256": "0" * 64}, "naming the rootfs sha256"),
    ],
)
def test_a_manifest_that_says_otherwise_is_refused(
    tmp_path: Path, change: dict[str, object], why: str
) -> None:
    d = built(tmp_path, b"A ")
    _edit(d, **change)
    with pytest.raises(BlobError, match=why):
        check_builtin(d, "base", DIGEST)


def test_a_directory_missing_a_file_is_refused(tmp_path: Path) -> None:
    d = built(tmp_path, b"A ")
    (d / "vmlinux").unlink()
    with pytest.raises(BlobError, match="lacks vmlinux"):
        check_builtin(d, "base", DIGEST)
