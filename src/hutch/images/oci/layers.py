"""Applying OCI layer tars to a directory tree, in order, the way a container runtime's
union of layers would show them (OCI image spec, "Image Layer Filesystem Changeset").

- ``.wh.NAME`` deletes ``NAME`` (and everything under it) from the lower layers;
  ``.wh..wh..opq`` in a directory hides everything the lower layers had in it. A
  whiteout never hides what its own layer adds (spec: whiteouts apply to lower layers
  only), whatever the order of the entries in the tar. Other ``.wh..wh.*`` names are
  aufs bookkeeping and are skipped.
- Regular files, directories, symlinks, hard links, character and block devices and
  FIFOs are created with the tar's numeric owner, mode (setuid/setgid/sticky included),
  modification time and extended attributes (PAX ``SCHILY.xattr.*`` and
  ``LIBARCHIVE.xattr.*``).
- Every path is resolved inside the root: ``..`` that would climb above it is refused,
  and a symlink met on the way is followed *within* the root (an absolute target means
  the root's own ``/``), never into the host. A hard link must name a file inside the
  root. A refused entry raises ``InvalidImage`` naming the layer and the path.

This runs as root on the host, over hostile input: nothing here follows a symlink with
the host's view of the filesystem, and nothing is written outside ``root``.
"""

from __future__ import annotations

import base64
import errno
import os
import shutil
import stat
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, cast

from hutch.errors import ImageBuildError, InvalidImage
from hutch.images.oci.digest import Readable

__all__ = ["MAX_TREE_BYTES", "LayerStats", "TreeApplier", "clean_path"]

WHITEOUT_PREFIX = ".wh."
OPAQUE = ".wh..wh..opq"
_MAX_SYMLINK_HOPS = 40
#: Default cap on the bytes of file content all layers may write (a decompression bomb
#: would otherwise fill the host's disk).
MAX_TREE_BYTES = 64 << 30
_COPY_CHUNK = 1 << 20


@dataclass
class LayerStats:
    entries: int = 0
    bytes: int = 0
    whiteouts: int = 0
    opaque_dirs: int = 0
    hardlinks: int = 0


def clean_path(name: str, what: str) -> tuple[str, ...]:
    """The components of an archive path relative to the root (``/``, ``./`` and ``.``
    dropped, ``..`` folded). ``InvalidImage`` if it climbs above the root or holds NUL."""
    if "\0" in name:
        raise InvalidImage(f"{what}: path {name!r} contains a NUL byte")
    out: list[str] = []
    for part in name.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not out:
                raise InvalidImage(
                    f"{what}: path {name!r} escapes the image root; refusing the layer"
                )
            out.pop()
            continue
        out.append(part)
    return tuple(out)


@dataclass
class _Layer:
    what: str
    written: set[tuple[str, ...]] = field(default_factory=set)
    ancestors: set[tuple[str, ...]] = field(default_factory=set)
    stats: LayerStats = field(default_factory=LayerStats)

    def mark(self, rel: tuple[str, ...]) -> None:
        self.written.add(rel)
        for i in range(len(rel)):
            self.ancestors.add(rel[:i])


class TreeApplier:
    """Applies layers, lowest first, to ``root`` (an empty directory to start with).

    ``max_bytes`` caps the file content written over all layers (``InvalidImage`` past
    it). Directory modification times are set by :meth:`finish`, once nothing will be
    added to them any more.
    """

    def __init__(self, root: Path, max_bytes: int = MAX_TREE_BYTES) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.total_bytes = 0
        self._dir_times: dict[tuple[str, ...], int] = {}

    # -- path resolution inside the root ---------------------------------------------

    def _host(self, rel: tuple[str, ...]) -> Path:
        return self.root.joinpath(*rel) if rel else self.root

    def resolve(
        self, parts: tuple[str, ...], layer: str, *, create: bool, hops: int = 0
    ) -> tuple[str, ...] | None:
        """The real path (components under the root, no symlinks) of the directory
        ``parts``. Missing components are created (0755, root) when ``create``, else
        None is returned; a non-directory on the way is replaced when ``create``."""
        real: list[str] = []
        queue = list(parts)
        while queue:
            part = queue.pop(0)
            if part == "..":
                if real:
                    real.pop()
                continue  # ".." at the root stays at the root, as the kernel does
            if part in ("", "."):
                continue
            here = self._host((*real, part))
            try:
                st = os.lstat(here)
            except FileNotFoundError:
                if not create:
                    return None
                os.mkdir(here, 0o755)
                real.append(part)
                continue
            if stat.S_ISLNK(st.st_mode):
                hops += 1
                if hops > _MAX_SYMLINK_HOPS:
                    raise InvalidImage(
                        f"{layer}: too many levels of symbolic links under /{'/'.join(parts)}"
                    )
                target = os.readlink(here)
                if target.startswith("/"):
                    real = []
                queue = [p for p in target.split("/") if p] + queue
                continue
            if not stat.S_ISDIR(st.st_mode):
                if not create:
                    return None
                os.unlink(here)
                os.mkdir(here, 0o755)
            real.append(part)
        return tuple(real)

    # -- applying one layer ---------------------------------------------------------

    def apply(
        self, tar_stream: Readable, what: str, progress: Callable[[int], None] | None = None
    ) -> LayerStats:
        """Apply the uncompressed layer tar read from ``tar_stream`` (read sequentially).
        ``progress(bytes_written_so_far)`` is called now and then."""
        layer = _Layer(what)
        whiteouts: list[tuple[tuple[str, ...], str]] = []  # (parent parts, name or OPAQUE)
        try:
            with tarfile.open(fileobj=cast(IO[bytes], tar_stream), mode="r|") as tar:
                for member in tar:
                    layer.stats.entries += 1
                    parts = clean_path(member.name, what)
                    name = parts[-1] if parts else ""
                    if name.startswith(WHITEOUT_PREFIX):
                        # Applied after the layer's own entries: they never hide those.
                        if name == OPAQUE:
                            whiteouts.append((parts[:-1], OPAQUE))
                        elif not name.startswith(WHITEOUT_PREFIX * 2):
                            target = name[len(WHITEOUT_PREFIX) :]
                            if target in ("", ".", ".."):
                                raise InvalidImage(f"{what}: whiteout {member.name!r} is invalid")
                            whiteouts.append((parts[:-1], target))
                        continue
                    self._entry(tar, member, parts, layer)
                    if progress is not None and layer.stats.entries % 256 == 0:
                        progress(self.total_bytes)
        except tarfile.TarError as exc:
            raise InvalidImage(f"{what} is truncated or not a tar archive: {exc}") from exc
        except EOFError as exc:
            raise InvalidImage(f"{what} is truncated: {exc}") from exc
        for parent, name in whiteouts:
            self._whiteout(parent, name, layer)
        return layer.stats

    def _entry(
        self,
        tar: tarfile.TarFile,
        member: tarfile.TarInfo,
        parts: tuple[str, ...],
        layer: _Layer,
    ) -> None:
        what = layer.what
        if not parts:  # the root itself ("./"): take its metadata
            if member.isdir():
                self._metadata(self.root, member, what, is_link=False)
                self._dir_times[()] = int(member.mtime)
            return
        parent = self.resolve(parts[:-1], what, create=True)
        assert parent is not None
        rel = (*parent, parts[-1])
        target = self._host(rel)
        try:
            existing: os.stat_result | None = os.lstat(target)
        except FileNotFoundError:
            existing = None
        if existing is not None and not (member.isdir() and stat.S_ISDIR(existing.st_mode)):
            _remove(target, existing)
        if member.isdir():
            if existing is None or not stat.S_ISDIR(existing.st_mode):
                os.mkdir(target, 0o700)
            self._dir_times[rel] = int(member.mtime)
        elif member.isreg():
            self._write_file(tar, member, target, layer)
        elif member.issym():
            os.symlink(member.linkname, target)
        elif member.islnk():
            self._hardlink(member, target, layer)
            layer.mark(rel)
            return  # a hard link shares its source's inode and metadata
        elif member.ischr() or member.isblk():
            kind = stat.S_IFCHR if member.ischr() else stat.S_IFBLK
            os.mknod(target, kind | 0o600, os.makedev(member.devmajor, member.devminor))
        elif member.isfifo():
            os.mkfifo(target, 0o600)
        else:
            raise InvalidImage(
                f"{what}: {member.name!r} has tar type {member.type!r}, which a layer "
                "cannot hold (accepted: file, directory, symlink, hard link, device, fifo)"
            )
        layer.mark(rel)
        self._metadata(target, member, what, is_link=member.issym())

    def _write_file(
        self, tar: tarfile.TarFile, member: tarfile.TarInfo, target: Path, layer: _Layer
    ) -> None:
        self.total_bytes += member.size
        layer.stats.bytes += member.size
        if self.total_bytes > self.max_bytes:
            raise InvalidImage(
                f"{layer.what}: the image's files exceed {self.max_bytes} bytes "
                "(HUTCH_MAX_IMAGE_BYTES); refusing it"
            )
        src = tar.extractfile(member)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            if src is not None:
                while chunk := src.read(_COPY_CHUNK):
                    out.write(chunk)

    def _hardlink(self, member: tarfile.TarInfo, target: Path, layer: _Layer) -> None:
        what = layer.what
        try:
            link_parts = clean_path(member.linkname, what)
        except InvalidImage:
            raise InvalidImage(
                f"{what}: hard link {member.name!r} -> {member.linkname!r} escapes the "
                "image root; refusing the layer"
            ) from None
        if not link_parts:
            raise InvalidImage(f"{what}: hard link {member.name!r} names the root")
        parent = self.resolve(link_parts[:-1], what, create=False)
        source = self._host((*parent, link_parts[-1])) if parent is not None else None
        try:
            st = os.lstat(source) if source is not None else None
        except FileNotFoundError:
            st = None
        if source is None or st is None:
            raise InvalidImage(
                f"{what}: hard link {member.name!r} -> {member.linkname!r}: the target "
                "does not exist in the image"
            )
        if stat.S_ISDIR(st.st_mode):
            raise InvalidImage(
                f"{what}: hard link {member.name!r} -> {member.linkname!r} names a directory"
            )
        os.link(source, target, follow_symlinks=False)
        layer.stats.hardlinks += 1

    def _metadata(self, target: Path, member: tarfile.TarInfo, what: str, is_link: bool) -> None:
        os.lchown(target, member.uid, member.gid)
        for key, value in _xattrs(member).items():
            try:
                os.setxattr(target, key, value, follow_symlinks=False)
            except OSError as exc:
                if is_link and exc.errno in (errno.EPERM, errno.ENOTSUP):
                    continue  # Linux keeps user.* off symlinks; nothing to carry over
                raise ImageBuildError(
                    f"{what}: cannot set extended attribute {key!r} on {member.name!r} "
                    f"in the build directory: {exc.strerror}"
                ) from exc
        if not is_link:
            # After chown, which clears setuid/setgid.
            os.chmod(target, member.mode & 0o7777)
        if not member.isdir():
            os.utime(target, ns=(int(member.mtime) * 10**9,) * 2, follow_symlinks=False)

    def _whiteout(self, parent_parts: tuple[str, ...], name: str, layer: _Layer) -> None:
        parent = self.resolve(parent_parts, layer.what, create=False)
        if parent is None:
            return  # nothing below to hide
        if name == OPAQUE:
            layer.stats.opaque_dirs += 1
            self._prune(parent, layer)
            return
        layer.stats.whiteouts += 1
        rel = (*parent, name)
        if rel in layer.written:
            return
        target = self._host(rel)
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode) and rel in layer.ancestors:
            self._prune(rel, layer)  # keep what this layer put inside
        else:
            _remove(target, st)

    def _prune(self, rel: tuple[str, ...], layer: _Layer) -> None:
        """Remove from directory ``rel`` what this layer did not write."""
        here = self._host(rel)
        for child in os.listdir(here):
            crel = (*rel, child)
            path = here / child
            st = os.lstat(path)
            if crel in layer.written or crel in layer.ancestors:
                if stat.S_ISDIR(st.st_mode):
                    self._prune(crel, layer)
                continue
            _remove(path, st)

    # -- after the last layer -------------------------------------------------------

    def finish(self) -> None:
        """Set directory modification times (deepest first) now that nothing more is
        added to them."""
        for rel in sorted(self._dir_times, key=len, reverse=True):
            path = self._host(rel)
            try:
                if stat.S_ISDIR(os.lstat(path).st_mode):
                    t = self._dir_times[rel] * 10**9
                    os.utime(path, ns=(t, t), follow_symlinks=False)
            except FileNotFoundError:
                continue


def _remove(path: Path, st: os.stat_result) -> None:
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _xattrs(member: tarfile.TarInfo) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for key, value in member.pax_headers.items():
        if key.startswith("SCHILY.xattr."):
            # tarfile decodes PAX values as UTF-8 with surrogateescape: undo it for
            # binary values (security.capability).
            out[key[len("SCHILY.xattr.") :]] = value.encode("utf-8", "surrogateescape")
        elif key.startswith("LIBARCHIVE.xattr."):
            try:
                out[key[len("LIBARCHIVE.xattr.") :]] = base64.b64decode(value + "==")
            except ValueError:
                continue
    return out
