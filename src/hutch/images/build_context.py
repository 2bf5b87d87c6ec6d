"""A build context: the uploaded tar, read in place (never unpacked on the host).

The context comes from the client: its member names are checked (no absolute paths, no
``..``), parents it does not list are implied directories, hard links become copies of
their target, and ``.dockerignore`` (at the root) removes what it names
(:mod:`hutch.contract.dockerignore`). COPY and ADD sources are resolved against it as
Docker does:

- a path follows symlinks *inside* the context (an absolute target or ``..`` past the
  root stays at the root, like Docker's FollowSymlinkInScope), also its last part;
- ``*``, ``?`` and ``[...]`` are wildcards (``*`` does not cross ``/``);
- a directory source stands for its content; a file source for itself; for ADD a file
  that is a tar archive (plain, gzip, bzip2 or xz: detected by content, not by name) is
  unpacked.

:meth:`BuildContext.digest` is what a COPY's cache key covers (names, types, modes,
sizes, content hashes, link targets; not times, as in Docker); :func:`copy_stream` is the
tar sent to the build sandbox, whose script (``guest_files/build_step.py``) lays it out.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import lzma
import posixpath
import re
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from hutch.contract.dockerignore import IgnoreRules, parse_dockerignore
from hutch.errors import InvalidArgument, InvalidDockerfile

__all__ = [
    "MAX_CONTEXT_MEMBERS",
    "BuildContext",
    "ContextEntry",
    "Source",
    "copy_stream",
]

#: Members a context may have (a tar of millions of empty files is a way to burn time).
MAX_CONTEXT_MEMBERS = 500_000
_DOCKERIGNORE_MAX = 1 << 20
_CHUNK = 1 << 20
_GLOB = re.compile(r"[*?\[]")
_SYMLINK_HOPS = 40


@dataclass(frozen=True)
class ContextEntry:
    path: str  # relative to the root, normalized; "." is the root
    kind: Literal["file", "dir", "symlink", "special"]
    mode: int  # permission bits (with setuid/setgid/sticky)
    size: int = 0
    mtime: float = 0.0
    linkname: str = ""  # a symlink's target, as written
    member: tarfile.TarInfo | None = None  # where a file's bytes are (hard links resolved)


@dataclass(frozen=True)
class Source:
    """One resolved COPY/ADD source: a file, a directory's content or (ADD) an archive
    to unpack. ``name`` is the base name it is copied as; ``root`` its path."""

    kind: Literal["file", "dir", "archive"]
    name: str
    root: ContextEntry
    entries: tuple[ContextEntry, ...]  # a directory's content (relative order kept)


def _normalize(name: str) -> str | None:
    """A member name as a clean relative path; None if it climbs out of the root."""
    if name.startswith("/"):
        return None
    parts: list[str] = []
    for part in name.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            return None
        parts.append(part)
    return "/".join(parts) or "."


def _glob(pattern: str) -> re.Pattern[str]:
    out = []
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "*":
            out.append("[^/]*")
        elif ch == "?":
            out.append("[^/]")
        elif ch == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        elif ch == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                out.append(re.escape(ch))
            else:
                body = pattern[i + 1 : end]
                body = "^" + body[1:] if body.startswith("!") else body
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = end
        else:
            out.append(re.escape(ch))
        i += 1
    try:
        return re.compile("".join(out) + r"\Z")
    except re.error:
        return re.compile(re.escape(pattern) + r"\Z")


def _is_tar(head: bytes) -> bool:
    if len(head) < 512:
        return False
    try:
        tarfile.TarInfo.frombuf(head[:512], "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return False
    return True


class BuildContext:
    """The context tar at ``path`` (plain tar; the caller decompresses). Use as a
    context manager, or call :meth:`close`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._tar = tarfile.open(path, mode="r:")  # noqa: SIM115 - closed in close()
        except (tarfile.TarError, OSError) as exc:
            raise InvalidArgument(f"the build context is not a tar archive: {exc}") from exc
        try:
            self.entries: dict[str, ContextEntry] = {}
            self._index()
            self.ignore = self._dockerignore()
            self.ignored: set[str] = set()
            if self.ignore:
                self._apply_ignore()
        except BaseException:
            self._tar.close()
            raise

    def __enter__(self) -> BuildContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._tar.close()

    # -- reading the tar --------------------------------------------------------------

    def _index(self) -> None:
        self.entries["."] = ContextEntry(".", "dir", 0o755)
        count = 0
        while True:
            try:
                member = self._tar.next()
            except tarfile.TarError as exc:
                raise InvalidArgument(f"the build context tar is corrupt: {exc}") from exc
            if member is None:
                break
            count += 1
            if count > MAX_CONTEXT_MEMBERS:
                raise InvalidArgument(
                    f"the build context has more than {MAX_CONTEXT_MEMBERS} members; leave "
                    "files out with .dockerignore"
                )
            path = _normalize(member.name)
            if path is None or "\0" in member.name:
                raise InvalidArgument(
                    f"the build context has a member {member.name!r} outside its root "
                    "(absolute, or with ..); send paths relative to the context"
                )
            mode = member.mode & 0o7777
            if member.isdir():
                entry = ContextEntry(path, "dir", mode, mtime=member.mtime)
            elif member.isreg():
                entry = ContextEntry(path, "file", mode, member.size, member.mtime, "", member)
            elif member.issym():
                entry = ContextEntry(path, "symlink", 0o777, mtime=member.mtime,
                                     linkname=member.linkname)  # fmt: skip
            elif member.islnk():
                target = _normalize(member.linkname)
                found = self.entries.get(target or "")
                if found is None or found.kind != "file":
                    raise InvalidArgument(
                        f"the build context's hard link {member.name!r} points to "
                        f"{member.linkname!r}, which is not a file earlier in the archive"
                    )
                entry = ContextEntry(path, "file", mode, found.size, member.mtime, "",
                                     found.member)  # fmt: skip
            else:
                entry = ContextEntry(path, "special", mode, mtime=member.mtime)
            if path == ".":
                if entry.kind == "dir":
                    self.entries["."] = entry
                continue
            self._add_parents(path)
            self.entries[path] = entry

    def _add_parents(self, path: str) -> None:
        parent = posixpath.dirname(path)
        while parent and parent not in self.entries:
            self.entries[parent] = ContextEntry(parent, "dir", 0o755)
            parent = posixpath.dirname(parent)

    def _dockerignore(self) -> IgnoreRules:
        entry = self.entries.get(".dockerignore")
        if entry is None or entry.kind != "file":
            return IgnoreRules([])
        if entry.size > _DOCKERIGNORE_MAX:
            raise InvalidArgument(f".dockerignore is larger than {_DOCKERIGNORE_MAX} bytes")
        return parse_dockerignore(self.read(entry).decode("utf-8", "replace"))

    def _apply_ignore(self) -> None:
        for path in list(self.entries):
            if path != "." and self.ignore.ignored(path):
                self.ignored.add(path)
                del self.entries[path]
        # What a re-included file needs: its directories.
        for path in list(self.entries):
            if path != ".":
                self._add_parents(path)

    def read(self, entry: ContextEntry, limit: int | None = None) -> bytes:
        with self.open(entry) as f:
            return f.read(-1 if limit is None else limit)

    def open(self, entry: ContextEntry) -> IO[bytes]:
        if entry.member is None:
            return io.BytesIO(b"")
        f = self._tar.extractfile(entry.member)
        if f is None:  # pragma: no cover - regular members always have data
            return io.BytesIO(b"")
        return f

    def dockerfile(self, path: str) -> bytes:
        """The Dockerfile at ``path`` in the context (read even if .dockerignore lists
        it, as Docker does). ``InvalidArgument`` when it is missing."""
        norm = _normalize(path)
        entry = self._lookup_any(norm) if norm else None
        if entry is None or entry.kind != "file":
            raise InvalidArgument(
                f"the build context has no Dockerfile at {path!r}; send it in the context "
                "tar and name it with dockerfile="
            )
        if entry.size > (1 << 20):
            raise InvalidArgument(f"the Dockerfile {path!r} is larger than 1 MiB")
        return self.read(entry)

    def _lookup_any(self, path: str) -> ContextEntry | None:
        """An entry by exact path, ignored or not (the Dockerfile)."""
        found = self.entries.get(path)
        if found is not None:
            return found
        for member in self._tar.getmembers():
            if _normalize(member.name) == path and member.isreg():
                return ContextEntry(path, "file", member.mode & 0o7777, member.size,
                                    member.mtime, "", member)  # fmt: skip
        return None

    # -- resolving sources ------------------------------------------------------------

    def resolve(self, path: str) -> ContextEntry | None:
        """The entry at ``path`` with symlinks followed inside the context (also the
        last part); None if there is none."""
        parts = [p for p in path.split("/") if p not in ("", ".")]
        current: list[str] = []
        hops = 0
        while parts:
            part = parts.pop(0)
            if part == "..":
                if current:
                    current.pop()
                continue
            candidate = "/".join([*current, part])
            entry = self.entries.get(candidate)
            if entry is None:
                return None
            if entry.kind == "symlink":
                hops += 1
                if hops > _SYMLINK_HOPS:
                    return None
                target = entry.linkname
                if target.startswith("/"):
                    current = []
                parts = [p for p in target.split("/") if p not in ("", ".")] + parts
                continue
            if entry.kind != "dir" and parts:
                return None
            current.append(part)
        return self.entries.get("/".join(current) or ".")

    def sources(self, ins_where: str, keyword: str, written: str, add: bool) -> list[Source]:
        """The sources one COPY/ADD argument (``written``: normalized relative path or
        wildcard) stands for. ``InvalidDockerfile`` naming the line when nothing
        matches, or a source is a device or FIFO."""
        if _GLOB.search(written):
            regex = _glob(written)
            matches = sorted(p for p in self.entries if p != "." and regex.match(p))
            if not matches:
                raise InvalidDockerfile(
                    f"Dockerfile {ins_where}: {keyword}: {written!r} matches no file in the "
                    "build context" + self._ignored_hint(written)
                )
            out = []
            for path in matches:
                entry = self.resolve(path)
                if entry is None:
                    raise InvalidDockerfile(
                        f"Dockerfile {ins_where}: {keyword}: {path!r} is a symlink to "
                        "nothing in the build context"
                    )
                out.append(self._source(ins_where, keyword, entry, path, add))
            return out
        entry = self.resolve(written)
        if entry is None:
            raise InvalidDockerfile(
                f"Dockerfile {ins_where}: {keyword}: {written!r} not found in the build "
                "context" + self._ignored_hint(written)
            )
        return [self._source(ins_where, keyword, entry, written, add)]

    def _ignored_hint(self, written: str) -> str:
        regex = _glob(written) if _GLOB.search(written) else None
        for path in self.ignored:
            if path == written or (regex is not None and regex.match(path)):
                return " (.dockerignore excludes it)"
        return ""

    def _source(
        self, where: str, keyword: str, entry: ContextEntry, written: str, add: bool
    ) -> Source:
        name = posixpath.basename(written.rstrip("/")) or "."
        if entry.kind == "special":
            raise InvalidDockerfile(
                f"Dockerfile {where}: {keyword}: {written!r} is a device, socket or FIFO; "
                "only files, directories and symlinks are copied"
            )
        if entry.kind == "dir":
            prefix = "" if entry.path == "." else entry.path + "/"
            inside = []
            for path in sorted(self.entries):
                if path == "." or not path.startswith(prefix) or path == entry.path:
                    continue
                child = self.entries[path]
                if child.kind == "special":
                    raise InvalidDockerfile(
                        f"Dockerfile {where}: {keyword}: {path!r} in the build context is a "
                        "device, socket or FIFO; leave it out with .dockerignore"
                    )
                inside.append(child)
            return Source("dir", name, entry, tuple(inside))
        if add and self._is_archive(entry):
            return Source("archive", name, entry, ())
        return Source("file", name, entry, ())

    def _is_archive(self, entry: ContextEntry) -> bool:
        """A tar, plain or compressed with gzip, bzip2 or xz: what ADD unpacks."""
        head = self.read(entry, 1024)
        decompress: dict[bytes, Callable[[IO[bytes]], Any]] = {
            b"\x1f\x8b": lambda f: gzip.GzipFile(fileobj=f),
            b"BZh": bz2.BZ2File,
            b"\xfd7zXZ\x00": lzma.LZMAFile,
        }
        for magic, opener in decompress.items():
            if head.startswith(magic):
                try:
                    with self.open(entry) as raw, opener(raw) as plain:
                        return _is_tar(plain.read(512))
                except (OSError, EOFError, lzma.LZMAError):
                    return False
        return _is_tar(head)

    # -- digests ------------------------------------------------------------------------

    def file_sha256(self, entry: ContextEntry) -> str:
        h = hashlib.sha256()
        with self.open(entry) as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        return h.hexdigest()

    def digest(self, sources: list[Source]) -> str:
        """What a COPY/ADD's cache key covers of the files it copies."""
        h = hashlib.sha256()
        for i, src in enumerate(sources):
            h.update(f"source\0{i}\0{src.kind}\0{src.name}\0".encode())
            items = (src.root,) if src.kind != "dir" else (src.root, *src.entries)
            for entry in items:
                rel = entry.path
                h.update(f"{rel}\0{entry.kind}\0{entry.mode:o}\0{entry.size}\0".encode())
                if entry.kind == "file":
                    h.update(self.file_sha256(entry).encode())
                elif entry.kind == "symlink":
                    h.update(entry.linkname.encode("utf-8", "surrogateescape"))
                h.update(b"\n")
        return "sha256:" + h.hexdigest()


def _relative(src: Source, entry: ContextEntry) -> str:
    if src.root.path == ".":
        return entry.path
    return entry.path[len(src.root.path) + 1 :]


def copy_stream(ctx: BuildContext, sources: list[Source]) -> Iterator[bytes]:
    """The tar the guest unpacks for one COPY/ADD: member ``<i>/<name>`` for file and
    archive sources, ``<i>/<path inside>`` for a directory's content (``<i>`` the source's
    index), with modes and times; owners are the guest's business (--chown, else root).
    Written as it is sent: a big file is never held in memory."""
    for i, src in enumerate(sources):
        if src.kind == "dir":
            items = [(f"{i}/{_relative(src, e)}", e) for e in src.entries]
        else:
            items = [(f"{i}/{src.name}", src.root)]
        for name, entry in items:
            info = tarfile.TarInfo(name)
            info.mode = entry.mode
            info.mtime = int(entry.mtime)
            if entry.kind == "dir":
                info.type = tarfile.DIRTYPE
            elif entry.kind == "symlink":
                info.type = tarfile.SYMTYPE
                info.linkname = entry.linkname
            else:
                info.type = tarfile.REGTYPE
                info.size = entry.size
            yield info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
            if info.type == tarfile.REGTYPE:
                sent = 0
                with ctx.open(entry) as data:
                    while sent < entry.size and (
                        chunk := data.read(min(_CHUNK, entry.size - sent))
                    ):
                        sent += len(chunk)
                        yield chunk
                if sent != entry.size:
                    raise InvalidArgument(
                        f"the build context's {entry.path!r} is shorter than its tar header says"
                    )
                if entry.size % tarfile.BLOCKSIZE:
                    yield b"\0" * (tarfile.BLOCKSIZE - entry.size % tarfile.BLOCKSIZE)
    yield b"\0" * (2 * tarfile.BLOCKSIZE)
