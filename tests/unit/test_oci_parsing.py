"""The pure parts of OCI support: image references, WWW-Authenticate challenges,
manifests, indexes and configs."""

from __future__ import annotations

import json

import pytest

from hutch.errors import InvalidArgument, InvalidImage, RegistryError
from hutch.images.oci.auth import (
    Credentials,
    parse_token_response,
    parse_www_authenticate,
    token_url,
)
from hutch.images.oci.manifest import (
    parse_config,
    parse_index,
    parse_manifest,
    parse_manifest_or_index,
    select_platform,
)
from hutch.images.oci.ref import parse_ref

D = "sha256:" + "a" * 64
D2 = "sha256:" + "b" * 64


# -- references ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "registry", "repository", "tag", "digest"),
    [
        ("debian", "docker.io", "library/debian", "latest", None),
        ("debian:bookworm", "docker.io", "library/debian", "bookworm", None),
        ("team/app:1.2", "docker.io", "team/app", "1.2", None),
        ("docker.io/library/busybox", "docker.io", "library/busybox", "latest", None),
        ("index.docker.io/x/y", "docker.io", "x/y", "latest", None),
        ("127.0.0.1:5000/t/busy:v1", "127.0.0.1:5000", "t/busy", "v1", None),
        ("localhost/app", "localhost", "app", "latest", None),
        ("localhost:5000/a/b/c", "localhost:5000", "a/b/c", "latest", None),
        ("ghcr.io/org/img@" + D, "ghcr.io", "org/img", None, D),
        ("ghcr.io/org/img:v2@" + D, "ghcr.io", "org/img", "v2", D),
        ("[::1]:5000/x", "[::1]:5000", "x", "latest", None),
        (
            "my-registry.example.com:443/a_b/c--d:t",
            "my-registry.example.com:443",
            "a_b/c--d",
            "t",
            None,
        ),
    ],
)
def test_parse_ref(
    text: str, registry: str, repository: str, tag: str | None, digest: str | None
) -> None:
    ref = parse_ref(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (
        registry,
        repository,
        tag,
        digest,
    )
    assert ref.reference == (digest or tag)


def test_ref_schemes_and_hosts() -> None:
    assert parse_ref("127.0.0.1:5000/x").base_url == "http://127.0.0.1:5000"
    assert parse_ref("localhost:5000/x").scheme == "http"
    assert parse_ref("[::1]:5000/x").scheme == "http"
    assert parse_ref("ghcr.io/x").base_url == "https://ghcr.io"
    assert parse_ref("debian").base_url == "https://registry-1.docker.io"
    assert str(parse_ref("debian")) == "docker.io/library/debian:latest"


@pytest.mark.parametrize(
    "text",
    [
        "",
        " debian",
        "Debian",
        "debian:",
        "debian:bad tag",
        "a//b",
        "x@sha256:abc",
        "x@md5:" + "a" * 32,
        "registry.io:99999999/x",
        "x:" + "t" * 200,
    ],
)
def test_bad_refs_are_refused_with_the_grammar(text: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        parse_ref(text)
    assert "repository[:tag]" in err.value.message


# -- WWW-Authenticate ------------------------------------------------------------------


def test_bearer_challenge() -> None:
    header = (
        'Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
        'scope="repository:library/ubuntu:pull"'
    )
    (c,) = parse_www_authenticate(header)
    assert c.scheme == "bearer"
    assert c.params == {
        "realm": "https://auth.docker.io/token",
        "service": "registry.docker.io",
        "scope": "repository:library/ubuntu:pull",
    }
    url = token_url(c, "repository:other:pull")
    assert url == (
        "https://auth.docker.io/token?service=registry.docker.io&"
        "scope=repository%3Alibrary%2Fubuntu%3Apull"
    )


def test_basic_and_several_challenges() -> None:
    cs = parse_www_authenticate('Basic realm="Registry Realm", Bearer realm="http://t/x"')
    assert [(c.scheme, c.params) for c in cs] == [
        ("basic", {"realm": "Registry Realm"}),
        ("bearer", {"realm": "http://t/x"}),
    ]


def test_challenge_quoting_case_and_tokens() -> None:
    (c,) = parse_www_authenticate('BEARER Realm="a\\"b", Service=plain ,scope="x,y"')
    assert c.scheme == "bearer"
    assert c.params == {"realm": 'a"b', "service": "plain", "scope": "x,y"}
    (t68,) = parse_www_authenticate("Negotiate abc123==")
    assert t68.params == {"token68": "abc123=="}
    (bare,) = parse_www_authenticate("Basic")
    assert bare.params == {}


def test_malformed_challenge() -> None:
    with pytest.raises(InvalidArgument):
        parse_www_authenticate('Bearer realm="unterminated')


def test_token_url_without_scope_uses_ours_and_needs_a_realm() -> None:
    (c,) = parse_www_authenticate('Bearer realm="http://127.0.0.1:1/token?x=1"')
    assert token_url(c, "repository:a/b:pull") == (
        "http://127.0.0.1:1/token?x=1&scope=repository%3Aa%2Fb%3Apull"
    )
    (bad,) = parse_www_authenticate('Bearer service="x"')
    with pytest.raises(RegistryError, match="realm"):
        token_url(bad, "s")


def test_token_response() -> None:
    assert parse_token_response(b'{"token": "t1"}') == "t1"
    assert parse_token_response(b'{"access_token": "t2", "expires_in": 300}') == "t2"
    for body in (b"nope", b"{}", b'{"token": ""}'):
        with pytest.raises(RegistryError):
            parse_token_response(body)


def test_credentials_need_both_halves() -> None:
    with pytest.raises(InvalidArgument):
        Credentials(username="u")
    with pytest.raises(InvalidArgument):
        Credentials(username="u", password="p", token="t")
    assert Credentials(username="u", password="p").basic == ("u", "p")
    assert "p" not in repr(Credentials(username="u", password="p"))


# -- manifests -------------------------------------------------------------------------

CONFIG_DESC = {
    "mediaType": "application/vnd.oci.image.config.v1+json",
    "digest": D,
    "size": 10,
}


def manifest(**over: object) -> bytes:
    doc: dict[str, object] = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": CONFIG_DESC,
        "layers": [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": D2, "size": 5},
            {"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd", "digest": D, "size": 6},
        ],
    }
    doc.update(over)
    return json.dumps(doc).encode()


def test_parse_manifest() -> None:
    m = parse_manifest(manifest(), None, "m")
    assert m.config.digest == D
    assert [(x.digest, x.size, x.compression) for x in m.layers] == [
        (D2, 5, "gzip"),
        (D, 6, "zstd"),
    ]
    # The OCI types may leave mediaType out of the document: the Content-Type decides.
    doc = json.loads(manifest())
    del doc["mediaType"]
    m2 = parse_manifest(json.dumps(doc).encode(), "application/vnd.oci.image.manifest.v1+json", "m")
    assert m2.layers == m.layers


def test_docker_manifest_and_list() -> None:
    m = parse_manifest(
        manifest(
            mediaType="application/vnd.docker.distribution.manifest.v2+json",
            config={**CONFIG_DESC, "mediaType": "application/vnd.docker.container.image.v1+json"},
            layers=[
                {
                    "mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
                    "digest": D2,
                    "size": 1,
                }
            ],
        ),
        None,
        "m",
    )
    assert m.layers[0].compression == "gzip"


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        (manifest(schemaVersion=1), "schema 1"),
        (
            manifest(config={**CONFIG_DESC, "mediaType": "application/x-artifact"}),
            "not an image config",
        ),
        (
            manifest(layers=[{"mediaType": "application/x-foo", "digest": D, "size": 1}]),
            "layers[0]",
        ),
        (
            manifest(
                layers=[
                    {
                        "mediaType": "application/vnd.oci.image.layer.v1.tar",
                        "digest": "sha256:zz",
                        "size": 1,
                    }
                ]
            ),
            "digest",
        ),
        (
            manifest(
                layers=[
                    {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": D, "size": -1}
                ]
            ),
            "size",
        ),
        (b"[1, 2]", "not a JSON object"),
        (b"{not json", "not JSON"),
        (json.dumps({"schemaVersion": 2, "mediaType": "text/plain"}).encode(), "media type"),
    ],
)
def test_bad_manifests_name_what_is_wrong(doc: bytes, needle: str) -> None:
    with pytest.raises(InvalidImage) as err:
        parse_manifest_or_index(doc, None, "the manifest")
    assert needle in err.value.message


def index(*platforms: tuple[str, str, str | None], media: str | None = None) -> bytes:
    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": media or "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": "sha256:" + f"{i:064x}",
                    "size": 100,
                    "platform": {
                        "os": o,
                        "architecture": a,
                        **({"variant": v} if v else {}),
                    },
                }
                for i, (o, a, v) in enumerate(platforms)
            ],
        }
    ).encode()


def test_select_platform_picks_linux_amd64() -> None:
    idx = parse_index(
        index(("linux", "arm64", "v8"), ("linux", "amd64", "v3"), ("linux", "amd64", None)), "i"
    )
    assert select_platform(idx, "i").digest == "sha256:" + f"{2:064x}"
    docker_list = parse_manifest_or_index(
        index(
            ("linux", "amd64", None),
            media="application/vnd.docker.distribution.manifest.list.v2+json",
        ),
        None,
        "i",
    )
    assert not hasattr(docker_list, "layers")


def test_select_platform_refuses_other_architectures_listing_them() -> None:
    idx = parse_index(
        index(("linux", "arm64", "v8"), ("linux", "s390x", None), ("unknown", "unknown", None)),
        "idx",
    )
    with pytest.raises(InvalidImage) as err:
        select_platform(idx, "idx")
    msg = err.value.message
    assert "no linux/amd64" in msg and "linux/arm64/v8" in msg and "linux/s390x" in msg
    assert "unknown" not in msg


def config(**over: object) -> bytes:
    doc: dict[str, object] = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/bin:/bin", "GREETING=hello=world"],
            "WorkingDir": "/srv/app",
            "User": "1000:1000",
            "Entrypoint": ["/bin/sh", "-c"],
            "Cmd": ["exec server"],
            "ExposedPorts": {"8080/tcp": {}, "53/udp": {}},
        },
        "rootfs": {"type": "layers", "diff_ids": [D, D2]},
    }
    doc.update(over)
    return json.dumps(doc).encode()


def test_parse_config() -> None:
    c = parse_config(config())
    assert c.env == {"PATH": "/usr/bin:/bin", "GREETING": "hello=world"}
    assert (c.working_dir, c.user) == ("/srv/app", "1000:1000")
    assert c.start_command == ("/bin/sh", "-c", "exec server")
    assert c.exposed_ports == ("53/udp", "8080/tcp")
    assert c.diff_ids == (D, D2)
    empty = parse_config(config(config={}))
    assert (empty.env, empty.working_dir, empty.user, empty.start_command) == ({}, None, None, ())


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"architecture": "arm64"}, "linux/arm64"),
        ({"os": "windows"}, "windows/amd64"),
        ({"rootfs": {"type": "other"}}, "rootfs"),
        ({"config": {"Env": ["NOEQUALS"]}}, "Env entry"),
        ({"config": {"WorkingDir": "relative"}}, "WorkingDir"),
        ({"config": {"Cmd": "a string"}}, "Cmd"),
        ({"rootfs": {"type": "layers", "diff_ids": ["nope"]}}, "diff_ids"),
    ],
)
def test_bad_configs(over: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidImage) as err:
        parse_config(config(**over))
    assert needle in err.value.message
