"""The layer applier on a real directory (as root, as the daemon runs it): whiteouts,
opaque directories, hard links, symlinks, xattrs, modes and owners, compared with an
independent model of the layers (tests/ocikit.py); and hostile layers refused."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from hutch.errors import InvalidImage
from hutch.images.oci.compression import decompressed
from hutch.images.oci.layers import TreeApplier, clean_path
from tests.ocikit import E, TreeModel, compress, host_listing, layer_tar

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="owners and devices need root")

LOWER = [
    E("etc", "dir"),
    E("etc/passwd", data=b"root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n"),
    E("etc/keep.conf", data=b"keep"),
    E("etc/gone.conf", data=b"gone"),
    E("usr", "dir"),
    E("usr/lib", "dir"),
    E("usr/lib/libx.so.1", data=b"\x7fELF lib", mode=0o755),
    E("lib", "symlink", target="usr/lib"),
    E("opaque", "dir", mode=0o750, uid=1000, gid=1000),
    E("opaque/lower-a", data=b"a"),
    E("opaque/sub", "dir"),
    E("opaque/sub/lower-b", data=b"b"),
    E("tree", "dir"),
    E("tree/deep", "dir"),
    E("tree/deep/file", data=b"deep"),
    E("bin", "dir"),
    E("bin/tool", data=b"#!/bin/sh\necho tool\n", mode=0o4755),
    E("bin/tool-link", "hardlink", target="bin/tool"),
    E("home", "dir"),
    E("home/user", "dir", mode=0o700, uid=1000, gid=1000),
    E("home/user/notes", data=b"n", mode=0o600, uid=1000, gid=1000),
    E("dev", "dir"),
    E("dev/null", "chr"),
    E("run", "dir"),
    E("run/fifo", "fifo"),
    E("attrs", data=b"x", xattrs={"user.hutch.test": "value-1", "user.other": "2"}),
]

UPPER = [
    E("etc/gone.conf", "whiteout"),
    E("tree", "whiteout"),
    E("opaque", "opaque"),
    E("opaque/upper-c", data=b"c"),
    E("opaque/sub", "dir"),
    E("opaque/sub/upper-d", data=b"d"),
    # Written through the lib -> usr/lib symlink: lands in usr/lib.
    E("lib/liby.so.2", data=b"\x7fELF y"),
    E("bin/tool", data=b"#!/bin/sh\necho new tool\n", mode=0o755),  # breaks the hard link
    E("bin/second", "hardlink", target="bin/tool-link"),
    E("etc/keep.conf", data=b"kept and changed", mode=0o640, uid=0, gid=42),
    # A whiteout never hides what its own layer adds, whatever the order.
    E("new-dir/file", data=b"mine"),
    E("new-dir", "whiteout"),
    E("sgid", "dir", mode=0o2775, gid=50),
]

THIRD = [
    E("bin/tool-link", "whiteout"),
    E("home/user/notes", "whiteout"),
    E("home/user/.profile", data=b"export X=1\n", uid=1000, gid=1000),
    E("etc/abs-link", "symlink", target="/etc/keep.conf"),
    E("etc/rel-link", "symlink", target="../usr/lib/libx.so.1"),
]


def apply_all(root: Path, layers: list[bytes]) -> TreeApplier:
    applier = TreeApplier(root)
    for i, tar in enumerate(layers, 1):
        applier.apply(io.BytesIO(tar), f"layer {i}")
    applier.finish()
    return applier


def test_layers_land_exactly_as_the_model_says(tmp_path: Path) -> None:
    layers = [layer_tar(LOWER), layer_tar(UPPER), layer_tar(THIRD)]
    root = tmp_path / "root"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    apply_all(root, layers)
    model = TreeModel()
    for tar in layers:
        model.apply(tar)
    assert host_listing(root) == model.listing()

    # The facts the listing encodes, spelled out.
    assert not (root / "etc/gone.conf").exists()
    assert not (root / "tree").exists()
    assert sorted(os.listdir(root / "opaque")) == ["sub", "upper-c"]
    assert os.listdir(root / "opaque/sub") == ["upper-d"]
    assert (root / "usr/lib/liby.so.2").read_bytes() == b"\x7fELF y"
    assert os.readlink(root / "lib") == "usr/lib"
    assert (root / "new-dir/file").read_bytes() == b"mine"
    tool, second = os.stat(root / "bin/tool"), os.stat(root / "bin/second")
    assert not (root / "bin/tool-link").exists()
    assert second.st_nlink == 1 and second.st_ino != tool.st_ino  # the old inode
    assert (root / "bin/second").read_bytes() == b"#!/bin/sh\necho tool\n"
    assert oct(os.stat(root / "bin/second").st_mode & 0o7777) == oct(0o4755)
    assert oct(os.stat(root / "sgid").st_mode & 0o7777) == oct(0o2775)
    assert os.stat(root / "opaque").st_uid == 1000
    assert os.getxattr(root / "attrs", "user.hutch.test") == b"value-1"
    assert os.stat(root / "etc/keep.conf").st_gid == 42
    assert os.readlink(root / "etc/abs-link") == "/etc/keep.conf"  # kept as written
    assert os.major(os.stat(root / "dev/null").st_rdev) == 1


def test_compressed_layers_decompress(tmp_path: Path) -> None:
    for how in ("gzip", "zstd", "none"):
        root = tmp_path / how
        root.mkdir()
        blob = compress(layer_tar(LOWER), how)
        with decompressed(io.BytesIO(blob), how) as plain:
            TreeApplier(root).apply(plain, how)
        assert (root / "etc/keep.conf").read_bytes() == b"keep"


@pytest.mark.parametrize("name", ["../escape", "a/../../escape", "/../../etc/escape", "./../x"])
def test_paths_climbing_out_of_the_root_are_refused(tmp_path: Path, name: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(InvalidImage, match="escapes the image root"):
        apply_all(root, [layer_tar([E(name, data=b"pwned")])])
    assert not (tmp_path / "escape").exists()


def test_symlinks_are_followed_inside_the_root_only(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    layers = [
        layer_tar(
            [
                E("to-root", "symlink", target="/"),
                E("to-host", "symlink", target=str(outside)),
                E("climb", "symlink", target="../../../../../.."),
            ]
        ),
        layer_tar(
            [
                E("to-root/etc/a", data=b"a"),
                E("to-host/b", data=b"b"),
                E("climb/c", data=b"c"),
            ]
        ),
    ]
    apply_all(root, layers)
    assert os.listdir(outside) == []
    assert (root / "etc/a").read_bytes() == b"a"
    assert (root / str(outside).lstrip("/") / "b").read_bytes() == b"b"
    assert (root / "c").read_bytes() == b"c"


def test_hard_links_out_of_the_root_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    secret = tmp_path / "secret"
    secret.write_text("host file")
    for target in ("../secret", str(secret)):
        with pytest.raises(InvalidImage) as err:
            apply_all(root, [layer_tar([E("link", "hardlink", target=target)])])
        assert "link" in err.value.message
    assert os.stat(secret).st_nlink == 1


def test_file_over_a_symlink_replaces_the_link_not_its_target(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    apply_all(
        root,
        [
            layer_tar([E("f", "symlink", target=str(victim))]),
            layer_tar([E("f", data=b"new")]),
        ],
    )
    assert victim.read_text() == "untouched"
    assert (root / "f").read_bytes() == b"new" and not (root / "f").is_symlink()


def test_truncated_layer(tmp_path: Path) -> None:
    """Cut inside a file's data. (Cut at a member boundary, a tar looks complete: the
    importer's diff_id check is what catches that, see test_oci_import.)"""
    data = layer_tar([E("a", data=b"a" * 4096), E("big", data=b"x" * 100_000)])
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(InvalidImage, match="truncated"):
        TreeApplier(root).apply(io.BytesIO(data[:50_000]), "layer 1")


def test_size_cap(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(InvalidImage, match="exceed"):
        TreeApplier(root, max_bytes=100).apply(
            io.BytesIO(layer_tar([E("big", data=b"x" * 101)])), "layer 1"
        )


def test_clean_path() -> None:
    assert clean_path("./a//b/./c/", "l") == ("a", "b", "c")
    assert clean_path("a/b/../c", "l") == ("a", "c")
    assert clean_path("./", "l") == ()
    with pytest.raises(InvalidImage):
        clean_path("a/\0b", "l")
