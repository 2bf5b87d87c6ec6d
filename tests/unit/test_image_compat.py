"""Placement's view of built-in images (``services/image_compat.py``, pure): a frozen
state of ``base`` goes only to a host that holds the bytes it was frozen over, or that
lacks the digest and would fetch an upload of those bytes."""

from __future__ import annotations

from hutch.services.image_compat import compatible_image, frozen_identity, image_identity
from hutch.store.hosts import HostRow

D1, D2 = "0123456789abcdef", "fedcba9876543210"
A, B = "a" * 64, "b" * 64


def _host(images: dict[str, dict[str, str]]) -> HostRow:
    return HostRow("h", "127.0.0.1:1", "worker", "up", 2, 1024, 10, 10, "tcg", "8", "x",
                   images=images)  # fmt: skip


def test_a_host_holding_the_frozen_bytes_is_compatible_and_one_with_others_is_not() -> None:
    source = _host({"base": {D1: A}})
    sha = frozen_identity(source, "base", D1)
    assert sha == A
    assert compatible_image(_host({"base": {D1: A}}), "base", D1, sha, uploaded=B)
    assert not compatible_image(_host({"base": {D1: B}}), "base", D1, sha, uploaded=A)


def test_a_host_lacking_the_digest_is_compatible_only_if_the_upload_is_those_bytes() -> None:
    lacking = _host({"base": {D2: B}})
    assert compatible_image(lacking, "base", D1, A, uploaded=A)
    assert not compatible_image(lacking, "base", D1, A, uploaded=B)
    assert not compatible_image(lacking, "base", D1, A, uploaded=None)
    assert not compatible_image(_host({}), "base", D1, A, uploaded=None)  # published nothing


def test_nothing_to_compare_leaves_the_arrival_check_to_decide() -> None:
    other = _host({"base": {D1: B}})
    assert compatible_image(other, "my-app", D1, A, uploaded=None)  # imported: not ours
    assert compatible_image(other, "base", None, A, uploaded=None)
    assert compatible_image(other, "base", D1, None, uploaded=None)
    assert frozen_identity(other, "my-app", D1) is None
    assert image_identity(other, "devbox", D1) is None
    assert image_identity(other, "base", None) is None
