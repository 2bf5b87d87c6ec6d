"""OCI image manifests, indexes and configs, and their Docker v2 schema 2 twins (pure).

- An *index* (OCI ``image.index``, Docker ``manifest.list``) names one manifest per
  platform; :func:`select_platform` picks ``linux/amd64`` (the only one hutch boots) and
  refuses an index without it, listing what it has.
- A *manifest* names the config blob and the layers, in order (lowest first).
- The *config* carries the platform (checked again: a manifest may be single-platform
  for another architecture), ``rootfs.diff_ids`` (digests of the uncompressed layers, also
  verified) and the defaults a sandbox takes: ``Env``, ``WorkingDir``, ``User``,
  ``Entrypoint``, ``Cmd``, ``ExposedPorts``.

Every parser raises ``InvalidImage`` naming the field that is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hutch.errors import InvalidArgument, InvalidImage
from hutch.images.oci.digest import parse_digest

__all__ = [
    "ACCEPT_MANIFESTS",
    "Descriptor",
    "ImageConfig",
    "Index",
    "Manifest",
    "parse_config",
    "parse_index",
    "parse_manifest",
    "parse_manifest_or_index",
    "select_platform",
]

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_SCHEMA1 = (
    "application/vnd.docker.distribution.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v1+prettyjws",
)

INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
CONFIG_TYPES = (OCI_CONFIG, DOCKER_CONFIG)

#: Layer media types and how each is compressed. Foreign (non-distributable) layers are
#: the same tars, under another name.
LAYER_TYPES: dict[str, str] = {
    "application/vnd.oci.image.layer.v1.tar": "none",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar": "none",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar": "none",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip": "gzip",
}

#: The ``Accept`` header of a manifest request: everything this module parses.
ACCEPT_MANIFESTS = ", ".join((*MANIFEST_TYPES, *INDEX_TYPES))

PLATFORM = ("linux", "amd64")
_MAX_LAYERS = 256  # far above any real image; keeps a hostile manifest bounded


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: tuple[str, str, str | None] | None = None  # (os, architecture, variant)
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def compression(self) -> str:
        return LAYER_TYPES[self.media_type]


@dataclass(frozen=True)
class Manifest:
    media_type: str
    config: Descriptor
    layers: tuple[Descriptor, ...]


@dataclass(frozen=True)
class Index:
    media_type: str
    manifests: tuple[Descriptor, ...]


@dataclass(frozen=True)
class ImageConfig:
    """What hutch takes from an image config (``config`` of the OCI image spec)."""

    os: str
    architecture: str
    diff_ids: tuple[str, ...]
    env: dict[str, str]
    working_dir: str | None
    user: str | None
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    exposed_ports: tuple[str, ...]  # "8080/tcp", sorted
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def start_command(self) -> tuple[str, ...]:
        """Entrypoint followed by Cmd, as a container runtime would run it."""
        return (*self.entrypoint, *self.cmd)

    def to_dict(self) -> dict[str, Any]:
        return {
            "env": dict(self.env),
            "working_dir": self.working_dir,
            "user": self.user,
            "entrypoint": list(self.entrypoint),
            "cmd": list(self.cmd),
            "exposed_ports": list(self.exposed_ports),
            "labels": dict(self.labels),
        }


def _load(data: bytes, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidImage(f"{what} is not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise InvalidImage(f"{what} is not a JSON object")
    return obj


def _descriptor(obj: Any, what: str) -> Descriptor:
    if not isinstance(obj, dict):
        raise InvalidImage(f"{what} is not a descriptor object")
    media_type = obj.get("mediaType")
    digest = obj.get("digest")
    size = obj.get("size")
    if not isinstance(media_type, str) or not media_type:
        raise InvalidImage(f"{what} has no mediaType")
    try:
        parse_digest(digest)
    except InvalidArgument as exc:
        raise InvalidImage(f"{what}: {exc.message}") from None
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InvalidImage(f"{what}: size {size!r} is not a byte count")
    platform = None
    raw_platform = obj.get("platform")
    if isinstance(raw_platform, dict):
        platform = (
            str(raw_platform.get("os", "")),
            str(raw_platform.get("architecture", "")),
            str(raw_platform["variant"]) if raw_platform.get("variant") else None,
        )
    annotations = obj.get("annotations") or {}
    if not isinstance(annotations, dict):
        annotations = {}
    return Descriptor(
        media_type=media_type,
        digest=str(digest),
        size=size,
        platform=platform,
        annotations={str(k): str(v) for k, v in annotations.items()},
    )


def _media_type(obj: dict[str, Any], declared: str | None) -> str | None:
    inner = obj.get("mediaType")
    return inner if isinstance(inner, str) and inner else declared


def parse_manifest_or_index(data: bytes, declared: str | None, what: str) -> Manifest | Index:
    """Parse ``data`` as whichever it is. ``declared``: the Content-Type or descriptor
    media type (the OCI types may leave ``mediaType`` out of the document itself)."""
    obj = _load(data, what)
    kind = _media_type(obj, declared)
    if kind in DOCKER_SCHEMA1 or obj.get("schemaVersion") == 1:
        raise InvalidImage(
            f"{what} is a Docker schema 1 manifest, which hutch does not read; "
            "push the image again with a current client (schema 2 or OCI)"
        )
    if kind in INDEX_TYPES or (kind is None and "manifests" in obj):
        return _index(obj, kind or OCI_INDEX, what)
    if kind in MANIFEST_TYPES or (kind is None and "layers" in obj):
        return _manifest(obj, kind or OCI_MANIFEST, what)
    raise InvalidImage(
        f"{what} has media type {kind!r}; accepted: {', '.join((*MANIFEST_TYPES, *INDEX_TYPES))}"
    )


def parse_manifest(data: bytes, declared: str | None, what: str) -> Manifest:
    parsed = parse_manifest_or_index(data, declared, what)
    if not isinstance(parsed, Manifest):
        raise InvalidImage(f"{what} is an index, where an image manifest was expected")
    return parsed


def parse_index(data: bytes, what: str) -> Index:
    parsed = parse_manifest_or_index(data, OCI_INDEX, what)
    if not isinstance(parsed, Index):
        raise InvalidImage(f"{what} is an image manifest, where an index was expected")
    return parsed


def _index(obj: dict[str, Any], kind: str, what: str) -> Index:
    if obj.get("schemaVersion") != 2:
        raise InvalidImage(f"{what}: schemaVersion {obj.get('schemaVersion')!r} is not 2")
    raw = obj.get("manifests")
    if not isinstance(raw, list):
        raise InvalidImage(f"{what} has no manifests list")
    return Index(
        media_type=kind,
        manifests=tuple(_descriptor(m, f"{what} manifests[{i}]") for i, m in enumerate(raw)),
    )


def _manifest(obj: dict[str, Any], kind: str, what: str) -> Manifest:
    if obj.get("schemaVersion") != 2:
        raise InvalidImage(f"{what}: schemaVersion {obj.get('schemaVersion')!r} is not 2")
    config = _descriptor(obj.get("config"), f"{what} config")
    if config.media_type not in CONFIG_TYPES:
        raise InvalidImage(
            f"{what}: config media type {config.media_type!r} is not an image config "
            f"({', '.join(CONFIG_TYPES)}); this is not a container image (an artifact?)"
        )
    raw_layers = obj.get("layers")
    if not isinstance(raw_layers, list):
        raise InvalidImage(f"{what} has no layers list")
    if len(raw_layers) > _MAX_LAYERS:
        raise InvalidImage(f"{what} has {len(raw_layers)} layers; at most {_MAX_LAYERS}")
    layers = tuple(_descriptor(m, f"{what} layers[{i}]") for i, m in enumerate(raw_layers))
    for i, layer in enumerate(layers):
        if layer.media_type not in LAYER_TYPES:
            raise InvalidImage(
                f"{what} layers[{i}] has media type {layer.media_type!r}; accepted: "
                f"{', '.join(LAYER_TYPES)}"
            )
    return Manifest(media_type=kind, config=config, layers=layers)


def _platform_name(p: tuple[str, str, str | None] | None) -> str:
    if p is None:
        return "unknown"
    return "/".join(x for x in p if x)


def select_platform(index: Index, what: str) -> Descriptor:
    """The ``linux/amd64`` image manifest of ``index``; ``InvalidImage`` listing the
    platforms it has otherwise. Attestation manifests (``unknown/unknown``) are skipped."""
    candidates = [
        d
        for d in index.manifests
        if d.platform is not None and d.platform[:2] == PLATFORM and d.media_type != OCI_INDEX
    ]
    if candidates:
        # "v1"-less first: amd64 variants (v2, v3) are optional extras.
        candidates.sort(key=lambda d: d.platform[2] is not None if d.platform else True)
        return candidates[0]
    unplatformed = [d for d in index.manifests if d.platform is None]
    if len(unplatformed) == 1 and len(index.manifests) == 1:
        return unplatformed[0]  # an OCI layout's one manifest: checked by its config
    have = sorted(
        {
            _platform_name(d.platform)
            for d in index.manifests
            if d.platform is None or d.platform[0] != "unknown"
        }
    )
    raise InvalidImage(
        f"{what} has no linux/amd64 image (it has: {', '.join(have) or 'nothing'}); "
        "hutch boots x86-64 Linux guests only: pull or import an amd64 build"
    )


def _str_list(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidImage(f"image config {what} is not a list of strings")
    return tuple(value)


def parse_config(data: bytes, what: str = "image config") -> ImageConfig:
    """Parse and check the config: ``InvalidImage`` for another OS or architecture, or
    a malformed field."""
    obj = _load(data, what)
    os_name = obj.get("os")
    arch = obj.get("architecture")
    if (os_name, arch) != PLATFORM:
        raise InvalidImage(
            f"{what} is for {os_name}/{arch}; hutch boots x86-64 Linux guests only "
            "(linux/amd64): pull or import an amd64 build"
        )
    rootfs = obj.get("rootfs")
    if not isinstance(rootfs, dict) or rootfs.get("type") != "layers":
        raise InvalidImage(f'{what} has no rootfs of type "layers"')
    diff_ids = _str_list(rootfs.get("diff_ids"), "rootfs.diff_ids")
    for d in diff_ids:
        try:
            parse_digest(d)
        except InvalidArgument as exc:
            raise InvalidImage(f"{what} rootfs.diff_ids: {exc.message}") from None
    cfg = obj.get("config") or {}
    if not isinstance(cfg, dict):
        raise InvalidImage(f"{what} config is not an object")
    env: dict[str, str] = {}
    for item in _str_list(cfg.get("Env"), "Env"):
        key, sep, value = item.partition("=")
        if not sep or not key or "\0" in item:
            raise InvalidImage(f"{what} Env entry {item!r} is not NAME=value")
        env[key] = value
    working_dir = cfg.get("WorkingDir") or None
    if working_dir is not None and (
        not isinstance(working_dir, str) or not working_dir.startswith("/") or "\0" in working_dir
    ):
        raise InvalidImage(f"{what} WorkingDir {working_dir!r} is not an absolute path")
    user = cfg.get("User") or None
    if user is not None and (not isinstance(user, str) or "\0" in user or len(user) > 256):
        raise InvalidImage(f"{what} User {user!r} is not a user name or uid[:gid]")
    ports = cfg.get("ExposedPorts") or {}
    if not isinstance(ports, dict):
        raise InvalidImage(f"{what} ExposedPorts is not an object")
    labels = cfg.get("Labels") or {}
    if not isinstance(labels, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
    ):
        raise InvalidImage(f"{what} Labels is not an object of strings")
    return ImageConfig(
        os=str(os_name),
        architecture=str(arch),
        diff_ids=diff_ids,
        env=env,
        working_dir=working_dir,
        user=user,
        entrypoint=_str_list(cfg.get("Entrypoint"), "Entrypoint"),
        cmd=_str_list(cfg.get("Cmd"), "Cmd"),
        exposed_ports=tuple(sorted(str(p) for p in ports)),
        labels=dict(labels),
    )
