"""Host apt sources -> explicit mirror lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from hutch.errors import ImageBuildError
from hutch.images.sources import host_mirror_lines, mirror_lines, parse_deb822, parse_one_line

DEB822 = """\
Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.debian.org/debian/
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main contrib
Enabled: no
"""


def test_parse_deb822() -> None:
    sources = parse_deb822(DEB822)
    assert [(s.uri, s.suite) for s in sources] == [
        ("http://deb.debian.org/debian", "bookworm"),
        ("http://deb.debian.org/debian", "bookworm-updates"),
    ]
    assert sources[0].line() == (
        "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
        "http://deb.debian.org/debian bookworm main"
    )


def test_parse_one_line() -> None:
    text = (
        "# comment\n"
        "deb http://mirror.example/debian bookworm main contrib\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://sec.example/debian-security "
        "bookworm-security main # trailing\n"
        "deb-src http://mirror.example/debian bookworm main\n"
    )
    sources = parse_one_line(text)
    assert [s.line() for s in sources] == [
        "deb http://mirror.example/debian bookworm main contrib",
        "deb [signed-by=/k.gpg] http://sec.example/debian-security bookworm-security main",
    ]


def test_mirror_lines_keep_suite_family_only() -> None:
    sources = parse_one_line(
        "deb http://a/debian bookworm main\n"
        "deb http://a/debian bookworm main\n"
        "deb https://third.party/apt cloud-sdk-bookworm main\n"
        "deb http://a/debian trixie main\n"
        "deb http://a/debian-security bookworm-security main\n"
    )
    assert mirror_lines(sources, "bookworm") == [
        "deb http://a/debian bookworm main",
        "deb http://a/debian-security bookworm-security main",
    ]


def test_host_mirror_lines_reads_both_formats(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text("deb http://b/debian bookworm-updates main\n")
    (tmp_path / "sources.list.d" / "debian.sources").write_text(DEB822)
    (tmp_path / "sources.list.d" / "x.list.disabled").write_text("deb http://c/ bookworm main\n")
    lines = host_mirror_lines("bookworm", tmp_path)
    assert lines[0] == "deb http://b/debian bookworm-updates main"
    assert any(" bookworm main" in line for line in lines)
    assert not any("http://c/" in line for line in lines)


def test_host_without_suite_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "sources.list").write_text("deb http://a/debian trixie main\n")
    with pytest.raises(ImageBuildError, match="no Debian 'bookworm' entry"):
        host_mirror_lines("bookworm", tmp_path)
