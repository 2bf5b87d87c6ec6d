"""Image archives as blob sources: ``oci-archive`` (a tar of an OCI image layout),
``docker-archive`` (``docker save``: ``manifest.json`` + config + layer tars) and an
OCI image layout directory.

A source answers three questions, and nothing it returns is trusted: the caller
(:mod:`hutch.images.oci.importer`) verifies every blob against its digest.

- ``top()``: the document to start from (the layout's ``index.json``, or the manifest
  synthesised from ``docker save``'s ``manifest.json``), its media type, and the digest
  it must have if one is known;
- ``open_blob(descriptor)``: a stream of the blob's bytes;
- ``describe()``: where the image came from, for the image record.

An archive is read from a seekable file (the daemon spools an upload to disk first):
tar members are found by name, so the order ``docker save`` or ``tar`` wrote them in does
not matter. A member that is a link is followed inside the archive, as ``docker save``
writes shared layers that way.
"""

from __future__ import annotations

import contextlib
import io
import json
import posixpath
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Protocol

from hutch.errors import InvalidArgument, InvalidImage
from hutch.images.oci.digest import digest_of, parse_digest
from hutch.images.oci.manifest import (
    DOCKER_CONFIG,
    OCI_INDEX,
    OCI_MANIFEST,
    Descriptor,
)

__all__ = [
    "ARCHIVE_FORMATS",
    "BlobSource",
    "DockerArchive",
    "LayoutDir",
    "OciArchive",
    "open_archive",
]

ARCHIVE_FORMATS = ("oci-archive", "docker-archive")
_UNCOMPRESSED_LAYER = "application/vnd.oci.image.layer.v1.tar"
_MAX_DOC = 4 << 20  # index.json / manifest.json / configs are small
_MAX_MEMBERS = 100_000


class BlobSource(Protocol):
    def top(self) -> tuple[bytes, str | None, str | None]:
        """(document, media type or None, digest it must hash to or None)."""

    def open_blob(self, desc: Descriptor) -> contextlib.AbstractContextManager[IO[bytes]]:
        """The blob's raw bytes (``InvalidImage`` if the source lacks it)."""

    def describe(self) -> dict[str, Any]:
        """Where the image comes from, as recorded and listed."""


def _blob_path(digest: str) -> str:
    try:
        d = parse_digest(digest)
    except InvalidArgument as exc:
        raise InvalidImage(exc.message) from None
    return f"blobs/{d.algorithm}/{d.hex}"


def _norm(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name.lstrip("/")


class _Tar:
    """Random access by name to the members of an uncompressed tar file."""

    def __init__(self, path: Path, what: str) -> None:
        self.what = what
        try:
            self.tar = tarfile.open(path, mode="r:")  # noqa: SIM115 - closed by close()
        except tarfile.TarError as exc:
            raise InvalidImage(f"{what} is not a tar archive, or it is truncated: {exc}") from exc
        try:
            self.members = {}
            for member in self.tar:
                self.members[_norm(member.name)] = member
                if len(self.members) > _MAX_MEMBERS:
                    raise InvalidImage(
                        f"{what} has more than {_MAX_MEMBERS} members; an image archive "
                        "holds a few per layer"
                    )
        except tarfile.TarError as exc:
            self.tar.close()
            raise InvalidImage(
                f"{what} is not a readable tar archive (truncated or corrupt?): {exc}"
            ) from exc
        except EOFError as exc:
            self.tar.close()
            raise InvalidImage(f"{what} is truncated: {exc}") from exc
        except BaseException:
            self.tar.close()
            raise

    def close(self) -> None:
        self.tar.close()

    def has(self, name: str) -> bool:
        return _norm(name) in self.members

    def _member(self, name: str) -> tarfile.TarInfo:
        """The member called ``name``, links followed inside the archive."""
        seen = 0
        member = self.members.get(_norm(name))
        while member is not None and (member.issym() or member.islnk()):
            seen += 1
            if seen > 8:
                member = None
                break
            if member.issym():
                target = posixpath.normpath(
                    posixpath.join(posixpath.dirname(_norm(member.name)), member.linkname)
                )
            else:
                target = member.linkname
            member = self.members.get(_norm(target))
        if member is None or not member.isreg():
            raise InvalidImage(f"{self.what} has no file {name!r}; the archive is incomplete")
        return member

    def size(self, name: str) -> int:
        return self._member(name).size

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        member = self._member(name)
        try:
            f = self.tar.extractfile(member)
        except (tarfile.TarError, KeyError) as exc:
            raise InvalidImage(f"{self.what}: {name!r} cannot be read: {exc}") from exc
        if f is None:
            raise InvalidImage(f"{self.what}: {name!r} is not a file")
        with f:
            yield f

    def read(self, name: str, limit: int = _MAX_DOC) -> bytes:
        with self.open(name) as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise InvalidImage(f"{self.what}: {name!r} is larger than {limit} bytes")
        return data


class OciArchive:
    """A tar of an OCI image layout (``oci-layout``, ``index.json``, ``blobs/``)."""

    format = "oci-archive"

    def __init__(self, tar: _Tar, filename: str | None = None) -> None:
        self._tar = tar
        self.filename = filename
        layout = _load_json(tar.read("oci-layout"), f"{tar.what} oci-layout")
        _check_layout(layout, tar.what)

    def close(self) -> None:
        self._tar.close()

    def __enter__(self) -> OciArchive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def top(self) -> tuple[bytes, str | None, str | None]:
        return self._tar.read("index.json"), OCI_INDEX, None

    def open_blob(self, desc: Descriptor) -> contextlib.AbstractContextManager[IO[bytes]]:
        return self._tar.open(_blob_path(desc.digest))

    def describe(self) -> dict[str, Any]:
        return {"type": "archive", "format": self.format, "filename": self.filename}


class DockerArchive:
    """``docker save`` output: ``manifest.json`` naming the config and the layer tars.

    There is no registry manifest in it, so one is synthesised (OCI, uncompressed
    layers, the layer tars' own digests) and the image is addressed by that. The config
    is checked against the image id in its name (``<hex>.json`` or ``blobs/sha256/<hex>``)
    and the layers against the config's ``diff_ids``.
    """

    format = "docker-archive"

    def __init__(self, tar: _Tar, filename: str | None = None) -> None:
        self._tar = tar
        self.filename = filename
        what = tar.what
        entries = json.loads(tar.read("manifest.json")) if tar.has("manifest.json") else None
        if not isinstance(entries, list) or not entries:
            raise InvalidImage(f"{what}: manifest.json is not a list of images")
        if len(entries) != 1:
            tags = [t for e in entries if isinstance(e, dict) for t in e.get("RepoTags") or []]
            raise InvalidImage(
                f"{what} holds {len(entries)} images ({', '.join(tags) or 'untagged'}); "
                "save one image per archive (docker save IMAGE)"
            )
        entry = entries[0]
        config_name = entry.get("Config") if isinstance(entry, dict) else None
        layers = entry.get("Layers") if isinstance(entry, dict) else None
        if not isinstance(config_name, str) or not isinstance(layers, list):
            raise InvalidImage(f"{what}: manifest.json lacks Config or Layers")
        if not all(isinstance(x, str) for x in layers):
            raise InvalidImage(f"{what}: manifest.json Layers is not a list of file names")
        self.repo_tags = [str(t) for t in entry.get("RepoTags") or []]
        self.config = tar.read(config_name)
        self.config_digest = digest_of(self.config)
        stem = Path(_norm(config_name)).name.removesuffix(".json")
        if len(stem) == 64 and stem != self.config_digest.split(":", 1)[1]:
            raise InvalidImage(
                f"{what}: config {config_name!r} hashes to {self.config_digest}; its name "
                "says otherwise (corrupt or tampered with)"
            )
        try:
            diff_ids = json.loads(self.config)["rootfs"]["diff_ids"]
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidImage(f"{what}: config has no rootfs.diff_ids") from exc
        if not isinstance(diff_ids, list) or len(diff_ids) != len(layers):
            raise InvalidImage(
                f"{what}: the config lists {len(diff_ids) if isinstance(diff_ids, list) else 0}"
                f" layers, manifest.json {len(layers)}"
            )
        self._layer_files: dict[str, str] = {}
        descriptors = []
        for name, diff_id in zip(layers, diff_ids, strict=True):
            size = tar.size(name)
            self._layer_files[str(diff_id)] = name
            descriptors.append(
                {"mediaType": _UNCOMPRESSED_LAYER, "digest": str(diff_id), "size": size}
            )
        self.manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": {
                    "mediaType": DOCKER_CONFIG,
                    "digest": self.config_digest,
                    "size": len(self.config),
                },
                "layers": descriptors,
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()

    def close(self) -> None:
        self._tar.close()

    def __enter__(self) -> DockerArchive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def top(self) -> tuple[bytes, str | None, str | None]:
        return self.manifest, OCI_MANIFEST, None

    @contextlib.contextmanager
    def open_blob(self, desc: Descriptor) -> Iterator[IO[bytes]]:
        if desc.digest == self.config_digest:
            yield io.BytesIO(self.config)
            return
        name = self._layer_files.get(desc.digest)
        if name is None:
            raise InvalidImage(f"{self._tar.what} has no blob {desc.digest}")
        with self._tar.open(name) as f:
            yield f

    def describe(self) -> dict[str, Any]:
        return {
            "type": "archive",
            "format": self.format,
            "filename": self.filename,
            "repo_tags": self.repo_tags,
        }


class LayoutDir:
    """An OCI image layout directory on this host."""

    format = "oci-layout"

    def __init__(self, path: Path) -> None:
        self.path = path
        what = f"OCI layout {path}"
        try:
            layout = _load_json((path / "oci-layout").read_bytes(), f"{what} oci-layout")
        except FileNotFoundError:
            raise InvalidImage(f"{what} has no oci-layout file; is it an OCI layout?") from None
        _check_layout(layout, what)

    def top(self) -> tuple[bytes, str | None, str | None]:
        try:
            return (self.path / "index.json").read_bytes(), OCI_INDEX, None
        except FileNotFoundError:
            raise InvalidImage(f"OCI layout {self.path} has no index.json") from None

    @contextlib.contextmanager
    def open_blob(self, desc: Descriptor) -> Iterator[IO[bytes]]:
        blob = self.path / _blob_path(desc.digest)
        try:
            f = blob.open("rb")
        except FileNotFoundError:
            raise InvalidImage(f"OCI layout {self.path} has no blob {desc.digest}") from None
        with f:
            yield f

    def describe(self) -> dict[str, Any]:
        return {"type": "archive", "format": self.format, "filename": self.path.name}


def _load_json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise InvalidImage(f"{what} is not JSON: {exc}") from exc


def _check_layout(layout: Any, what: str) -> None:
    version = layout.get("imageLayoutVersion") if isinstance(layout, dict) else None
    if version != "1.0.0":
        raise InvalidImage(f"{what}: oci-layout version {version!r} is not 1.0.0")


def open_archive(path: Path, filename: str | None = None) -> OciArchive | DockerArchive:
    """Open the archive at ``path``, telling the format from its content (an archive
    with both, as Docker 25+ writes, is read as OCI). ``InvalidImage`` for neither."""
    what = f"archive {filename or path.name}"
    tar = _Tar(path, what)
    try:
        if tar.has("oci-layout") and tar.has("index.json"):
            return OciArchive(tar, filename)
        if tar.has("manifest.json"):
            return DockerArchive(tar, filename)
    except BaseException:
        tar.close()
        raise
    tar.close()
    raise InvalidImage(
        f"{what} is neither an oci-archive (oci-layout + index.json) nor a docker-archive "
        "(manifest.json from `docker save`)"
    )
