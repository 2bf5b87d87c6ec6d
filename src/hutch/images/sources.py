"""Which apt mirrors an image is built from: the host's own sources, made explicit.

mmdebstrap gets the mirror lines on its command line (never "whatever the host has"
implicitly), so a CI machine and a developer machine with the same sources build the
same tree, and the lines are part of the package tree's cache key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from hutch.errors import ImageBuildError

__all__ = ["AptSource", "host_mirror_lines", "mirror_lines", "parse_deb822", "parse_one_line"]


@dataclass(frozen=True)
class AptSource:
    uri: str
    suite: str
    components: tuple[str, ...]
    signed_by: str = ""

    def line(self) -> str:
        opts = f"[signed-by={self.signed_by}] " if self.signed_by else ""
        return f"deb {opts}{self.uri} {self.suite} {' '.join(self.components)}"


def parse_deb822(text: str) -> list[AptSource]:
    """``Types: deb`` entries of a deb822 ``.sources`` file, one per URI x suite.
    Stanzas with ``Enabled: no`` are skipped; comment lines are ignored."""
    out: list[AptSource] = []
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        last = ""
        for line in stanza.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            if line[0] in " \t" and last:
                fields[last] += " " + line.strip()
                continue
            key, sep, value = line.partition(":")
            if sep:
                last = key.strip().lower()
                fields[last] = value.strip()
        if "deb" not in fields.get("types", "").split():
            continue
        if fields.get("enabled", "yes").lower() == "no":
            continue
        for uri in fields.get("uris", "").split():
            for suite in fields.get("suites", "").split():
                out.append(
                    AptSource(
                        uri.rstrip("/"),
                        suite,
                        tuple(fields.get("components", "").split()),
                        fields.get("signed-by", ""),
                    )
                )
    return out


def parse_one_line(text: str) -> list[AptSource]:
    """``deb [opts] uri suite components...`` lines of a ``.list`` file."""
    out: list[AptSource] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line.startswith("deb "):
            continue
        signed_by = ""
        if (m := re.match(r"deb\s+\[([^\]]*)\]\s+(.*)", line)) is not None:
            for opt in m.group(1).split():
                key, _, value = opt.partition("=")
                if key == "signed-by":
                    signed_by = value
            rest = m.group(2).split()
        else:
            rest = line.split()[1:]
        if len(rest) >= 3:
            out.append(AptSource(rest[0].rstrip("/"), rest[1], tuple(rest[2:]), signed_by))
    return out


def mirror_lines(sources: list[AptSource], suite: str) -> list[str]:
    """The lines for ``suite`` and its ``-updates``/``-security`` companions, deduplicated
    in order; third-party repositories (other suites) are left out."""
    wanted = {suite, f"{suite}-updates", f"{suite}-security"}
    lines: list[str] = []
    for src in sources:
        if src.suite in wanted and src.line() not in lines:
            lines.append(src.line())
    return lines


def host_mirror_lines(suite: str, etc_apt: Path = Path("/etc/apt")) -> list[str]:
    """Mirror lines for ``suite`` from the host's apt configuration. Raises
    ``ImageBuildError`` when the host has no source for it."""
    sources: list[AptSource] = []
    main = etc_apt / "sources.list"
    if main.is_file():
        sources += parse_one_line(main.read_text())
    parts = etc_apt / "sources.list.d"
    if parts.is_dir():
        for path in sorted(parts.iterdir()):
            if path.suffix == ".sources":
                sources += parse_deb822(path.read_text())
            elif path.suffix == ".list":
                sources += parse_one_line(path.read_text())
    lines = mirror_lines(sources, suite)
    if not any(f" {suite} " in line for line in lines):
        raise ImageBuildError(
            f"the host's apt sources ({etc_apt}) have no Debian '{suite}' entry; add one "
            "or pass mirrors= to build_image"
        )
    return lines
