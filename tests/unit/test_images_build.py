"""Cache keys, digests, and find/list/build behaviour that needs no real build."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest

from hutch.errors import ImageBuildError, UnknownImage
from hutch.images import _proc
from hutch.images.build import build_image, find_image, image_digest, list_images
from hutch.images.cache import atomic_write_text, file_lock, short_digest
from hutch.images.catalog import IMAGES
from hutch.images.rootfs import ext4_size_bytes, tree_key

MIRRORS = ["deb http://deb.debian.org/debian bookworm main"]


def test_short_digest_is_stable_and_unambiguous() -> None:
    assert short_digest("a", "b") == short_digest("a", "b")
    assert short_digest("ab", "c") != short_digest("a", "bc")
    assert len(short_digest()) == 16


def test_tree_key_depends_on_packages_and_mirrors_not_order() -> None:
    base = IMAGES["base"]
    key = tree_key(base, MIRRORS)
    assert key != tree_key(IMAGES["devbox"], MIRRORS)
    assert key != tree_key(base, [*MIRRORS, "deb http://x/debian-security bookworm-security main"])
    reordered = type(base)(base.name, base.description, tuple(reversed(base.packages)))
    assert tree_key(reordered, MIRRORS) == key


def test_image_digest_depends_on_every_input() -> None:
    args = ("base", "tree", "agent", "init", "initrd", "kernel", "cmdline")
    digest = image_digest(*args)
    for i in range(len(args)):
        changed = list(args)
        changed[i] += "x"
        assert image_digest(*changed) != digest


def test_ext4_size_has_headroom_and_alignment() -> None:
    mib = 1 << 20
    size = ext4_size_bytes(200 * mib, 10_000)
    assert size % (16 * mib) == 0
    assert size >= 200 * mib * 1.1 + 64 * mib
    assert ext4_size_bytes(201 * mib, 10_000) >= size


def test_atomic_write_replaces_whole_file(tmp_path: Path) -> None:
    target = tmp_path / "current"
    atomic_write_text(target, "one\n")
    atomic_write_text(target, "two\n", mode=0o600)
    assert target.read_text() == "two\n"
    assert target.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["current"]


def _hold_lock(path: str, seconds: float, marker: str) -> None:
    with file_lock(Path(path)):
        Path(marker).write_text(str(time.monotonic()))
        time.sleep(seconds)


def test_file_lock_excludes_other_processes(tmp_path: Path) -> None:
    lock, marker = tmp_path / "x.lock", tmp_path / "held"
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_hold_lock, args=(str(lock), 1.0, str(marker)))
    child.start()
    try:
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert time.monotonic() < deadline, "child never took the lock"
            time.sleep(0.02)
        start = time.monotonic()
        with file_lock(lock):
            waited = time.monotonic() - start
        assert waited > 0.3  # we had to wait for the child to let go
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()


def fake_image(images_dir: Path, name: str, digest: str, complete: bool = True) -> Path:
    d = images_dir / name / digest
    d.mkdir(parents=True)
    for f in ("vmlinux", "initrd.img", "rootfs.ext4"):
        (d / f).write_bytes(b"x")
    if complete:
        (d / "manifest.json").write_text(
            json.dumps(
                {
                    "name": name,
                    "digest": digest,
                    "kernel_release": "6.1.0-57-cloud-amd64",
                    "cmdline": "console=ttyS0",
                    "size_bytes": 1234,
                    "built_at": 1700000000.0,
                }
            )
        )
    (images_dir / name / "current").write_text(digest + "\n")
    return d


def test_find_image_returns_complete_image(tmp_path: Path) -> None:
    d = fake_image(tmp_path, "base", "abcd")
    arts = find_image("base", tmp_path)
    assert arts is not None
    assert (arts.name, arts.digest, arts.size_bytes) == ("base", "abcd", 1234)
    assert (arts.kernel, arts.initrd, arts.rootfs) == (
        d / "vmlinux",
        d / "initrd.img",
        d / "rootfs.ext4",
    )
    assert arts.kernel_release == "6.1.0-57-cloud-amd64"


def test_find_image_ignores_half_built_or_missing(tmp_path: Path) -> None:
    assert find_image("base", tmp_path) is None
    fake_image(tmp_path, "base", "abcd", complete=False)
    assert find_image("base", tmp_path) is None
    with pytest.raises(UnknownImage):
        find_image("nope", tmp_path)


def test_list_images_reports_built_status(tmp_path: Path) -> None:
    fake_image(tmp_path, "devbox", "ffff")
    infos = {i.name: i for i in list_images(tmp_path)}
    assert set(infos) == set(IMAGES)
    assert not infos["base"].built and infos["base"].digest is None
    assert infos["devbox"].built and infos["devbox"].digest == "ffff"
    assert infos["devbox"].built_at == 1700000000.0


def test_build_unknown_image(tmp_path: Path) -> None:
    with pytest.raises(UnknownImage, match="known images"):
        build_image("windows", tmp_path)


def test_missing_tools_are_named_with_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda name, path=None: None)
    with pytest.raises(ImageBuildError, match=r"apt-get install .*mmdebstrap"):
        _proc.require_tools(["mmdebstrap", "lz4"])


def test_missing_agent_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_proc, "require_tools", lambda: {})
    with pytest.raises(ImageBuildError, match="guest agent source"):
        build_image("base", tmp_path, agent_path=tmp_path / "nope.py", mirrors=MIRRORS)


def test_failing_command_reports_stderr_tail() -> None:
    with pytest.raises(ImageBuildError, match=r"(?s)exit 3.*boom"):
        _proc.run(["sh", "-c", "echo boom >&2; exit 3"], what="test step")
    with pytest.raises(ImageBuildError, match="not found"):
        _proc.run(["/nonexistent/tool"], what="test step")


def test_missing_apt_package_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hutch.images import rootfs

    def fake_run(argv: list[str], **kwargs: object) -> str:
        assert argv[0] == "mmdebstrap"
        raise ImageBuildError("mmdebstrap failed (exit 1)\nE: Unable to locate package nope-x")

    monkeypatch.setattr(_proc, "run", fake_run)
    with pytest.raises(ImageBuildError, match="apt has no package nope-x in bookworm"):
        rootfs.prepare_tree(IMAGES["base"], MIRRORS, tmp_path)
    assert list((tmp_path / "cache" / "trees").iterdir()) == []  # no half-built tree left
