"""The build steps that run inside a build sandbox (``guest_files/build_step.py``), run
here by the host's Python on a directory standing in for the image's root (``--root``),
with the very tar the builder sends (``copy_stream``): Docker's COPY/ADD layout,
owners, modes, links, archives, and the boot files put back. As root, like the guest."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import tarfile
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from hutch.images.build_context import BuildContext, copy_stream
from tests.unit.test_build_context import make_tar

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="owners need root")

SCRIPT = resources.files("hutch.images").joinpath("guest_files/build_step.py").read_text()


def image_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/passwd").write_text(
        "root:x:0:0::/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n"
    )
    (root / "etc/group").write_text("root:x:0:\nstaff:x:50:\n")
    (root / "srv").mkdir()
    os.chmod(root / "srv", 0o711)
    os.chown(root / "srv", 7, 7)
    return root


def run_step(
    root: Path, op: str, arg: str | None = None, stdin: bytes = b""
) -> subprocess.CompletedProcess[bytes]:
    argv = [sys.executable, "-I", "-S", "-c", SCRIPT, "--root", str(root), op]
    if arg is not None:
        argv.append(arg)
    return subprocess.run(argv, input=stdin, capture_output=True, check=False, timeout=60)


def copy(
    root: Path,
    ctx_path: Path,
    sources: list[str],
    dest: str,
    *,
    add: bool = False,
    chown: str | None = None,
    chmod: int | None = None,
) -> subprocess.CompletedProcess[bytes]:
    with BuildContext(ctx_path) as ctx:
        found = [s for w in sources for s in ctx.sources("line 2", "COPY", w, add)]
        spec: dict[str, Any] = {
            "dest": dest.rstrip("/") or "/",
            "dest_is_dir": dest.endswith("/"),
            "chown": chown,
            "chmod": chmod,
            "sources": [{"kind": s.kind, "name": s.name} for s in found],
        }
        data = b"".join(copy_stream(ctx, found))
    return run_step(root, "copy", json.dumps(spec), data)


def meta(path: Path) -> tuple[str, int, int, int]:
    st = os.lstat(path)
    kind = "link" if stat.S_ISLNK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else "file"
    return kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid


@pytest.fixture
def context(tmp_path: Path) -> Path:
    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w:gz") as tar:
        for name, uid, mode in (("pkg/bin/tool", 123, 0o4755), ("pkg/README", 0, 0o644)):
            info = tarfile.TarInfo(name)
            data = name.encode()
            info.size, info.uid, info.gid, info.mode = len(data), uid, uid, mode
            tar.addfile(info, io.BytesIO(data))
    return make_tar(
        tmp_path / "ctx.tar",
        [
            ("app.conf", "file", "setting=1\n", 0o640),
            ("web/index.html", "file", "<h1>hi</h1>\n", 0o644),
            ("web/bin/serve", "file", "#!/bin/sh\n", 0o755),
            ("web/latest", "symlink", "index.html", 0o777),
            ("bundle.tgz", "file", inner.getvalue(), 0o644),
        ],
    )


def test_copy_lays_files_out_as_docker(tmp_path: Path, context: Path) -> None:
    root = image_root(tmp_path)
    # A file to a file path: the parents are made (root, 0755), the mode kept.
    done = copy(root, context, ["app.conf"], "/opt/conf/app.conf")
    assert done.returncode == 0, done.stderr
    assert (root / "opt/conf/app.conf").read_text() == "setting=1\n"
    assert meta(root / "opt/conf/app.conf") == ("file", 0o640, 0, 0)
    assert meta(root / "opt/conf") == ("dir", 0o755, 0, 0)
    # A file to an existing directory written without a slash: into it.
    assert copy(root, context, ["app.conf"], "/etc").returncode == 0
    assert (root / "etc/app.conf").is_file()
    # A directory's content into an existing one, as a named user: the existing
    # directory keeps its owner and mode, the copied entries take the user (the uid as
    # gid, as Docker does) and the --chmod; the symlink stays a symlink.
    done = copy(root, context, ["web"], "/srv/", chown="app", chmod=0o750)
    assert done.returncode == 0, done.stderr
    assert meta(root / "srv") == ("dir", 0o711, 7, 7)
    assert meta(root / "srv/index.html") == ("file", 0o750, 1000, 1000)
    assert meta(root / "srv/bin") == ("dir", 0o750, 1000, 1000)
    assert os.readlink(root / "srv/latest") == "index.html"
    assert meta(root / "srv/latest")[2:] == (1000, 1000)
    # user:group by names.
    assert copy(root, context, ["app.conf"], "/grp/", chown="app:staff").returncode == 0
    assert meta(root / "grp/app.conf")[2:] == (1000, 50)
    assert meta(root / "grp")[2:] == (1000, 50)  # made by this step: the same owner
    # Several sources into a directory; an existing file is replaced.
    (root / "many").mkdir()
    (root / "many/app.conf").write_text("old")
    assert copy(root, context, ["app.conf", "web/index.html"], "/many/").returncode == 0
    assert (root / "many/app.conf").read_text() == "setting=1\n"
    assert (root / "many/index.html").is_file()


def test_add_unpacks_archives_with_their_owners(tmp_path: Path, context: Path) -> None:
    root = image_root(tmp_path)
    done = copy(root, context, ["bundle.tgz"], "/opt/", add=True)
    assert done.returncode == 0, done.stderr
    assert (root / "opt/pkg/bin/tool").read_text() == "pkg/bin/tool"
    assert meta(root / "opt/pkg/bin/tool") == ("file", 0o4755, 123, 123)  # setuid kept
    # COPY of the same file does not unpack it.
    assert copy(root, context, ["bundle.tgz"], "/copied/").returncode == 0
    assert (root / "copied/bundle.tgz").is_file()


def test_copy_errors_say_why(tmp_path: Path, context: Path) -> None:
    root = image_root(tmp_path)
    done = copy(root, context, ["app.conf"], "/x/", chown="nobody-here")
    assert done.returncode == 2
    assert b"/etc/passwd has no user 'nobody-here'" in done.stderr
    (root / "file").write_text("I am a file")
    done = copy(root, context, ["web"], "/file")
    assert (
        done.returncode == 2 and b"/file exists in the image and is not a directory" in done.stderr
    )
    (root / "adir").mkdir()
    (root / "adir/app.conf").mkdir()
    done = copy(root, context, ["app.conf"], "/adir/")
    assert done.returncode == 2 and b"cannot replace the directory" in done.stderr


def test_finish_puts_the_boot_files_back(tmp_path: Path) -> None:
    root = image_root(tmp_path)
    orig = root / "run/.hutch/orig"
    orig.mkdir(parents=True)
    # What the initramfs kept: the image had a hostname and a machine-id, no hosts, and
    # /etc/resolv.conf as a symlink (left alone).
    (orig / "hostname").write_text("image-host\n")
    (orig / "machine-id").write_text("")
    (orig / "hosts.absent").write_text("")
    (orig / "resolv.conf.link").write_text("")
    etc = root / "etc"
    (etc / "hostname").write_text("sb-0123456789ab\n")
    os.chmod(etc / "hostname", 0o600)
    (etc / "machine-id").write_text("0123456789abcdef0123456789abcdef\n")
    (etc / "hosts").write_text("127.0.1.1 sb-0123456789ab\n")
    os.symlink("../run/resolv.conf", etc / "resolv.conf")
    done = run_step(root, "finish")
    assert done.returncode == 0, done.stderr
    assert (etc / "hostname").read_text() == "image-host\n"
    assert meta(etc / "hostname")[1] == 0o600  # written in place: mode kept
    assert (etc / "machine-id").read_text() == ""
    assert not (etc / "hosts").exists()
    assert os.readlink(etc / "resolv.conf") == "../run/resolv.conf"
