"""Recipe validation and the catalog."""

from __future__ import annotations

import pytest

from hutch.errors import InvalidArgument, UnknownImage
from hutch.images.catalog import BASE_PACKAGES, IMAGES, ImageRecipe, get_recipe


def test_catalog_has_base_and_devbox() -> None:
    assert set(IMAGES) == {"base", "devbox"}
    for name, recipe in IMAGES.items():
        assert recipe.name == name
        assert set(BASE_PACKAGES) <= set(recipe.packages)
    assert {"nodejs", "golang-go", "cargo", "python3-numpy"} <= set(IMAGES["devbox"].packages)


def test_unknown_image_lists_known_names() -> None:
    with pytest.raises(UnknownImage, match="known images: base, devbox"):
        get_recipe("ubuntu")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "Base"}, "image name"),
        ({"packages": ()}, "empty"),
        ({"packages": (*BASE_PACKAGES, "Bad_Name")}, "not Debian package names"),
        ({"packages": (*BASE_PACKAGES, "git", "git")}, "listed twice"),
        ({"packages": ("python3", "curl")}, "lacks packages the guest init needs"),
        ({"suite": "bookworm-updates"}, "not a codename"),
    ],
)
def test_recipe_validation(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"name": "x", "description": "d", "packages": BASE_PACKAGES}
    args.update(kwargs)
    with pytest.raises(InvalidArgument, match=message):
        ImageRecipe(**args)  # type: ignore[arg-type]


def test_valid_recipe() -> None:
    recipe = ImageRecipe("mine", "d", (*BASE_PACKAGES, "libstdc++6", "python3-pip:amd64"))
    assert recipe.suite == "bookworm"
