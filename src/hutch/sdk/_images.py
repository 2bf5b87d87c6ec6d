"""Importing, pulling, building and deleting images: the sans-IO part (requests, the
NDJSON progress decoder, archives made from OCI layout directories, build contexts made
from a directory), shared by both shells (``_async/client.py`` and the ``_sync`` one
generated from it).

An import, pull or build is sent with ``progress=true``: the daemon answers NDJSON
progress lines (a build: ``status``, ``step`` and ``output`` lines), then one ``image``
line (the result) or one ``error`` line (raised as the same typed error the plain request
would have answered with).
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from hutch.contract.dockerignore import IgnoreRules, parse_dockerignore
from hutch.errors import InvalidArgument
from hutch.sdk._core import Call, ClientCore, nothing
from hutch.sdk._errors import ProtocolError, error_for
from hutch.sdk._sandboxes import ImageInfo

__all__ = [
    "OUTSIDE_DOCKERFILE",
    "BuildEvent",
    "BuildProgressCallback",
    "ImageCalls",
    "ImageProgress",
    "ImageProgressDecoder",
    "ProgressCallback",
    "archive_chunks",
    "context_chunks",
    "context_dockerfile",
    "filename_of",
]

_CHUNK = 1 << 20


@dataclass(frozen=True)
class ImageProgress:
    """One step of an import: ``stage`` resolving | layer | filesystem | boot | done;
    ``done``/``total``: bytes of the current layer (layer stage)."""

    stage: str
    message: str
    done: int = 0
    total: int | None = None
    layer: int | None = None
    layers: int | None = None


ProgressCallback = Callable[[ImageProgress], None]


@dataclass(frozen=True)
class BuildEvent:
    """One line of a Dockerfile build's progress.

    - ``status``: ``message`` says what the build does now (the base image, the final
      filesystem);
    - ``step``: step ``step`` of ``steps`` (FROM is 1; ``line`` in the Dockerfile,
      ``instruction`` as written) is ``state``: ``running`` (it starts), ``cached`` (its
      layer was reused), ``done`` (it ran, in ``seconds``) or ``config`` (it only changes
      the image's config);
    - ``output``: ``data`` a RUN step wrote on ``stream`` (stdout or stderr).
    """

    type: str
    message: str = ""
    step: int | None = None
    steps: int | None = None
    line: int | None = None
    instruction: str | None = None
    state: str | None = None
    seconds: float | None = None
    stream: str | None = None
    data: str | None = None


BuildProgressCallback = Callable[[BuildEvent], None]


def _int(obj: dict[str, Any], key: str) -> int | None:
    value = obj.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(obj: dict[str, Any], key: str) -> str | None:
    value = obj.get(key)
    return value if isinstance(value, str) else None


class ImageProgressDecoder:
    """NDJSON → :class:`ImageProgress` / :class:`BuildEvent` items and, last, the
    :class:`ImageInfo` (or :attr:`error` set)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.done = False
        #: The stream's ``error`` line, as the typed error: raise it after the items.
        self.error: Exception | None = None

    def feed(self, chunk: bytes) -> Sequence[ImageProgress | BuildEvent | ImageInfo]:
        self._buffer += chunk
        items: list[ImageProgress | BuildEvent | ImageInfo] = []
        while not self.done:
            end = self._buffer.find(b"\n")
            if end < 0:
                break
            line = bytes(self._buffer[:end]).strip()
            del self._buffer[: end + 1]
            item = self._item(line) if line else None
            if item is not None:
                items.append(item)
        return items

    def eof(self) -> Sequence[ImageProgress | BuildEvent | ImageInfo]:
        rest = bytes(self._buffer).strip()
        self._buffer.clear()
        item = self._item(rest) if rest and not self.done else None
        items = [item] if item is not None else []
        if not self.done:
            raise ProtocolError(
                "the image import stream ended before its result; the daemon may have "
                "restarted (the import may still finish: list the images)"
            )
        return items

    def _item(self, line: bytes) -> ImageProgress | BuildEvent | ImageInfo | None:
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ProtocolError(f"image import: not a JSON line: {line[:200]!r}") from exc
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind == "progress":
            return ImageProgress(
                stage=str(obj.get("stage") or ""),
                message=str(obj.get("message") or ""),
                done=int(obj.get("done") or 0),
                total=obj.get("total") if isinstance(obj.get("total"), int) else None,
                layer=obj.get("layer") if isinstance(obj.get("layer"), int) else None,
                layers=obj.get("layers") if isinstance(obj.get("layers"), int) else None,
            )
        if kind in ("status", "step", "output"):
            seconds = obj.get("seconds")
            return BuildEvent(
                type=kind,
                message=str(obj.get("message") or ""),
                step=_int(obj, "step"),
                steps=_int(obj, "steps"),
                line=_int(obj, "line"),
                instruction=_str(obj, "instruction"),
                state=_str(obj, "state"),
                seconds=float(seconds) if isinstance(seconds, int | float) else None,
                stream=_str(obj, "stream"),
                data=_str(obj, "data"),
            )
        if kind == "image":
            self.done = True
            return ImageInfo.from_dict(obj.get("image"))
        if kind == "error":
            # Kept, not raised here: the progress lines read with it are handed out first
            # (a build's last RUN output), then the caller raises it.
            self.done = True
            err = obj.get("error") if isinstance(obj.get("error"), dict) else {}
            status = obj.get("status") if isinstance(obj.get("status"), int) else None
            self.error = error_for(err.get("code"), status, str(err.get("message") or obj))
            return None
        raise ProtocolError(f"image import: unknown event {obj!r}")


def _params(name: str | None, start: bool) -> list[tuple[str, str]]:
    params = [("progress", "true")]
    if name is not None:
        params.append(("name", name))
    if start:
        params.append(("start", "true"))
    return params


class ImageCalls:
    """Builds the image import, pull and delete requests. No I/O. No read timeout on
    imports: a big image can take a while between progress lines (its filesystem)."""

    def __init__(self, core: ClientCore) -> None:
        self.core = core

    def import_request(
        self, name: str, content: Any, *, start: bool = False, filename: str | None = None
    ) -> httpx.Request:
        req = self.core.request(
            "POST", "/v1/images", params=_params(name, start), content=content, read_timeout=None
        )
        req.headers["Content-Type"] = "application/x-tar"
        if filename:
            req.headers["X-Hutch-Filename"] = filename
        return req

    def pull_request(
        self,
        name: str,
        ref: str,
        *,
        username: str | None = None,
        password: str | None = None,
        token: str | None = None,
        start: bool = False,
    ) -> httpx.Request:
        if (username is None) != (password is None):
            raise InvalidArgument("give both username and password, or neither")
        body: dict[str, Any] = {"name": name, "ref": ref, "start": start}
        for key, value in (("username", username), ("password", password), ("token", token)):
            if value is not None:
                body[key] = value
        return self.core.request(
            "POST", "/v1/images", params=_params(None, False), json_body=body, read_timeout=None
        )

    def build_request(
        self,
        name: str,
        content: Any,
        *,
        dockerfile: str = "Dockerfile",
        build_args: dict[str, str] | None = None,
        egress: Sequence[str] | None = None,
        network: str | None = None,
        vcpus: int | None = None,
        memory_mib: int | None = None,
        disk_gib: int | None = None,
        timeout_s: int | None = None,
        no_cache: bool = False,
        start: bool = False,
        filename: str | None = None,
    ) -> httpx.Request:
        """``POST /v1/images?dockerfile=...``: ``content`` is the context tar."""
        params = _params(name, start)
        params.append(("dockerfile", dockerfile))
        for key, value in (build_args or {}).items():
            if not isinstance(key, str) or not key or "=" in key:
                raise InvalidArgument(f"build arg name {key!r} must be a non-empty name without =")
            params.append(("build_arg", f"{key}={value}"))
        params.extend(("egress", rule) for rule in egress or ())
        for key, number in (("vcpus", vcpus), ("memory_mib", memory_mib),
                            ("disk_gib", disk_gib), ("timeout_s", timeout_s)):  # fmt: skip
            if number is not None:
                params.append((key, str(number)))
        if network is not None:
            params.append(("network", network))
        if no_cache:
            params.append(("no_cache", "true"))
        req = self.core.request(
            "POST", "/v1/images", params=params, content=content, read_timeout=None
        )
        req.headers["Content-Type"] = "application/x-tar"
        if filename:
            req.headers["X-Hutch-Filename"] = filename
        return req

    def delete(self, name: str) -> Call[None]:
        if not isinstance(name, str) or not name:
            raise InvalidArgument("image name must be a non-empty string")
        return Call(self.core.request("DELETE", f"/v1/images/{quote(name, safe='')}"), nothing)


class _Sink(io.RawIOBase):
    """Where tarfile writes; the bytes are taken out chunk by chunk."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.buffer += data
        return len(data)


def _layout_tar(root: Path) -> Iterator[bytes]:
    """An oci-archive of the layout directory ``root``, made as it is sent."""
    if not (root / "oci-layout").is_file() or not (root / "index.json").is_file():
        raise InvalidArgument(
            f"{root} is a directory but not an OCI image layout (no oci-layout or index.json)"
        )
    sink = _Sink()
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                path = Path(dirpath) / name
                tar.add(path, arcname=str(path.relative_to(root)), recursive=False)
                if len(sink.buffer) >= _CHUNK:
                    yield bytes(sink.buffer)
                    sink.buffer.clear()
    if sink.buffer:
        yield bytes(sink.buffer)


def _file_chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


def archive_chunks(source: str | os.PathLike[str] | bytes | Iterable[bytes]) -> Iterable[bytes]:
    """The body of an import: an archive file (oci-archive or docker-archive, maybe
    gzip-compressed), an OCI layout directory (sent as an oci-archive), bytes, or an
    iterable of byte chunks."""
    if isinstance(source, bytes | bytearray):
        return [bytes(source)]
    if isinstance(source, str | os.PathLike):
        path = Path(source)
        if path.is_dir():
            return _layout_tar(path)
        if not path.is_file():
            raise InvalidArgument(f"{path} is not a file or directory")
        return _file_chunks(path)
    return source


def filename_of(source: object) -> str | None:
    """The name the daemon records for an archive given as a path."""
    if isinstance(source, str | os.PathLike):
        return os.path.basename(os.fspath(source))
    return None


#: Where a Dockerfile from outside the context directory goes in the context tar.
OUTSIDE_DOCKERFILE = ".hutch/Dockerfile"


def context_dockerfile(
    context: Path, dockerfile: str | os.PathLike[str] | None
) -> tuple[str, Path]:
    """(the Dockerfile's name in the context tar, its path here). ``dockerfile``: a path
    (relative to the working directory, as ``docker build -f``) or None for
    ``context/Dockerfile``; one outside the context is sent as :data:`OUTSIDE_DOCKERFILE`."""
    path = Path(dockerfile) if dockerfile is not None else context / "Dockerfile"
    if not path.is_file():
        raise InvalidArgument(f"no Dockerfile at {str(path)!r}; give its path with -f/dockerfile=")
    try:
        return path.resolve().relative_to(context.resolve()).as_posix(), path
    except ValueError:
        return OUTSIDE_DOCKERFILE, path


def _ignore_rules(context: Path) -> IgnoreRules:
    ignore = context / ".dockerignore"
    if ignore.is_file():
        return parse_dockerignore(ignore.read_text(encoding="utf-8", errors="replace"))
    return IgnoreRules([])


def context_chunks(
    context: str | os.PathLike[str], dockerfile: tuple[str, Path]
) -> Iterator[bytes]:
    """The build context ``context`` (a directory) as a tar, made as it is sent: what
    ``.dockerignore`` names is left out (the daemon applies it again to what arrives), the
    Dockerfile and ``.dockerignore`` are always in. Symlinks are sent as links; files
    that are neither regular, directory nor link are skipped."""
    root = Path(context)
    if not root.is_dir():
        raise InvalidArgument(f"build context {str(root)!r} is not a directory")
    rules = _ignore_rules(root)
    # A "!" pattern can re-include something below an ignored directory: walk it then.
    prune = not any(p.exclusion for p in rules.patterns)
    keep = {".dockerignore", dockerfile[0]}
    sent_dockerfile = False
    sink = _Sink()
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            here = Path(dirpath)
            rel_dir = here.relative_to(root).as_posix()
            dirnames.sort()
            for d in list(dirnames):
                rel = d if rel_dir == "." else f"{rel_dir}/{d}"
                full = here / d
                if full.is_symlink():
                    dirnames.remove(d)
                    filenames.append(d)  # sent as a link, never followed
                elif rules.ignored(rel):
                    if prune:
                        dirnames.remove(d)
                else:
                    tar.add(full, arcname=rel, recursive=False)
            for name in sorted(filenames):
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                full = here / name
                if rel not in keep and rules.ignored(rel):
                    continue
                if not (full.is_symlink() or full.is_file()):
                    continue
                tar.add(full, arcname=rel, recursive=False)
                sent_dockerfile = sent_dockerfile or rel == dockerfile[0]
                if len(sink.buffer) >= _CHUNK:
                    yield bytes(sink.buffer)
                    sink.buffer.clear()
        if not sent_dockerfile:  # outside the context, or in a directory left out
            tar.add(dockerfile[1], arcname=dockerfile[0], recursive=False)
    if sink.buffer:
        yield bytes(sink.buffer)
