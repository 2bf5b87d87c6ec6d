"""Which guest images this host can start sandboxes from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from hutch.errors import Conflict, UnknownImage
from hutch.images.build import ImageArtifacts, find_image, list_images
from hutch.images.catalog import IMAGES


@dataclass(frozen=True)
class ImageView:
    name: str
    description: str
    built: bool
    digest: str | None
    size_bytes: int | None
    kernel_release: str | None


class ImageSource(Protocol):
    def find(self, name: str) -> ImageArtifacts | None: ...

    def names(self) -> list[str]: ...

    def list(self) -> list[ImageView]: ...


class LocalImages:
    """Images built on this host under ``images_dir`` (see ``hutch image build``)."""

    def __init__(self, images_dir: Path) -> None:
        self.images_dir = images_dir

    def find(self, name: str) -> ImageArtifacts | None:
        return find_image(name, self.images_dir)

    def names(self) -> list[str]:
        return sorted(IMAGES)

    def list(self) -> list[ImageView]:
        views = []
        for info in list_images(self.images_dir):
            built = find_image(info.name, self.images_dir) if info.built else None
            views.append(
                ImageView(
                    name=info.name,
                    description=info.description,
                    built=built is not None,
                    digest=info.digest,
                    size_bytes=info.size_bytes,
                    kernel_release=built.kernel_release if built else None,
                )
            )
        return views


def resolve(images: ImageSource, name: str) -> ImageArtifacts:
    """The built image ``name``, or an error saying how to get it."""
    if name not in images.names():
        raise UnknownImage(f"unknown image {name!r}; available: {', '.join(images.names())}")
    image = images.find(name)
    if image is None:
        raise Conflict(f"image {name!r} is not built on this host; run `hutch image build {name}`")
    return image
