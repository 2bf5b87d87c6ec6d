"""Guest images: kernel, initramfs and root filesystem, built from Debian packages.

Public API (see ARCHITECTURE.md, "images/")::

    catalog.IMAGES, catalog.ImageRecipe
    build.build_image(name, images_dir, progress=None, force=False) -> ImageArtifacts
    build.find_image(name, images_dir) -> ImageArtifacts | None
    build.list_images(images_dir) -> list[ImageInfo]
"""

from hutch.images.build import (
    ImageArtifacts,
    ImageInfo,
    Progress,
    build_image,
    find_image,
    list_images,
)
from hutch.images.catalog import IMAGES, ImageRecipe, get_recipe

__all__ = [
    "IMAGES",
    "ImageArtifacts",
    "ImageInfo",
    "ImageRecipe",
    "Progress",
    "build_image",
    "find_image",
    "get_recipe",
    "list_images",
]
