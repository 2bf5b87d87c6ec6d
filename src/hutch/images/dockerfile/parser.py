"""Dockerfile text → raw instructions with their line numbers (pure).

What BuildKit's parser does, for the syntax hutch builds:

- Parser directives at the very top (``# syntax=...``, ``# escape=\\`` or `````,
  ``# check=...``); the first line that is not one (a comment, a blank line, an
  instruction) ends them. ``syntax`` must name the standard frontend
  (``docker/dockerfile``): another one is a different language.
- Comments: lines whose first non-blank character is ``#``, also in the middle of a
  continued instruction; blank lines inside a continuation are skipped.
- Continuations: a line ending with the escape character (trailing blanks allowed) goes
  on with the next one; the escape character is removed and the lines are joined as is.
- An instruction is a keyword (any case) and its arguments; ``--name[=value]`` words at
  the start of the arguments are its flags (quotes removed, as BuildKit does).

Everything is refused with :class:`hutch.errors.InvalidDockerfile` naming the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hutch.contract.limits import DOCKERFILE_MAX_BYTES, DOCKERFILE_MAX_INSTRUCTIONS
from hutch.errors import InvalidDockerfile

__all__ = ["Dockerfile", "Flag", "RawInstruction", "parse"]

_DIRECTIVE = re.compile(r"^#\s*([a-zA-Z][a-zA-Z0-9]*)\s*=\s*(.+?)\s*$")
_KNOWN_DIRECTIVES = ("syntax", "escape", "check")
#: The standard frontend, any version or digest: the language hutch reads.
_STANDARD_SYNTAX = re.compile(
    r"^(?:docker\.io/)?docker/dockerfile(?:-upstream)?(?::[\w.+-]+)?(?:@sha256:[0-9a-f]{64})?$"
)
_COMMENT = re.compile(r"^\s*#")


@dataclass(frozen=True)
class Flag:
    name: str  # without the leading --
    value: str | None  # None: given as a bare --name


@dataclass(frozen=True)
class RawInstruction:
    keyword: str  # upper case
    args: str  # what follows the keyword and its flags, continuations joined
    flags: tuple[Flag, ...]
    line: int  # 1-based, where it starts
    end_line: int
    text: str  # keyword and arguments as written (joined), for messages and listings

    def where(self) -> str:
        if self.line == self.end_line:
            return f"line {self.line}"
        return f"lines {self.line}-{self.end_line}"


@dataclass(frozen=True)
class Dockerfile:
    instructions: tuple[RawInstruction, ...]
    escape: str = "\\"
    syntax: str | None = None


def _fail(line: int, message: str) -> InvalidDockerfile:
    return InvalidDockerfile(f"Dockerfile line {line}: {message}")


def parse(text: str | bytes) -> Dockerfile:
    """Parse a whole Dockerfile. Raises ``InvalidDockerfile``."""
    if isinstance(text, bytes):
        if len(text) > DOCKERFILE_MAX_BYTES:
            raise InvalidDockerfile(
                f"the Dockerfile has {len(text)} bytes; at most {DOCKERFILE_MAX_BYTES}"
            )
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidDockerfile(f"the Dockerfile is not UTF-8 text: {exc}") from exc
    if len(text.encode()) > DOCKERFILE_MAX_BYTES:
        raise InvalidDockerfile(f"the Dockerfile is larger than {DOCKERFILE_MAX_BYTES} bytes")
    if "\0" in text:
        raise InvalidDockerfile("the Dockerfile contains a NUL byte; it must be text")
    text = text.removeprefix("\ufeff")
    lines = text.split("\n")
    escape, syntax, first = _directives(lines)
    continuation = re.compile(re.escape(escape) + r"[ \t]*$")
    out: list[RawInstruction] = []
    i = first
    while i < len(lines):
        raw = lines[i].rstrip("\r")
        i += 1
        start = i  # 1-based line number
        if _COMMENT.match(raw) or not raw.strip():
            continue
        line = raw.lstrip()
        joined, done = _trim_continuation(line, continuation)
        while not done and i < len(lines):
            nxt = lines[i].rstrip("\r")
            i += 1
            if _COMMENT.match(nxt) or not nxt.strip():
                continue
            part, done = _trim_continuation(nxt, continuation)
            joined += part
        if not joined.strip():
            continue
        out.append(_instruction(joined, start, i, escape))
        if len(out) > DOCKERFILE_MAX_INSTRUCTIONS:
            raise _fail(start, f"more than {DOCKERFILE_MAX_INSTRUCTIONS} instructions")
    return Dockerfile(tuple(out), escape, syntax)


def _trim_continuation(line: str, continuation: re.Pattern[str]) -> tuple[str, bool]:
    """(the line without a trailing continuation, whether the instruction ends here)."""
    if continuation.search(line):
        return continuation.sub("", line), False
    return line, True


def _directives(lines: list[str]) -> tuple[str, str | None, int]:
    """(escape character, syntax, index of the first line after the directives)."""
    escape, syntax = "\\", None
    seen: set[str] = set()
    for i, raw in enumerate(lines):
        m = _DIRECTIVE.match(raw.rstrip("\r"))
        if m is None or m.group(1).lower() not in _KNOWN_DIRECTIVES:
            return escape, syntax, i
        name, value = m.group(1).lower(), m.group(2)
        if name in seen:
            raise _fail(i + 1, f"only one {name} parser directive can be used")
        seen.add(name)
        if name == "escape":
            if value not in ("\\", "`"):
                raise _fail(i + 1, f"invalid escape token {value!r}; it must be \\ or `")
            escape = value
        elif name == "syntax":
            if not _STANDARD_SYNTAX.match(value):
                raise _fail(
                    i + 1,
                    f"# syntax={value} names a BuildKit frontend hutch does not run; hutch "
                    "reads the standard Dockerfile syntax (docker/dockerfile, any version)",
                )
            syntax = value
    return escape, syntax, len(lines)


def _instruction(line: str, start: int, end: int, escape: str) -> RawInstruction:
    stripped = line.strip()
    parts = stripped.split(None, 1)
    keyword = parts[0]
    if not re.fullmatch(r"[A-Za-z]+", keyword):
        raise _fail(start, f"{keyword!r} is not an instruction keyword")
    rest = parts[1] if len(parts) > 1 else ""
    flag_words, args = _extract_flags(rest, escape)
    flags = []
    for word in flag_words:
        name, sep, value = word[2:].partition("=")
        if not re.fullmatch(r"[a-z][a-z0-9-]*", name):
            raise _fail(start, f"{keyword.upper()}: {word!r} is not a flag (--name=value)")
        flags.append(Flag(name, value if sep else None))
    return RawInstruction(
        keyword=keyword.upper(),
        args=args,
        flags=tuple(flags),
        line=start,
        end_line=end,
        text=f"{keyword.upper()} {rest}".rstrip(),
    )


def _extract_flags(line: str, escape: str) -> tuple[list[str], str]:
    """The ``--flag`` words at the start of ``line`` (quotes removed) and the rest, as
    written (BuildKit ``extractBuilderFlags``). A bare ``--`` ends the flags."""
    words: list[str] = []
    i, n = 0, len(line)
    while True:
        while i < n and line[i].isspace():
            i += 1
        if i >= n or not line.startswith("--", i):
            return words, line[i:]
        word: list[str] = []
        quote = ""
        while i < n:
            ch = line[i]
            if quote:
                if ch == quote:
                    quote = ""
                    i += 1
                    continue
            elif ch.isspace():
                break
            elif ch in "'\"":
                quote = ch
                i += 1
                continue
            if ch == escape and quote != "'":
                if i + 1 == n:
                    i += 1
                    continue
                i += 1
                ch = line[i]
            word.append(ch)
            i += 1
        text = "".join(word)
        if text == "--":
            return words, line[i:].lstrip()
        words.append(text)
