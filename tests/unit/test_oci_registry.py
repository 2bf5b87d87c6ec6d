"""The registry client against an in-memory registry (httpx.MockTransport) that speaks the
distribution API with each auth scheme: anonymous, basic, and the bearer token flow
(WWW-Authenticate challenge, token service, retry). The real registry (Debian's
docker-registry) is in tests/vm/test_oci_images.py."""

from __future__ import annotations

import base64
import json

import httpx
import pytest

from hutch.errors import InvalidArgument, InvalidImage, NotFound, RegistryError
from hutch.images.oci.auth import Credentials
from hutch.images.oci.digest import digest_of
from hutch.images.oci.importer import resolve
from hutch.images.oci.ref import parse_ref
from hutch.images.oci.registry import RegistryClient, RegistrySource

CONFIG = json.dumps(
    {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["A=1"]},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + "1" * 64]},
    }
).encode()
LAYER = b"layer-bytes"
MANIFEST = json.dumps(
    {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": digest_of(CONFIG),
            "size": len(CONFIG),
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": digest_of(LAYER),
                "size": len(LAYER),
            }
        ],
    }
).encode()
INDEX = json.dumps(
    {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": "sha256:" + "9" * 64,
                "size": 10,
                "platform": {"os": "linux", "architecture": "arm64"},
            },
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": digest_of(MANIFEST),
                "size": len(MANIFEST),
                "platform": {"os": "linux", "architecture": "amd64"},
            },
        ],
    }
).encode()


class Registry:
    """``auth``: None | "basic" | "bearer"; records the requests it saw."""

    def __init__(self, auth: str | None = None, user: str = "u", password: str = "p") -> None:
        self.auth = auth
        self.creds = base64.b64encode(f"{user}:{password}".encode()).decode()
        self.token = "tok-123"
        self.seen: list[tuple[str, str, str | None]] = []
        self.manifests = {"v1": (INDEX, "application/vnd.oci.image.index.v1+json")}
        self.manifests[digest_of(INDEX)] = self.manifests["v1"]
        self.manifests[digest_of(MANIFEST)] = (
            MANIFEST,
            "application/vnd.oci.image.manifest.v1+json",
        )
        self.blobs = {digest_of(CONFIG): CONFIG, digest_of(LAYER): LAYER}

    def handler(self, request: httpx.Request) -> httpx.Response:
        auth = request.headers.get("Authorization")
        self.seen.append((request.url.host, request.url.path, auth))
        if request.url.host == "auth.test":
            if request.url.params.get("scope") != "repository:team/app:pull":
                return httpx.Response(400)
            if request.url.params.get("service") != "reg.test":
                return httpx.Response(400)
            if auth != f"Basic {self.creds}":
                return httpx.Response(401)
            return httpx.Response(200, json={"token": self.token, "expires_in": 300})
        if self.auth == "basic" and auth != f"Basic {self.creds}":
            return httpx.Response(401, headers={"WWW-Authenticate": 'Basic realm="reg"'})
        if self.auth == "bearer" and auth != f"Bearer {self.token}":
            challenge = (
                'Bearer realm="http://auth.test/token",service="reg.test",'
                'scope="repository:team/app:pull"'
            )
            return httpx.Response(401, headers={"WWW-Authenticate": challenge})
        parts = request.url.path.split("/")  # /v2/team/app/<kind>/<ref>
        kind, ref = parts[-2], parts[-1]
        if kind == "manifests" and ref in self.manifests:
            body, media = self.manifests[ref]
            return httpx.Response(
                200,
                content=body,
                headers={"Content-Type": media, "Docker-Content-Digest": digest_of(body)},
            )
        if kind == "blobs" and ref in self.blobs:
            return httpx.Response(200, content=self.blobs[ref])
        return httpx.Response(
            404, json={"errors": [{"code": "MANIFEST_UNKNOWN", "message": "manifest unknown"}]}
        )


def client(
    reg: Registry, creds: Credentials | None = None, ref: str = "reg.test:5000/team/app:v1"
) -> RegistryClient:
    return RegistryClient(parse_ref(ref), creds, transport=httpx.MockTransport(reg.handler))


def test_anonymous_pull_resolves_the_index_to_amd64() -> None:
    reg = Registry()
    with_client = client(reg)
    resolved = resolve(RegistrySource(with_client), "ref")
    assert resolved.manifest_digest == digest_of(MANIFEST)
    assert resolved.config.env == {"A": "1"}
    with with_client.open_blob(digest_of(LAYER)) as f:
        assert f.read() == LAYER
    assert all(a is None for _, _, a in reg.seen)
    assert reg.seen[0][0] == "reg.test"


def test_basic_auth() -> None:
    reg = Registry("basic")
    resolved = resolve(RegistrySource(client(reg, Credentials("u", "p"))), "ref")
    assert resolved.manifest_digest == digest_of(MANIFEST)
    # One 401, then every request carries the credentials.
    assert reg.seen[0][2] is None
    assert all(a == f"Basic {reg.creds}" for _, _, a in reg.seen[1:])
    with pytest.raises(InvalidArgument, match="needs credentials"):
        resolve(RegistrySource(client(Registry("basic"))), "ref")
    with pytest.raises(InvalidArgument, match="refused the credentials"):
        resolve(RegistrySource(client(Registry("basic"), Credentials("u", "wrong"))), "ref")


def test_bearer_token_flow() -> None:
    reg = Registry("bearer")
    resolved = resolve(RegistrySource(client(reg, Credentials("u", "p"))), "ref")
    assert resolved.manifest_digest == digest_of(MANIFEST)
    hosts = [h for h, _, _ in reg.seen]
    assert hosts[:3] == ["reg.test", "auth.test", "reg.test"]
    assert reg.seen[1][2] == f"Basic {reg.creds}"  # the token request carries the creds
    assert all(a == "Bearer tok-123" for h, _, a in reg.seen[2:] if h == "reg.test")
    assert hosts.count("auth.test") == 1  # the token is reused
    with pytest.raises(InvalidArgument, match="refused the credentials"):
        resolve(RegistrySource(client(Registry("bearer"), Credentials("u", "x"))), "ref")


def test_a_given_token_is_sent_as_bearer() -> None:
    reg = Registry("bearer")
    resolved = resolve(RegistrySource(client(reg, Credentials(token="tok-123"))), "ref")
    assert resolved.manifest_digest == digest_of(MANIFEST)
    assert all(h == "reg.test" for h, _, _ in reg.seen)


def test_unknown_tag_is_not_found() -> None:
    with pytest.raises(NotFound, match=r"team/app:nope.*MANIFEST_UNKNOWN"):
        resolve(RegistrySource(client(Registry(), ref="reg.test:5000/team/app:nope")), "ref")


def test_pull_by_digest_verifies_the_manifest() -> None:
    reg = Registry()
    good = client(reg, ref=f"reg.test:5000/team/app@{digest_of(INDEX)}")
    assert resolve(RegistrySource(good), "ref").manifest_digest == digest_of(MANIFEST)
    # A registry that answers a digest with other bytes is refused.
    reg.manifests[digest_of(INDEX)] = (INDEX + b" ", "application/vnd.oci.image.index.v1+json")
    with pytest.raises(InvalidImage, match="digest mismatch"):
        resolve(RegistrySource(good), "ref")


def test_tampered_child_manifest_is_refused() -> None:
    reg = Registry()
    reg.manifests[digest_of(MANIFEST)] = (MANIFEST + b"\n", reg.manifests[digest_of(MANIFEST)][1])
    with pytest.raises(InvalidImage, match="digest mismatch"):
        resolve(RegistrySource(client(reg)), "ref")


def test_unreachable_and_failing_registries() -> None:
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    c = RegistryClient(parse_ref("127.0.0.1:1/x"), transport=httpx.MockTransport(down))
    with pytest.raises(RegistryError, match=r"cannot reach registry 127.0.0.1:1 \(http://"):
        c.get_manifest("latest")

    def broken(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503)

    c = RegistryClient(parse_ref("127.0.0.1:1/x"), transport=httpx.MockTransport(broken))
    with pytest.raises(RegistryError, match="HTTP 503"):
        c.get_manifest("latest")
