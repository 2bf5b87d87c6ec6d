"""The ``.dockerignore`` grammar, as Docker reads it (moby/patternmatcher), written once:
the SDK leaves ignored files out of a build context it uploads, and the daemon applies
the same rules to whatever context arrives (a client may send a raw tar).

- One pattern a line; blank lines and lines starting with ``#`` are skipped; blanks
  around a pattern are dropped; the pattern is cleaned like a path (``./a//b/`` is
  ``a/b``) and a leading ``/`` removed (patterns are relative to the context root).
- ``*`` matches any run of characters but ``/``, ``?`` one character but ``/``,
  ``[...]`` a character class, ``\\x`` the character ``x``; ``**`` matches any number
  of directories (also none).
- ``!pattern`` re-includes what an earlier pattern excluded; the last pattern that
  matches a path decides.
- A path is excluded when a pattern matches it or one of its parent directories.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

__all__ = ["IgnoreRules", "parse_dockerignore"]


@dataclass(frozen=True)
class _Pattern:
    text: str
    regex: re.Pattern[str]
    exclusion: bool  # a "!" pattern


def _compile(pattern: str) -> re.Pattern[str]:
    out = ["^"]
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "*":
            if i + 1 < n and pattern[i + 1] == "*":
                i += 2
                if i < n and pattern[i] == "/":
                    i += 1
                out.append(".*" if i >= n else "(?:.*/)?")
                continue
            out.append("[^/]*")
        elif ch == "?":
            out.append("[^/]")
        elif ch == "\\":
            if i + 1 < n:
                i += 1
                out.append(re.escape(pattern[i]))
            else:
                out.append(re.escape("\\"))
        elif ch == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                out.append(re.escape(ch))
            else:
                body = pattern[i + 1 : end]
                if body.startswith("!"):  # also accepted by Go's filepath.Match as "^"
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = end
        else:
            out.append(re.escape(ch))
        i += 1
    out.append("$")
    try:
        return re.compile("".join(out))
    except re.error:
        return re.compile(re.escape(pattern) + "$")


def _clean(pattern: str) -> str:
    cleaned = posixpath.normpath(pattern)
    if len(cleaned) > 1 and cleaned.startswith("/"):
        cleaned = cleaned.lstrip("/") or "."
    return cleaned


class IgnoreRules:
    def __init__(self, patterns: list[str]) -> None:
        self.patterns: list[_Pattern] = []
        for raw in patterns:
            exclusion = raw.startswith("!")
            text = raw[1:].strip() if exclusion else raw
            if not text:
                continue
            cleaned = _clean(text)
            self.patterns.append(_Pattern(cleaned, _compile(cleaned), exclusion))

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def ignored(self, path: str) -> bool:
        """Whether ``path`` (relative to the context root, ``/``-separated) is left out."""
        path = posixpath.normpath(path.lstrip("/"))
        parent = posixpath.dirname(path)
        parents = parent.split("/") if parent else []
        matched = False
        for pattern in self.patterns:
            # An inclusion can only change a path not matched yet, an exclusion only a
            # matched one (what patternmatcher skips).
            if pattern.exclusion != matched:
                continue
            hit = bool(pattern.regex.match(path))
            if not hit:
                for i in range(len(parents)):
                    if pattern.regex.match("/".join(parents[: i + 1])):
                        hit = True
                        break
            if hit:
                matched = not pattern.exclusion
        return matched


def parse_dockerignore(text: str) -> IgnoreRules:
    """The rules of a ``.dockerignore`` file's text."""
    patterns = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        stripped = line.strip()
        if stripped:
            patterns.append(stripped)
    return IgnoreRules(patterns)
