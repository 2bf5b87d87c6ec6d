"""Image references (``[registry/]repository[:tag][@digest]``), parsed the way the Docker
and OCI tools read them (pure).

- The first component is a registry when it has a ``.`` or a ``:`` or is ``localhost``;
  otherwise the registry is Docker Hub (``docker.io``, API host
  ``registry-1.docker.io``) and a one-component name gets the ``library/`` prefix.
- No tag and no digest means ``:latest``. With a digest the digest decides what is
  pulled; the tag is kept only for display.
- Registries on a loopback address (``localhost``, ``127.0.0.0/8``, ``[::1]``) are
  spoken to over plain HTTP, every other one over HTTPS.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from hutch.errors import InvalidArgument
from hutch.images.oci.digest import parse_digest

__all__ = ["DOCKER_HUB", "ImageRef", "parse_ref"]

DOCKER_HUB = "docker.io"
_DOCKER_HUB_API = "registry-1.docker.io"

# From the distribution reference grammar.
_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_HOST = re.compile(
    r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*)(?::[0-9]{1,5})?$"
)
_MAX_NAME = 255


@dataclass(frozen=True)
class ImageRef:
    registry: str  # as written, e.g. "docker.io", "127.0.0.1:5000"
    repository: str  # e.g. "library/debian"
    tag: str | None
    digest: str | None

    @property
    def reference(self) -> str:
        """What goes in ``/v2/<name>/manifests/<reference>``: the digest, else the tag."""
        return self.digest or self.tag or "latest"

    @property
    def api_host(self) -> str:
        return _DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def scheme(self) -> str:
        return "http" if _is_loopback(self.registry) else "https"

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{self.api_host}"

    def __str__(self) -> str:
        out = f"{self.registry}/{self.repository}"
        if self.tag:
            out += f":{self.tag}"
        if self.digest:
            out += f"@{self.digest}"
        return out


def _is_loopback(host_port: str) -> bool:
    host = host_port
    if host.startswith("["):
        host = host[1:].split("]", 1)[0]
    elif ":" in host:
        host = host.rsplit(":", 1)[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bad(text: str, why: str) -> InvalidArgument:
    return InvalidArgument(
        f"image reference {text!r} is not valid: {why}; expected "
        "[registry[:port]/]repository[:tag][@sha256:<64 hex>], e.g. "
        "127.0.0.1:5000/team/app:1.2 or debian:bookworm"
    )


def parse_ref(text: str) -> ImageRef:
    """Parse ``text``; ``InvalidArgument`` says what is wrong and what is accepted."""
    if not isinstance(text, str) or not text or text != text.strip():
        raise _bad(str(text), "empty or padded with spaces")
    if len(text) > 1024 or any(c.isspace() for c in text):
        raise _bad(text, "too long or contains whitespace")
    rest = text
    digest: str | None = None
    if "@" in rest:
        rest, raw_digest = rest.split("@", 1)
        try:
            digest = str(parse_digest(raw_digest))
        except InvalidArgument as exc:
            raise _bad(text, exc.message) from None
    tag: str | None = None
    last_slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > last_slash:
        rest, tag = rest[:colon], rest[colon + 1 :]
        if not _TAG.match(tag):
            raise _bad(text, f"tag {tag!r} is not 1-128 of [A-Za-z0-9_.-]")
    parts = rest.split("/")
    first = parts[0]
    if len(parts) > 1 and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, parts[1:]
        if not _HOST.match(registry):
            raise _bad(text, f"registry {registry!r} is not a host[:port]")
    else:
        registry, path = DOCKER_HUB, parts
    if registry in ("index.docker.io", "registry-1.docker.io"):
        registry = DOCKER_HUB
    if registry == DOCKER_HUB and len(path) == 1:
        path = ["library", *path]
    for component in path:
        if not _COMPONENT.match(component):
            raise _bad(text, f"repository component {component!r} must be lowercase [a-z0-9._-]")
    repository = "/".join(path)
    if len(repository) > _MAX_NAME:
        raise _bad(text, f"the repository name is longer than {_MAX_NAME} characters")
    if tag is None and digest is None:
        tag = "latest"
    return ImageRef(registry=registry, repository=repository, tag=tag, digest=digest)
