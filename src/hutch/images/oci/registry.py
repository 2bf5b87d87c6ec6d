"""A registry client for pulls (Docker Registry HTTP API v2 / OCI distribution spec):
manifests and blobs, anonymous, basic auth, and the bearer token flow.

Synchronous (httpx), run by the daemon in a worker thread: a pull is a sequence of
streamed downloads fed straight into the layer applier. ``transport`` is injectable
(tests use ``httpx.MockTransport``). Blob redirects are followed; httpx drops the
``Authorization`` header when a redirect leaves the registry's origin.

Errors: a registry that says the image or tag does not exist → ``NotFound``; refused
or missing credentials → ``InvalidArgument`` (the request must change); anything else
the registry or the network does wrong → ``RegistryError``.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from typing import Any

import httpx

from hutch.errors import InvalidArgument, NotFound, RegistryError
from hutch.images.oci.auth import (
    Challenge,
    Credentials,
    parse_token_response,
    parse_www_authenticate,
    token_url,
)
from hutch.images.oci.digest import Readable
from hutch.images.oci.manifest import ACCEPT_MANIFESTS, Descriptor
from hutch.images.oci.ref import ImageRef

__all__ = ["RegistryClient", "RegistrySource"]

_MAX_MANIFEST = 4 << 20
_USER_AGENT = "hutch-registry-client/1"


class _StreamReader:
    """A file-like ``read(n)`` over an httpx streamed response."""

    def __init__(self, response: httpx.Response, what: str) -> None:
        self._chunks = response.iter_bytes(1 << 20)
        self._buf = b""
        self.what = what

    def read(self, n: int = -1) -> bytes:
        try:
            while n < 0 or len(self._buf) < n:
                chunk = next(self._chunks, None)
                if chunk is None:
                    break
                self._buf += chunk
        except httpx.HTTPError as exc:
            raise RegistryError(f"{self.what}: the download failed: {exc}") from exc
        if n < 0:
            data, self._buf = self._buf, b""
        else:
            data, self._buf = self._buf[:n], self._buf[n:]
        return data

    def readable(self) -> bool:
        return True


class RegistryClient:
    def __init__(
        self,
        ref: ImageRef,
        credentials: Credentials | None = None,
        *,
        transport: httpx.BaseTransport | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.ref = ref
        self.credentials = credentials or Credentials()
        self._http = httpx.Client(
            transport=transport,
            timeout=httpx.Timeout(timeout_s),
            follow_redirects=True,
            trust_env=False,
            headers={"User-Agent": _USER_AGENT},
        )
        self._authorization: str | None = (
            f"Bearer {self.credentials.token}" if self.credentials.token else None
        )

    def close(self) -> None:
        self._http.close()

    @property
    def scope(self) -> str:
        return f"repository:{self.ref.repository}:pull"

    def _url(self, kind: str, reference: str) -> str:
        return f"{self.ref.base_url}/v2/{self.ref.repository}/{kind}/{reference}"

    # -- auth ------------------------------------------------------------------------

    def _authorize(self, challenges: list[Challenge]) -> bool:
        """Get an Authorization for the challenge; False if there is nothing to try."""
        by_scheme = {c.scheme: c for c in challenges}
        if "bearer" in by_scheme:
            url = token_url(by_scheme["bearer"], self.scope)
            try:
                answer = self._http.get(
                    url, auth=self.credentials.basic or httpx.USE_CLIENT_DEFAULT
                )
            except httpx.HTTPError as exc:
                raise RegistryError(f"{self.ref.registry}: token service {url}: {exc}") from exc
            if answer.status_code in (401, 403):
                raise InvalidArgument(
                    f"registry {self.ref.registry} refused the credentials for {self.ref}"
                    + ("" if self.credentials.basic else " (none were given)")
                )
            if answer.status_code != 200:
                raise RegistryError(
                    f"{self.ref.registry}: token service answered HTTP {answer.status_code}"
                )
            self._authorization = f"Bearer {parse_token_response(answer.content)}"
            return True
        if "basic" in by_scheme and self.credentials.basic is not None:
            user, password = self.credentials.basic
            pair = base64.b64encode(f"{user}:{password}".encode()).decode()
            self._authorization = f"Basic {pair}"
            return True
        return False

    def _send(
        self, method: str, url: str, *, stream: bool, what: str, **headers: str
    ) -> httpx.Response:
        tried_auth = False
        while True:
            if self._authorization:
                headers["Authorization"] = self._authorization
            request = self._http.build_request(method, url, headers=headers)
            try:
                response = self._http.send(request, stream=stream)
            except httpx.HTTPError as exc:
                raise RegistryError(
                    f"cannot reach registry {self.ref.registry} ({self.ref.base_url}): {exc}"
                ) from exc
            if response.status_code != 401:
                return response
            header = response.headers.get("WWW-Authenticate", "")
            response.close()
            if tried_auth:
                raise InvalidArgument(
                    f"registry {self.ref.registry} refused the credentials for {what}"
                )
            try:
                challenges = parse_www_authenticate(header)
            except InvalidArgument as exc:
                raise RegistryError(f"{self.ref.registry}: {exc.message}") from exc
            if not self._authorize(challenges):
                raise InvalidArgument(
                    f"registry {self.ref.registry} needs credentials for {what}; give a "
                    "username and password (or a token)"
                )
            tried_auth = True

    def _check(self, response: httpx.Response, what: str) -> None:
        status = response.status_code
        if status < 300:
            return
        detail = ""
        with contextlib.suppress(Exception):
            response.read()
            errors = response.json().get("errors") or []
            detail = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors)
        response.close()
        if status == 404:
            raise NotFound(
                f"registry {self.ref.registry} has no {what}" + (f" ({detail})" if detail else "")
            )
        if status == 403:
            raise InvalidArgument(
                f"registry {self.ref.registry} denies access to {what}"
                + (f" ({detail})" if detail else "")
            )
        raise RegistryError(
            f"registry {self.ref.registry} answered HTTP {status} for {what}"
            + (f": {detail}" if detail else "")
        )

    # -- API ---------------------------------------------------------------------------

    def get_manifest(self, reference: str) -> tuple[bytes, str | None, str | None]:
        """(body, Content-Type, Docker-Content-Digest) of ``manifests/<reference>``."""
        what = f"manifest {self.ref.repository}:{reference}"
        response = self._send(
            "GET", self._url("manifests", reference), stream=True, what=what,
            Accept=ACCEPT_MANIFESTS,
        )  # fmt: skip
        self._check(
            response,
            f"image {self.ref.repository}@{reference}"
            if reference.startswith("sha")
            else f"image {self.ref.repository}:{reference}",
        )
        try:
            body = b""
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > _MAX_MANIFEST:
                    raise RegistryError(f"{what} is larger than {_MAX_MANIFEST} bytes")
        except httpx.HTTPError as exc:
            raise RegistryError(f"{what}: download failed: {exc}") from exc
        finally:
            response.close()
        content_type = response.headers.get("Content-Type")
        media_type = content_type.split(";")[0].strip() if content_type else None
        return body, media_type, response.headers.get("Docker-Content-Digest")

    @contextlib.contextmanager
    def open_blob(self, digest: str) -> Iterator[Readable]:
        what = f"blob {digest} of {self.ref.repository}"
        response = self._send("GET", self._url("blobs", digest), stream=True, what=what)
        self._check(response, what)
        try:
            yield _StreamReader(response, what)
        finally:
            response.close()


class RegistrySource:
    """A :class:`hutch.images.oci.archives.BlobSource` over a registry."""

    def __init__(self, client: RegistryClient) -> None:
        self.client = client

    def top(self) -> tuple[bytes, str | None, str | None]:
        body, media_type, header_digest = self.client.get_manifest(self.client.ref.reference)
        # A pull by digest must get exactly that; by tag, what the registry says it sent.
        return body, media_type, self.client.ref.digest or header_digest

    def manifest(self, digest: str) -> tuple[bytes, str | None]:
        body, media_type, _ = self.client.get_manifest(digest)
        return body, media_type

    def open_blob(self, desc: Descriptor) -> contextlib.AbstractContextManager[Readable]:
        return self.client.open_blob(desc.digest)

    def describe(self) -> dict[str, Any]:
        return {"type": "registry", "ref": str(self.client.ref)}
