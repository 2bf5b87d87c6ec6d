"""fetch_dir trusts nothing the store holds: an index naming a path outside the staging
directory, or a raw image outside this host's images directory as the base of the disk
chain (a guest would get that host file as its disk), is refused before any rebase."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hutch.errors import BlobError
from hutch.services.blob_dirs import INDEX, fetch_dir
from hutch.storage.blobs import LocalBlobStore


def _stored(tmp_path: Path, **index_changes: object) -> LocalBlobStore:
    store = LocalBlobStore(tmp_path / "blobs")
    files = {}
    for name in ("manifest.json", "state.mig", "disk.qcow2"):
        src = tmp_path / name
        src.write_bytes(name.encode())
        info = store.put(f"snapshots/snap-1/{name}", src)
        files[name] = {"size": info.size, "sha256": info.sha256}
    index = {
        "format": 1,
        "owner": "snap-1",
        "files": files,
        "layers": [],
        "base": None,
        "base_size": None,
        **index_changes,
    }
    (tmp_path / "index").write_text(json.dumps(index))
    store.put(f"snapshots/snap-1/{INDEX}", tmp_path / "index")
    return store


def _fetch(tmp_path: Path, store: LocalBlobStore) -> None:
    staging = tmp_path / "staging"
    staging.mkdir(exist_ok=True)
    images = tmp_path / "images"
    images.mkdir(exist_ok=True)
    fetch_dir(
        store, "snapshots/snap-1/", staging, tmp_path / "final", owner="snap-1", images_dir=images
    )


def test_a_base_outside_the_images_directory_is_refused(tmp_path: Path) -> None:
    store = _stored(tmp_path, base="/etc/passwd", base_size=Path("/etc/passwd").stat().st_size)
    with pytest.raises(BlobError, match="not in this host's images directory"):
        _fetch(tmp_path, store)


@pytest.mark.parametrize(
    "changes",
    [
        {"layers": [{"name": "../../evil", "size": 1, "sha256": "0" * 64}]},
        {"owner": "snap-2"},
        {"format": 99},
        {"layers": "nope"},
        {"base_sha256": "not-a-sha256"},
        {"depends": ["/images/oci-boot/k/runtime.ext4"]},
        {"depends": {"/images/oci-boot/k/runtime.ext4": "short"}},
        # sparse files (format 2): their blob must be listed, of the layout's data size
        {"sparse": {"memory.ram": {"blob": "memory.ram.data", "size": 8, "extents": []}}},
        {
            "format": 2,
            "sparse": {"memory.ram": {"blob": "state.mig", "size": 9, "extents": [[0, 9]]}},
        },
        {
            "format": 2,
            "sparse": {"memory.ram": {"blob": "memory.ram.data", "size": 8, "extents": []}},
        },
        {
            "format": 2,
            "sparse": {"../x": {"blob": "../x.data", "size": 8, "extents": []}},
        },
        {
            "format": 2,
            "sparse": {"state.mig": {"blob": "state.mig.data", "size": 9, "extents": [[0, 9]]}},
        },
    ],
)
def test_a_malformed_index_is_refused(tmp_path: Path, changes: dict[str, object]) -> None:
    store = _stored(tmp_path, **changes)
    with pytest.raises(BlobError, match="is not a valid index"):
        _fetch(tmp_path, store)
    assert not (tmp_path / "staging" / "disk.qcow2").exists()  # refused before any blob


def test_a_dependency_outside_the_images_directory_is_refused(tmp_path: Path) -> None:
    """``depends`` (the runtime disk's identity) names a path this host checks: one
    outside its images directory is refused before any blob, as a base would be."""
    store = _stored(tmp_path, depends={"/etc/passwd": "0" * 64})
    with pytest.raises(BlobError, match="not in this host's images directory"):
        _fetch(tmp_path, store)
    assert not (tmp_path / "staging" / "disk.qcow2").exists()


def test_an_unfinished_upload_is_named(tmp_path: Path) -> None:
    store = _stored(tmp_path)
    store.delete(f"snapshots/snap-1/{INDEX}")
    with pytest.raises(BlobError, match=r"upload to .* has not completed"):
        _fetch(tmp_path, store)


def test_an_index_other_than_the_recorded_one_is_refused(tmp_path: Path) -> None:
    store = _stored(tmp_path)
    staging = tmp_path / "staging"
    staging.mkdir()
    with pytest.raises(BlobError, match="is not the index its uploader recorded"):
        fetch_dir(
            store,
            "snapshots/snap-1/",
            staging,
            tmp_path / "final",
            owner="snap-1",
            images_dir=tmp_path,
            index_sha256="0" * 64,
        )
    assert list(staging.iterdir()) == []
