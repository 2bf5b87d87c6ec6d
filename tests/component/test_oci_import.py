"""Importing OCI images into content directories (real archives written by
tests/ocikit.py, real mkfs.ext4): formats, caching, and bad input refused with nothing
left behind."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import pytest

from hutch.errors import InvalidImage
from hutch.images import identity
from hutch.images.cache import file_lock
from hutch.images.oci.archives import LayoutDir, open_archive
from hutch.images.oci.importer import build_content, discard_partial, find_content, resolve
from tests.ocikit import (
    E,
    Image,
    Layer,
    index_of,
    layer_tar,
    write_docker_archive,
    write_layout,
    write_oci_archive,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="owners need root")


def small_image(tag: str = "a", **kw: object) -> Image:
    return Image(
        layers=[
            Layer(layer_tar([E("etc", "dir"), E("etc/os", data=tag.encode()), E("bin", "dir")])),
            Layer(
                layer_tar([E("etc/os", "whiteout"), E("srv", "dir"), E("srv/x", data=b"x")]),
                "zstd",
            ),
            Layer(layer_tar([E("srv/y", data=b"y")]), "none"),
        ],
        working_dir="/srv/work",
        user="1000",
        **kw,  # type: ignore[arg-type]
    )


def leftovers(images_dir: Path) -> list[str]:
    oci = images_dir / "oci"
    if not oci.is_dir():
        return []
    return sorted(p.name for p in oci.iterdir() if not p.name.endswith(".lock"))


def do_import(path: Path, images_dir: Path) -> object:
    if path.is_dir():
        source = LayoutDir(path)
        return build_content(source, resolve(source, path.name), images_dir, what=path.name)
    with open_archive(path) as archive:
        return build_content(archive, resolve(archive, path.name), images_dir, what=path.name)


@pytest.mark.parametrize("fmt", ["oci-archive", "docker-archive", "oci-layout"])
def test_each_format_imports_the_same_tree(tmp_path: Path, fmt: str) -> None:
    img = small_image()
    images = tmp_path / "images"
    path = tmp_path / "in"
    if fmt == "oci-archive":
        write_oci_archive(img, path, tmp_path)
    elif fmt == "docker-archive":
        write_docker_archive(img, path)
    else:
        write_layout([img], path)
    content = do_import(path, images)
    assert content.rootfs.is_file()  # type: ignore[attr-defined]
    assert content.config.working_dir == "/srv/work"  # type: ignore[attr-defined]
    assert "/srv/work" in content.added and "/proc" in content.added  # type: ignore[attr-defined]
    if fmt != "docker-archive":
        assert content.digest == img.digest  # type: ignore[attr-defined]
    meta = json.loads((content.path / "image.json").read_text())  # type: ignore[attr-defined]
    assert meta["layers"] == 3
    # Its content identity (issue 14), hashed once at import and kept beside the rootfs.
    rootfs = content.rootfs  # type: ignore[attr-defined]
    assert meta["rootfs_sha256"] == identity.compute(rootfs) == identity.known(rootfs)
    assert leftovers(images) == [content.path.name]  # type: ignore[attr-defined]
    assert find_content(images, content.digest) == content  # type: ignore[attr-defined]


def test_second_import_is_cached(tmp_path: Path) -> None:
    img = small_image()
    layout = tmp_path / "layout"
    write_layout([img], layout)
    images = tmp_path / "images"
    first = do_import(layout, images)
    # Remove the blobs: a cached import must not need them.
    for layer in img.layers:
        (layout / "blobs/sha256" / layer.digest.split(":")[1]).unlink()
    assert do_import(layout, images) == first


def test_index_with_several_platforms_picks_amd64(tmp_path: Path) -> None:
    amd = small_image("amd")
    arm = small_image("arm", architecture="arm64")
    layout = tmp_path / "layout"
    write_layout(
        [arm, amd],
        layout,
        index=index_of([(arm.manifest(), "linux", "arm64"), (amd.manifest(), "linux", "amd64")]),
    )
    content = do_import(layout, tmp_path / "images")
    assert content.digest == amd.digest  # type: ignore[attr-defined]


def test_other_architecture_is_refused(tmp_path: Path) -> None:
    arm = small_image("arm", architecture="arm64")
    layout = tmp_path / "layout"
    write_layout([arm], layout, index=index_of([(arm.manifest(), "linux", "arm64")]))
    with pytest.raises(InvalidImage, match=r"no linux/amd64.*linux/arm64"):
        do_import(layout, tmp_path / "images")
    # A single-platform manifest for arm64 without a platform in the index: the config says.
    write_layout([arm], tmp_path / "l2", index=json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": arm.digest,
         "size": len(arm.manifest())}]}).encode())  # fmt: skip
    with pytest.raises(InvalidImage, match="linux/arm64; hutch boots x86-64"):
        do_import(tmp_path / "l2", tmp_path / "images")
    assert leftovers(tmp_path / "images") == []


def test_corrupt_layer_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    img = small_image("corrupt")
    layout = tmp_path / "layout"
    write_layout([img], layout)
    blob = layout / "blobs/sha256" / img.layers[1].digest.split(":")[1]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    images = tmp_path / "images"
    with pytest.raises(InvalidImage) as err:
        do_import(layout, images)
    assert "layer 2/3" in err.value.message
    assert "digest mismatch" in err.value.message or "zstd" in err.value.message
    assert leftovers(images) == []


def test_corrupt_uncompressed_layer_says_digest_mismatch(tmp_path: Path) -> None:
    img = small_image("corrupt2")
    layout = tmp_path / "layout"
    write_layout([img], layout)
    blob = layout / "blobs/sha256" / img.layers[2].digest.split(":")[1]
    data = bytearray(blob.read_bytes())
    data[600] ^= 0x01  # inside the file data of srv/y
    blob.write_bytes(bytes(data))
    with pytest.raises(InvalidImage, match=r"layer 3/3 .*digest mismatch: expected sha256:"):
        do_import(layout, tmp_path / "images")
    assert leftovers(tmp_path / "images") == []


def test_layer_escaping_the_root_is_refused(tmp_path: Path) -> None:
    img = Image(layers=[Layer(layer_tar([E("../../etc/cron.d/evil", data=b"* * * * * root x")]))])
    layout = tmp_path / "layout"
    write_layout([img], layout)
    with pytest.raises(InvalidImage, match="escapes the image root"):
        do_import(layout, tmp_path / "images")
    assert leftovers(tmp_path / "images") == []


def test_truncated_archives_are_refused(tmp_path: Path) -> None:
    img = small_image("trunc")
    archive = tmp_path / "full.tar"
    write_oci_archive(img, archive, tmp_path)
    data = archive.read_bytes()
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
    biggest = max(members, key=lambda m: m.size)
    for cut in (biggest.offset_data + biggest.size // 2, len(data) // 3, 700):
        path = tmp_path / f"cut-{cut}.tar"
        path.write_bytes(data[:cut])
        with pytest.raises(InvalidImage) as err:
            do_import(path, tmp_path / "images")
        msg = err.value.message
        assert any(w in msg for w in ("truncated", "incomplete", "has no")), msg
    docker = tmp_path / "docker.tar"
    write_docker_archive(img, docker)
    with tarfile.open(docker) as tar:
        layer = next(m for m in tar.getmembers() if m.name.endswith("layer.tar"))
    cut_docker = tmp_path / "docker-cut.tar"
    cut_docker.write_bytes(docker.read_bytes()[: layer.offset_data + layer.size // 2])
    with pytest.raises(InvalidImage, match=r"truncated|incomplete|has no"):
        do_import(cut_docker, tmp_path / "images")
    assert leftovers(tmp_path / "images") == []


def test_not_an_archive(tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.write_bytes(b"hello" * 1000)
    with pytest.raises(InvalidImage, match="tar"):
        do_import(junk, tmp_path / "images")
    empty = tmp_path / "empty.tar"
    with tarfile.open(empty, "w"):
        pass
    with pytest.raises(InvalidImage, match="neither an oci-archive"):
        do_import(empty, tmp_path / "images")


def test_partial_work_dirs_are_discarded(tmp_path: Path) -> None:
    images = tmp_path / "images"
    work = images / "oci" / (".sha256-" + "0" * 64 + ".abc")
    work.mkdir(parents=True)
    (work / "junk").write_text("x")
    assert discard_partial(images) == [f"oci/{work.name}"]
    assert not work.exists()


def test_boot_set_leftovers_are_discarded_unless_the_boot_lock_is_held(tmp_path: Path) -> None:
    """What a daemon killed mid boot-set fetch (or build) leaves in ``oci-boot/`` goes
    at the next start, as ``oci/``'s does; a boot set in place and ``current`` stay, and
    nothing goes while another daemon holds ``oci-boot.lock`` (it may be writing it)."""
    images = tmp_path / "images"
    boot = images / "oci-boot"
    kept = boot / "0123456789abcdef"
    kept.mkdir(parents=True)
    (kept / "boot.json").write_text("{}")
    (boot / "current").write_text("0123456789abcdef\n")
    fetch = boot / ".0123456789abcdef.fetch-x1y2"
    fetch.mkdir()
    (fetch / "runtime.ext4").write_bytes(b"half")
    build = boot / ".fedcba9876543210.k3j4"
    build.mkdir()
    current_tmp = boot / ".current.abc"
    current_tmp.write_text("fedc")
    with file_lock(images / "oci-boot.lock"):  # another daemon fetching a boot set
        assert discard_partial(images) == []
    assert fetch.exists() and build.exists()
    assert discard_partial(images) == [
        f"oci-boot/{n}" for n in sorted([fetch.name, build.name, current_tmp.name])
    ]
    assert sorted(p.name for p in boot.iterdir()) == ["0123456789abcdef", "current"]
    assert (kept / "boot.json").read_text() == "{}"
