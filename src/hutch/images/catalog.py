"""The images hutch can build: a name, a Debian suite and the packages on top of minbase.

A recipe is pure data. It and the apt sources make the package tree's cache key
(``rootfs.tree_key``), so everything that changes the tree belongs in the recipe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hutch.errors import InvalidArgument, UnknownImage

__all__ = ["BASE_PACKAGES", "IMAGES", "ImageRecipe", "get_recipe"]

_IMAGE_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
# Debian package names (policy 5.6.1), optionally with an architecture qualifier.
_PACKAGE_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]+(:[a-z0-9-]+)?$")
_SUITE_RE = re.compile(r"^[a-z]+$")

#: What the guest's init and agent need; every image has these.
BASE_PACKAGES: tuple[str, ...] = (
    "python3",
    "coreutils",
    "curl",
    "ca-certificates",
    "tini",
    "e2fsprogs",
    "iproute2",
    "procps",
    "util-linux",
    "passwd",
)


@dataclass(frozen=True)
class ImageRecipe:
    """How to build one image. Validated on construction (raises ``InvalidArgument``)."""

    name: str
    description: str
    packages: tuple[str, ...]
    suite: str = "bookworm"

    def __post_init__(self) -> None:
        if not _IMAGE_NAME_RE.match(self.name):
            raise InvalidArgument(
                f"image name {self.name!r} is not valid; use 1-32 lowercase letters, digits "
                "and '-', starting with a letter or digit"
            )
        if not _SUITE_RE.match(self.suite):
            raise InvalidArgument(f"image {self.name}: suite {self.suite!r} is not a codename")
        if not self.packages:
            raise InvalidArgument(f"image {self.name}: the package list is empty")
        bad = [p for p in self.packages if not _PACKAGE_RE.match(p)]
        if bad:
            raise InvalidArgument(f"image {self.name}: not Debian package names: {bad}")
        dupes = sorted({p for p in self.packages if self.packages.count(p) > 1})
        if dupes:
            raise InvalidArgument(f"image {self.name}: packages listed twice: {dupes}")
        missing = [p for p in BASE_PACKAGES if p not in self.packages]
        if missing:
            raise InvalidArgument(
                f"image {self.name}: lacks packages the guest init needs: {missing}"
            )


def _recipe(name: str, description: str, extra: tuple[str, ...] = ()) -> ImageRecipe:
    return ImageRecipe(name=name, description=description, packages=BASE_PACKAGES + extra)


IMAGES: dict[str, ImageRecipe] = {
    r.name: r
    for r in (
        _recipe("base", "Debian 12 minbase with Python 3 and curl"),
        _recipe(
            "devbox",
            "base plus Python (pip, venv, numpy, pandas, matplotlib), Node.js, Go, Rust, "
            "gcc/g++, make and git",
            (
                "python3-pip",
                "python3-venv",
                "nodejs",
                "npm",
                "golang-go",
                "rustc",
                "cargo",
                "gcc",
                "g++",
                "make",
                "git",
                "python3-numpy",
                "python3-pandas",
                "python3-matplotlib",
            ),
        ),
    )
}


def get_recipe(name: str) -> ImageRecipe:
    """The recipe called ``name``; ``UnknownImage`` lists the known names otherwise."""
    try:
        return IMAGES[name]
    except KeyError:
        raise UnknownImage(
            f"no image called {name!r}; known images: {', '.join(sorted(IMAGES))}"
        ) from None
