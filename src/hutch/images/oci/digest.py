"""Content digests (``sha256:<hex>``) and readers that verify what passes through them.

Every byte hutch takes from an image source (registry, archive, layout) goes through a
:class:`VerifyingReader` or :func:`verify_bytes` against the digest that names it, so a
corrupt or substituted blob is refused before it is used. The digest is checked when the
reader reaches the end; a reader closed early never claims success.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Protocol

from hutch.errors import InvalidArgument, InvalidImage

__all__ = ["Digest", "Readable", "VerifyingReader", "parse_digest", "verify_bytes"]


class Readable(Protocol):
    """A binary stream read front to back (files, HTTP bodies, pipes)."""

    def read(self, n: int = -1, /) -> bytes: ...


_ALGORITHMS = {"sha256": 64, "sha512": 128}
_DIGEST_RE = re.compile(r"^([a-z0-9]+):([a-f0-9]+)$")


@dataclass(frozen=True)
class Digest:
    algorithm: str
    hex: str

    def __str__(self) -> str:
        return f"{self.algorithm}:{self.hex}"

    def hasher(self) -> Any:
        return hashlib.new(self.algorithm)


def parse_digest(text: object) -> Digest:
    """``InvalidArgument`` unless ``text`` is ``sha256:<64 hex>`` or ``sha512:<128 hex>``."""
    m = _DIGEST_RE.match(text) if isinstance(text, str) else None
    if m is None or _ALGORITHMS.get(m.group(1)) != len(m.group(2)):
        raise InvalidArgument(
            f"digest {text!r} is not sha256:<64 lowercase hex> (or sha512:<128 hex>)"
        )
    return Digest(m.group(1), m.group(2))


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def verify_bytes(data: bytes, expected: str, what: str) -> None:
    """``InvalidImage`` naming ``what`` unless ``data`` hashes to ``expected``."""
    want = parse_digest(expected)
    got = hashlib.new(want.algorithm, data).hexdigest()
    if got != want.hex:
        raise InvalidImage(
            f"{what}: digest mismatch: expected {want}, the content hashes to "
            f"{want.algorithm}:{got}; the source is corrupt or was tampered with"
        )


class VerifyingReader:
    """A binary reader over ``raw`` that hashes every byte and, at end of data, raises
    ``InvalidImage`` if the digest or the size (when known) differs from the expected."""

    def __init__(self, raw: Readable, expected: str, what: str, size: int | None = None):
        self.raw = raw
        self.want = parse_digest(expected)
        self.what = what
        self.size = size
        self.hash = self.want.hasher()
        self.seen = 0
        self.verified = False

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        if data:
            self.hash.update(data)
            self.seen += len(data)
            if self.size is not None and self.seen > self.size:
                raise InvalidImage(
                    f"{self.what}: more than the {self.size} bytes its descriptor declares"
                )
        elif n != 0:
            self._finish()
        return data

    def readable(self) -> bool:
        return True

    def drain(self) -> None:
        """Read to the end (verifying): a tar reader may stop before the padding."""
        while self.read(1 << 20):
            pass

    def _finish(self) -> None:
        if self.verified:
            return
        if self.size is not None and self.seen != self.size:
            raise InvalidImage(
                f"{self.what}: {self.seen} bytes, but its descriptor declares {self.size}; "
                "the blob is truncated or corrupt"
            )
        got = self.hash.hexdigest()
        if got != self.want.hex:
            raise InvalidImage(
                f"{self.what}: digest mismatch: expected {self.want}, the content hashes "
                f"to {self.want.algorithm}:{got}; the blob is corrupt or was tampered with"
            )
        self.verified = True
