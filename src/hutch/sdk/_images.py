"""Importing, pulling and deleting images: the sans-IO part (requests, the NDJSON
progress decoder, archives made from OCI layout directories), shared by both shells
(``_async/client.py`` and the ``_sync`` one generated from it).

An import or pull is sent with ``progress=true``: the daemon answers NDJSON progress
lines, then one ``image`` line (the result) or one ``error`` line (raised as the same
typed error the plain request would have answered with).
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

from hutch.errors import InvalidArgument
from hutch.sdk._core import Call, ClientCore, nothing
from hutch.sdk._errors import ProtocolError, error_for
from hutch.sdk._sandboxes import ImageInfo

__all__ = [
    "ImageCalls",
    "ImageProgress",
    "ImageProgressDecoder",
    "ProgressCallback",
    "archive_chunks",
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


class ImageProgressDecoder:
    """NDJSON → :class:`ImageProgress` items and, last, the :class:`ImageInfo`."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.done = False

    def feed(self, chunk: bytes) -> Sequence[ImageProgress | ImageInfo]:
        self._buffer += chunk
        items: list[ImageProgress | ImageInfo] = []
        while not self.done:
            end = self._buffer.find(b"\n")
            if end < 0:
                break
            line = bytes(self._buffer[:end]).strip()
            del self._buffer[: end + 1]
            if line:
                items.append(self._item(line))
        return items

    def eof(self) -> Sequence[ImageProgress | ImageInfo]:
        rest = bytes(self._buffer).strip()
        self._buffer.clear()
        items = [self._item(rest)] if rest and not self.done else []
        if not self.done:
            raise ProtocolError(
                "the image import stream ended before its result; the daemon may have "
                "restarted (the import may still finish: list the images)"
            )
        return items

    def _item(self, line: bytes) -> ImageProgress | ImageInfo:
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
        if kind == "image":
            self.done = True
            return ImageInfo.from_dict(obj.get("image"))
        if kind == "error":
            self.done = True
            err = obj.get("error") if isinstance(obj.get("error"), dict) else {}
            status = obj.get("status") if isinstance(obj.get("status"), int) else None
            raise error_for(err.get("code"), status, str(err.get("message") or obj))
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
