""".dockerignore (as Docker reads it) and the build context read in place: member
names checked, symlinks followed inside the context only, wildcards, ADD's archive
detection, and the digest a COPY's cache key covers."""

from __future__ import annotations

import gzip
import io
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hutch.contract.dockerignore import parse_dockerignore
from hutch.errors import InvalidArgument, InvalidDockerfile
from hutch.images.build_context import BuildContext


@pytest.mark.parametrize(
    ("rules", "path", "ignored"),
    [
        ("*.log", "a.log", True),
        ("*.log", "sub/a.log", False),  # * does not cross /
        ("**/*.log", "sub/deep/a.log", True),
        ("**/*.log", "a.log", True),  # ** also matches no directory
        ("node_modules", "node_modules/x/y.js", True),  # a parent matching excludes
        ("**/node_modules", "web/node_modules/x.js", True),
        ("/build", "build/out", True),  # a leading / means the root
        ("./build/", "build", True),  # cleaned like a path
        ("docs/**/*.md", "docs/a/b/c.md", True),
        ("docs/**/*.md", "docs/c.md", True),
        ("docs/**/*.md", "src/c.md", False),
        ("*.log\n!keep.log", "keep.log", False),  # an exception re-includes
        ("*.log\n!keep.log", "other.log", True),
        ("logs\n!logs/keep", "logs/keep", False),
        ("logs\n!logs/keep", "logs/drop", True),
        ("!a\na", "a", True),  # the last matching pattern decides
        ("# comment\n\n   \n  spaced  ", "spaced", True),
        ("#notacomment", "#notacomment", False),
        ("f?le", "file", True),
        ("f?le", "f/le", False),
        ("[ab].txt", "a.txt", True),
        ("[!ab].txt", "a.txt", False),
        ("[!ab].txt", "c.txt", True),
        ("\\*", "*", True),
        ("\\*", "x", False),
        ("Dockerfile", "Dockerfile", True),
    ],
)
def test_dockerignore_as_docker(rules: str, path: str, ignored: bool) -> None:
    assert parse_dockerignore(rules).ignored(path) is ignored


#: (name, kind, data or link target, mode) of one archive member.
Entry = tuple[str, str, bytes | str, int]


def make_tar(path: Path, entries: list[Entry]) -> Path:
    """(name, kind file|dir|symlink|hardlink|fifo, data or link target, mode)."""
    with tarfile.open(path, "w") as tar:
        for name, kind, data, mode in entries:
            info = tarfile.TarInfo(name)
            info.mode = mode
            info.mtime = 1_700_000_000
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif kind in ("symlink", "hardlink"):
                info.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
                info.linkname = str(data)
                tar.addfile(info)
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
                tar.addfile(info)
            else:
                raw = data if isinstance(data, bytes) else data.encode()
                info.size = len(raw)
                tar.addfile(info, io.BytesIO(raw))
    return path


def tar_bytes(entries: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


CONTEXT: list[Entry] = [
    ("Dockerfile", "file", "FROM base\n", 0o644),
    ("./app", "dir", b"", 0o755),
    ("./app/main.py", "file", "print('hi')\n", 0o644),
    ("app/run.sh", "file", "#!/bin/sh\n", 0o755),
    ("app/debug.log", "file", "noise", 0o644),
    ("deep/a/b/c.txt", "file", "c", 0o600),  # no directory members: implied
    ("link-to-app", "symlink", "app", 0o777),
    ("abs-link", "symlink", "/app/main.py", 0o777),  # absolute: inside the context
    ("climb", "symlink", "../../../../app", 0o777),  # .. stops at the context root
    ("app/hard", "hardlink", "app/main.py", 0o644),
    ("data.tar.gz", "file", gzip.compress(tar_bytes({"x": b"x"})), 0o644),
    ("fake.tar.gz", "file", gzip.compress(b"not a tar" * 100), 0o644),
    ("plain.tar", "file", tar_bytes({"y": b"y"}), 0o644),
    ("pipe", "fifo", b"", 0o644),
    (".dockerignore", "file", "*.log\n**/*.log\nsecret\n", 0o644),
    ("secret", "file", "s3cret", 0o600),
]


@pytest.fixture
def ctx(tmp_path: Path) -> Iterator[BuildContext]:
    with BuildContext(make_tar(tmp_path / "ctx.tar", CONTEXT)) as c:
        yield c


def test_members_are_indexed_and_ignored_files_dropped(ctx: BuildContext) -> None:
    assert ctx.entries["app/main.py"].kind == "file"
    assert ctx.entries["deep/a/b"].kind == "dir"  # implied parent
    assert "app/debug.log" not in ctx.entries and "secret" not in ctx.entries
    assert {"app/debug.log", "secret"} <= ctx.ignored
    assert ctx.read(ctx.entries["app/hard"]) == b"print('hi')\n"  # a hard link: a copy
    assert ctx.dockerfile("Dockerfile") == b"FROM base\n"


def test_symlinks_are_followed_inside_the_context(ctx: BuildContext) -> None:
    assert ctx.resolve("link-to-app/main.py") == ctx.entries["app/main.py"]
    assert ctx.resolve("abs-link") == ctx.entries["app/main.py"]
    assert ctx.resolve("climb/run.sh") == ctx.entries["app/run.sh"]
    assert ctx.resolve("nope/x") is None


def test_sources_files_dirs_wildcards_and_archives(ctx: BuildContext) -> None:
    (src,) = ctx.sources("line 3", "COPY", "app", add=False)
    assert src.kind == "dir"
    assert [e.path for e in src.entries] == ["app/hard", "app/main.py", "app/run.sh"]
    matched = ctx.sources("line 3", "COPY", "*.tar*", add=True)
    assert [(s.name, s.kind) for s in matched] == [
        ("data.tar.gz", "archive"),
        ("fake.tar.gz", "file"),  # gzip, but no tar inside: copied as is
        ("plain.tar", "archive"),
    ]
    (as_copy,) = ctx.sources("line 3", "COPY", "data.tar.gz", add=False)
    assert as_copy.kind == "file"  # COPY never unpacks
    (linked,) = ctx.sources("line 3", "COPY", "abs-link", add=False)
    assert (linked.name, linked.root.path) == ("abs-link", "app/main.py")


def test_missing_ignored_and_special_sources_name_the_line(ctx: BuildContext) -> None:
    with pytest.raises(InvalidDockerfile, match=r"line 7: COPY: 'nope.txt' not found"):
        ctx.sources("line 7", "COPY", "nope.txt", add=False)
    with pytest.raises(InvalidDockerfile, match=r"'secret' not found .*\.dockerignore excludes"):
        ctx.sources("line 7", "COPY", "secret", add=False)
    with pytest.raises(InvalidDockerfile, match=r"'\*\.md' matches no file"):
        ctx.sources("line 7", "COPY", "*.md", add=False)
    with pytest.raises(InvalidDockerfile, match=r"'pipe' is a device, socket or FIFO"):
        ctx.sources("line 7", "COPY", "pipe", add=False)
    with pytest.raises(InvalidDockerfile, match=r"'pipe' in the build context is a device"):
        ctx.sources("line 7", "COPY", ".", add=False)
    with pytest.raises(InvalidArgument, match="no Dockerfile at 'build/Dockerfile'"):
        ctx.dockerfile("build/Dockerfile")


def test_the_digest_covers_content_and_mode_not_time(tmp_path: Path) -> None:
    def digest(entries: list[Entry]) -> str:
        path = make_tar(tmp_path / f"c{len(list(tmp_path.iterdir()))}.tar", entries)
        with BuildContext(path) as c:
            return c.digest(c.sources("line 2", "COPY", ".", add=False))

    base: list[Entry] = [("a", "file", "one", 0o644), ("d/b", "file", "two", 0o644)]
    same = digest(base)
    assert digest(base) == same
    assert digest([("a", "file", "one", 0o644), ("d/b", "file", "TWO", 0o644)]) != same
    assert digest([("a", "file", "one", 0o755), ("d/b", "file", "two", 0o644)]) != same
    assert digest([("a", "file", "one", 0o644), ("d/c", "file", "two", 0o644)]) != same
    # A new mtime only: the same key (Docker does not key on times either).
    path = tmp_path / "touched.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in (("a", b"one"), ("d/b", b"two")):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 42
            tar.addfile(info, io.BytesIO(data))
    with BuildContext(path) as c:
        assert c.digest(c.sources("line 2", "COPY", ".", add=False)) == same


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "a/../../b"])
def test_members_outside_the_context_are_refused(tmp_path: Path, name: str) -> None:
    path = make_tar(tmp_path / "bad.tar", [(name, "file", "x", 0o644)])
    with pytest.raises(InvalidArgument, match="outside its root"):
        BuildContext(path)


def test_not_a_tar_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x.tar").write_bytes(b"hello" * 200)
    with pytest.raises(InvalidArgument, match="not a tar archive"):
        BuildContext(tmp_path / "x.tar")
