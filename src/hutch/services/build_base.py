"""The FROM of a Dockerfile build, and the progress a build reports (used by
:mod:`hutch.services.image_builder`): a base is its config now (what the plan expands
against) and its content later (a pull downloads its layers only once the whole
Dockerfile has been checked)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hutch.errors import Conflict, InvalidArgument, InvalidDockerfile, RegistryError
from hutch.images.build_layers import builtin_base
from hutch.images.build_layers import scratch_base as make_scratch_base
from hutch.images.catalog import IMAGES
from hutch.images.dockerfile import DEFAULT_PATH, BaseConfig
from hutch.images.oci.auth import Credentials
from hutch.images.oci.importer import ImportProgress, OciContent, build_content, find_content
from hutch.images.oci.importer import resolve as resolve_manifest
from hutch.images.oci.manifest import ImageConfig
from hutch.images.oci.ref import parse_ref
from hutch.images.oci.registry import RegistryClient, RegistrySource
from hutch.services.images import HostImages

__all__ = ["Base", "BuildProgress", "Progress", "base_config", "resolve_base"]


@dataclass(frozen=True)
class BuildProgress:
    """``status``: a message (the base image, the final filesystem); ``step``: a step
    starts (``running``) or ends (``cached``, ``done``, ``config``) after ``seconds``;
    ``output``: RUN output (``stream`` stdout or stderr)."""

    type: Literal["status", "step", "output"]
    message: str = ""
    step: int | None = None
    steps: int | None = None
    line: int | None = None
    instruction: str | None = None
    status: str | None = None
    seconds: float | None = None
    stream: str | None = None
    data: str | None = None


Progress = Callable[[BuildProgress], None]


@dataclass
class Base:
    """The FROM image: its config now, its content when :attr:`content` is called (in a
    worker thread: it may download and unpack layers)."""

    ref: str
    config: BaseConfig
    content: Callable[[], OciContent]
    close: Callable[[], None] = lambda: None


def base_config(cfg: dict[str, Any]) -> BaseConfig:
    return BaseConfig(
        env=tuple((str(k), str(v)) for k, v in (cfg.get("env") or {}).items()),
        working_dir=cfg.get("working_dir") or None,
        user=cfg.get("user") or None,
        entrypoint=tuple(cfg.get("entrypoint") or ()),
        cmd=tuple(cfg.get("cmd") or ()),
        exposed_ports=tuple(cfg.get("exposed_ports") or ()),
        labels=tuple(sorted((cfg.get("labels") or {}).items())),
    )


async def resolve_base(
    ref: str, where: str, images: HostImages, max_bytes: int, report: Progress, *, project: str
) -> Base:
    """The FROM image ``ref`` (written at ``where``): ``scratch``, a built-in image (its
    package tree), an image of ``project`` in this daemon, or an OCI reference (its manifest and
    config are fetched now, its layers when :attr:`Base.content` is called). Raises
    ``InvalidDockerfile`` for a name that is neither, ``RegistryError`` for a failed
    pull."""
    images_dir = images.images_dir
    if ref == "scratch":
        return Base(ref, BaseConfig(), lambda: make_scratch_base(images_dir))
    if ref in IMAGES:
        config = BaseConfig(env=(("PATH", DEFAULT_PATH),))
        return Base(ref, config, lambda: builtin_base(ref, images_dir))
    row = images.row(ref, project) if "/" not in ref and ":" not in ref else None
    if row is not None:

        def stored() -> OciContent:
            found = find_content(images_dir, row.digest)
            if found is None:
                raise Conflict(
                    f"image {ref!r} (FROM at {where}) is listed but its files are missing "
                    "on this host; import it again"
                )
            return found

        return Base(ref, base_config(row.config), stored)
    return await asyncio.to_thread(_pull_base, ref, where, images_dir, max_bytes, report)


def _pull_base(ref: str, where: str, images_dir: Path, max_bytes: int, report: Progress) -> Base:
    try:
        parsed = parse_ref(ref)
    except InvalidArgument as exc:
        raise InvalidDockerfile(
            f"Dockerfile {where}: FROM {ref}: no hutch image has this name and it is not "
            f"an image reference ({exc.message})"
        ) from exc
    client = RegistryClient(parsed, Credentials())
    try:
        source = RegistrySource(client)
        resolved = resolve_manifest(source, str(parsed))
    except RegistryError as exc:
        client.close()
        raise RegistryError(
            f"FROM {ref} ({where}): no hutch image has this name, and pulling "
            f"{parsed} failed: {exc.message}"
        ) from exc
    except BaseException:
        client.close()
        raise
    cfg: ImageConfig = resolved.config

    def pulled() -> OciContent:
        def relay(p: ImportProgress) -> None:
            if p.stage != "layer" or p.done in (0, p.total):
                report(BuildProgress("status", f"base image: {p.message}"))

        return build_content(
            source,
            resolved,
            images_dir,
            what=str(parsed),
            progress=relay,
            max_bytes=max_bytes,
        )

    config = base_config(cfg.to_dict())
    return Base(ref, config, pulled, client.close)
