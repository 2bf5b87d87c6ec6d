"""``POST /v1/images`` (archive uploads; pulls' validation), ``GET /v1/images`` and
``DELETE /v1/images/{name}`` through the real REST app, service, store and importer
(real archives, real mkfs.ext4). The guest is the component tier's agent in bubblewrap:
what the image's files do in a real guest is tests/vm/test_oci_images.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from hutch.api import create_app
from hutch.config import Limits, Settings
from hutch.daemon import build_services
from hutch.images.oci.boot import BootSet
from hutch.models import FileSum
from hutch.services.composed import Services
from hutch.services.images import HostImages, LocalImages
from hutch.services.template_blobs import template_prefix
from hutch.store import Store
from hutch.store.images import ImageStore
from tests.component.conftest import API_KEY
from tests.component.fake_backend import FakeBackend
from tests.conftest import delete_live_sandboxes
from tests.ocikit import (
    E,
    Image,
    Layer,
    index_of,
    layer_tar,
    write_docker_archive,
    write_layout,
    write_oci_archive,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="layers with owners need root")


class FakeBootSets:
    """Boot files that exist (the fake backend boots nothing)."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        for name in ("vmlinux", "initrd.img", "runtime.ext4"):
            (root / name).write_bytes(b"x")
        self.boot = BootSet(
            "f" * 16, root / "vmlinux", root / "initrd.img", root / "runtime.ext4", "6.1.0-fake", ""
        )
        self.prepared = 0

    def find(self) -> BootSet | None:
        return self.boot

    def prepare(self) -> BootSet:
        self.prepared += 1
        return self.boot


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Services]]:
    async with _served(tmp_path) as found:
        yield found


@contextlib.asynccontextmanager
async def _served(
    tmp_path: Path, **settings_: object
) -> AsyncIterator[tuple[httpx.AsyncClient, Services]]:
    settings = Settings(
        state_dir=tmp_path / "state",
        limits=Limits(max_sandboxes=10),
        **settings_,  # type: ignore[arg-type]
    )
    store = Store(settings.database)
    images = HostImages(
        LocalImages(tmp_path / "images"),
        ImageStore(store),
        tmp_path / "images",
        FakeBootSets(tmp_path / "boot"),
    )
    backend = FakeBackend(tmp_path / "run")
    svc = build_services(settings, store, backend, images)
    await svc.start()
    app = create_app(svc, API_KEY, manage_service=False)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
        if task.done():
            task.result()
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{sock.getsockname()[1]}",
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=60,
        ) as client:
            yield client, svc
    finally:
        server.should_exit = True
        await task
        sock.close()
        await delete_live_sandboxes(svc)
        await svc.close()
        assert backend.leftover_ids() == set()


def image(tag: str, **kw: object) -> Image:
    return Image(
        layers=[
            Layer(layer_tar([E("etc", "dir"), E("etc/tag", data=tag.encode())])),
            Layer(layer_tar([E("srv", "dir"), E("srv/x", data=b"x" * 1000)]), "zstd"),
        ],
        **kw,  # type: ignore[arg-type]
    )


async def upload(client: httpx.AsyncClient, name: str, path: Path, **params: str) -> httpx.Response:
    return await client.post(
        "/v1/images",
        params={"name": name, **params},
        content=path.read_bytes(),  # noqa: ASYNC240 - small test archives
        headers={"Content-Type": "application/x-tar", "X-Hutch-Filename": path.name},
    )


def leftovers(tmp_path: Path) -> list[str]:
    """Files an import may leave: none but complete content dirs and lock files."""
    found = []
    for d in (tmp_path / "images" / "oci", tmp_path / "state" / "imports"):
        if d.is_dir():
            found += [p.name for p in d.iterdir() if not p.name.endswith(".lock")]
    return sorted(found)


async def test_import_an_archive_and_list_it_with_its_source(
    served: tuple[httpx.AsyncClient, Services], tmp_path: Path
) -> None:
    client, _ = served
    img = image("one", env=["PATH=/bin", "A=1"], working_dir="/srv", exposed_ports=["8080/tcp"])
    archive = tmp_path / "one.tar"
    write_oci_archive(img, archive, tmp_path)
    r = await upload(client, "one", archive)
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["name"] == "one" and body["built"] is True
    assert body["digest"] == img.digest
    assert body["source"] == {
        "type": "archive",
        "format": "oci-archive",
        "filename": "one.tar",
        "digest": img.digest,
        "ref": None,
    }
    assert body["config"]["env"] == {"PATH": "/bin", "A": "1"}
    assert body["config"]["working_dir"] == "/srv"
    assert body["config"]["exposed_ports"] == ["8080/tcp"]
    listed = {i["name"]: i for i in (await client.get("/v1/images")).json()["images"]}
    assert listed["base"]["source"]["type"] == "builtin"
    assert listed["one"]["digest"] == img.digest
    assert leftovers(tmp_path) == ["sha256-" + img.digest.split(":")[1]]


async def test_docker_archive_with_ndjson_progress(
    served: tuple[httpx.AsyncClient, Services], tmp_path: Path
) -> None:
    client, _ = served
    archive = tmp_path / "docker.tar"
    write_docker_archive(image("docker"), archive, tag="team/app:1.0")
    async with client.stream(
        "POST",
        "/v1/images",
        params={"name": "dock", "progress": "true"},
        content=archive.read_bytes(),
        headers={"Content-Type": "application/octet-stream"},
    ) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        events = [json.loads(line) async for line in r.aiter_lines() if line]
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "image" and set(kinds[:-1]) == {"progress"}
    layers = {(e["layer"], e["layers"]) for e in events if e.get("stage") == "layer"}
    assert layers == {(1, 2), (2, 2)}
    final = events[-1]["image"]
    assert final["source"]["format"] == "docker-archive"
    assert final["source"]["repo_tags"] == ["team/app:1.0"]


async def test_names_are_checked(
    served: tuple[httpx.AsyncClient, Services], tmp_path: Path
) -> None:
    client, _ = served
    archive = tmp_path / "a.tar"
    write_oci_archive(image("names"), archive, tmp_path)
    assert (await upload(client, "first", archive)).status_code == 201
    again = await upload(client, "first", archive)
    assert again.status_code == 409 and "already exists" in again.json()["error"]["message"]
    builtin = await upload(client, "base", archive)
    assert builtin.status_code == 409 and "built-in" in builtin.json()["error"]["message"]
    bad = await upload(client, "Bad_Name", archive)
    assert bad.status_code == 400
    missing = await client.post(
        "/v1/images", content=b"x", headers={"Content-Type": "application/x-tar"}
    )
    assert missing.status_code == 400 and "?name=" in missing.json()["error"]["message"]
    weird = await client.post(
        "/v1/images?name=x", content=b"x", headers={"Content-Type": "text/plain"}
    )
    assert weird.status_code == 400 and "application/json" in weird.json()["error"]["message"]
    assert leftovers(tmp_path) == ["sha256-" + image("names").digest.split(":")[1]]


def corrupt_layer(tmp_path: Path) -> Path:
    """A layer whose bytes changed where nothing but its digest can tell (file data of
    an uncompressed tar: gzip's or zstd's own checksums would speak first)."""
    img = Image(layers=[Layer(layer_tar([E("data", data=b"z" * 5000)]), "none")])
    layout = tmp_path / "corrupt-layout"
    write_layout([img], layout)
    blob = layout / "blobs/sha256" / img.layers[0].digest.split(":")[1]
    data = bytearray(blob.read_bytes())
    data[2000] ^= 0xFF
    blob.write_bytes(bytes(data))
    out = tmp_path / "corrupt.tar"
    _tar(layout, out)
    return out


def other_arch(tmp_path: Path) -> Path:
    arm = image("arm", architecture="arm64")
    layout = tmp_path / "arm-layout"
    write_layout([arm], layout, index=index_of([(arm.manifest(), "linux", "arm64")]))
    out = tmp_path / "arm.tar"
    _tar(layout, out)
    return out


def escaping(tmp_path: Path) -> Path:
    img = Image(layers=[Layer(layer_tar([E("../../../tmp/hutch-escape", data=b"pwned")]))])
    out = tmp_path / "escape.tar"
    write_oci_archive(img, out, tmp_path / "w")
    return out


def truncated(tmp_path: Path) -> Path:
    full = tmp_path / "full.tar"
    write_oci_archive(image("trunc"), full, tmp_path / "w2")
    out = tmp_path / "truncated.tar"
    data = full.read_bytes()
    out.write_bytes(data[: len(data) * 2 // 3])
    return out


def _tar(src: Path, out: Path) -> None:
    import tarfile

    with tarfile.open(out, "w") as tar:
        for p in sorted(src.rglob("*")):
            tar.add(p, arcname=str(p.relative_to(src)), recursive=False)


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (corrupt_layer, "digest mismatch"),
        (other_arch, "no linux/amd64 image (it has: linux/arm64)"),
        (escaping, "escapes the image root"),
        (truncated, "truncated"),
    ],
    ids=["corrupt-layer", "other-architecture", "path-escape", "truncated"],
)
async def test_bad_archives_are_400_and_leave_nothing(
    served: tuple[httpx.AsyncClient, Services], tmp_path: Path, make: object, needle: str
) -> None:
    client, _ = served
    archive = make(tmp_path)  # type: ignore[operator]
    r = await upload(client, "bad", archive)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_image"
    assert needle in r.json()["error"]["message"]
    names = [i["name"] for i in (await client.get("/v1/images")).json()["images"]]
    assert "bad" not in names
    assert leftovers(tmp_path) == []
    assert "hutch-escape" not in os.listdir("/tmp")
    # The same with progress: the error is the last line, with the status it would have had.
    async with client.stream(
        "POST", "/v1/images", params={"name": "bad", "progress": "true"},
        content=archive.read_bytes(), headers={"Content-Type": "application/x-tar"},
    ) as s:  # fmt: skip
        events = [json.loads(line) async for line in s.aiter_lines() if line]
    assert events[-1]["type"] == "error" and events[-1]["status"] == 400
    assert needle in events[-1]["error"]["message"]
    assert leftovers(tmp_path) == []


async def test_sandboxes_take_the_image_defaults_and_start_command(
    served: tuple[httpx.AsyncClient, Services], tmp_path: Path
) -> None:
    client, _ = served
    img = image(
        "defaults",
        env=["PATH=/usr/bin:/bin", "GREETING=from-image", "OVERRIDE=image"],
        working_dir="/tmp",
        cmd=["sh", "-c", "echo started > /tmp/started; exec sleep 300"],
    )
    archive = tmp_path / "d.tar"
    write_oci_archive(img, archive, tmp_path)
    assert (await upload(client, "defaults", archive, start="true")).status_code == 201
    r = await client.post(
        "/v1/sandboxes", json={"image": "defaults", "env": {"OVERRIDE": "sandbox"}}
    )
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    out = await client.post(
        f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo $GREETING $OVERRIDE $PATH; pwd"}
    )
    assert out.json()["stdout"].split() == ["from-image", "sandbox", "/usr/bin:/bin", "/tmp"]
    own = await client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "pwd", "cwd": "/"})
    assert own.json()["stdout"].split() == ["/"]
    procs = (await client.get(f"/v1/sandboxes/{sid}/processes")).json()["processes"]
    assert [p["argv"] for p in procs] == [img.cmd]
    assert procs[0]["state"] == "running"


async def test_the_image_user_applies_unless_the_request_names_one(
    served: tuple[httpx.AsyncClient, Services], tmp_path: Path
) -> None:
    """The fake sandbox cannot switch users (bubblewrap): running as the image's user
    fails there, which shows it was asked for; tests/vm checks it really switches."""
    client, _ = served
    archive = tmp_path / "user.tar"
    write_oci_archive(image("user", user="65534"), archive, tmp_path)
    assert (await upload(client, "withuser", archive)).status_code == 201
    sid = (await client.post("/v1/sandboxes", json={"image": "withuser"})).json()["id"]
    as_image_user = await client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["id", "-u"]})
    assert as_image_user.status_code == 400
    assert "permission denied" in as_image_user.json()["error"]["message"]
    as_root = await client.post(
        f"/v1/sandboxes/{sid}/exec", json={"cmd": ["id", "-u"], "user": "root"}
    )
    assert as_root.json()["stdout"].strip() == "0"


async def test_delete_is_refused_while_used_and_names_the_users(
    served: tuple[httpx.AsyncClient, Services], tmp_path: Path
) -> None:
    client, _ = served
    img = image("used")
    archive = tmp_path / "u.tar"
    write_oci_archive(img, archive, tmp_path)
    assert (await upload(client, "used", archive)).status_code == 201
    sid = (await client.post("/v1/sandboxes", json={"image": "used"})).json()["id"]
    r = await client.delete("/v1/images/used")
    assert r.status_code == 409
    assert sid in r.json()["error"]["message"]
    assert (await client.delete(f"/v1/sandboxes/{sid}")).status_code == 204
    assert (await client.delete("/v1/images/used")).status_code == 204
    assert (await client.delete("/v1/images/used")).status_code == 404
    assert leftovers(tmp_path) == []
    # A named snapshot of a sandbox of it keeps it too, after the sandbox is gone.
    assert (await upload(client, "used", archive)).status_code == 201
    sid = (await client.post("/v1/sandboxes", json={"image": "used"})).json()["id"]
    snap = await client.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "ready"})
    assert snap.status_code == 201, snap.text
    assert (await client.delete(f"/v1/sandboxes/{sid}")).status_code == 204
    r = await client.delete("/v1/images/used")
    assert r.status_code == 409 and snap.json()["id"] in r.json()["error"]["message"]
    assert (await client.delete(f"/v1/snapshots/{snap.json()['id']}")).status_code == 204
    assert (await client.delete("/v1/images/used")).status_code == 204
    builtin = await client.delete("/v1/images/base")
    assert builtin.status_code == 409 and "built-in" in builtin.json()["error"]["message"]
    gone = await client.post("/v1/sandboxes", json={"image": "used"})
    assert gone.status_code == 400 and gone.json()["error"]["code"] == "unknown_image"


async def test_content_shared_by_two_names_stays_until_both_go(
    served: tuple[httpx.AsyncClient, Services], tmp_path: Path
) -> None:
    client, _ = served
    archive = tmp_path / "s.tar"
    write_oci_archive(image("shared"), archive, tmp_path)
    assert (await upload(client, "s1", archive)).status_code == 201
    assert (await upload(client, "s2", archive)).status_code == 201
    assert (await client.delete("/v1/images/s1")).status_code == 204
    assert len(leftovers(tmp_path)) == 1
    r = await client.post("/v1/sandboxes", json={"image": "s2"})
    assert r.status_code == 201
    await client.delete(f"/v1/sandboxes/{r.json()['id']}")
    assert (await client.delete("/v1/images/s2")).status_code == 204
    assert leftovers(tmp_path) == []


async def test_an_images_templates_leave_the_blob_store_with_its_last_name(
    tmp_path: Path,
) -> None:
    """Templates are keyed by content: whoever built them, they go from the bucket (and
    their records from the database) once no image row names the content."""
    async with _served(tmp_path, blob_url=f"file://{tmp_path}/bucket") as (client, svc):
        archive = tmp_path / "t.tar"
        write_oci_archive(image("templated"), archive, tmp_path)
        r = await upload(client, "t1", archive)
        assert r.status_code == 201, r.text
        assert (await upload(client, "t2", archive)).status_code == 201
        blobs = svc.sandboxes.templates.blobs
        assert blobs.store is not None and blobs.records is not None
        content = "oci/" + r.json()["digest"].replace(":", "-")
        src = tmp_path / "blob"
        src.write_bytes(b"{}")
        prefixes = [template_prefix(c, k * 64) for c in (content, "base/0123") for k in "ab"]
        for prefix in prefixes:
            blobs.store.put(prefix + "index.json", src)
            blobs.records.put(prefix, {"index.json": FileSum(2, "0" * 64)}, {})
        assert (await client.delete("/v1/images/t1")).status_code == 204
        assert all(blobs.records.get(p) is not None for p in prefixes)  # t2 names it
        assert (await client.delete("/v1/images/t2")).status_code == 204
        assert blobs.store.list_prefix(f"templates/{content}/") == []
        assert [p for p in prefixes if blobs.records.get(p) is not None] == prefixes[2:]
        assert len(blobs.store.list_prefix("templates/base/0123/")) == 2


async def test_pull_requests_are_validated(
    served: tuple[httpx.AsyncClient, Services],
) -> None:
    client, _ = served
    r = await client.post("/v1/images", json={"name": "p", "ref": "Not A Ref"})
    assert r.status_code == 400 and "repository[:tag]" in r.json()["error"]["message"]
    r = await client.post("/v1/images", json={"name": "p"})
    assert r.status_code == 400 and "ref" in r.json()["error"]["message"]
    r = await client.post("/v1/images", json={"name": "p", "ref": "x", "bogus": 1})
    assert r.status_code == 400
    r = await client.post("/v1/images", json={"name": "p", "ref": "x", "username": "u"})
    assert r.status_code == 400 and "password" in r.json()["error"]["message"]
    # A loopback port where nothing listens: the registry cannot be reached (502).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = await client.post("/v1/images", json={"name": "p", "ref": f"127.0.0.1:{port}/x:1"})
    assert r.status_code == 502 and r.json()["error"]["code"] == "registry_error"
    assert "p" not in [i["name"] for i in (await client.get("/v1/images")).json()["images"]]


async def test_two_imports_of_one_name_race_to_one_winner(
    served: tuple[httpx.AsyncClient, Services], tmp_path: Path
) -> None:
    client, _ = served
    a, b = tmp_path / "a.tar", tmp_path / "b.tar"
    write_oci_archive(image("race-a"), a, tmp_path / "wa")
    write_oci_archive(image("race-b"), b, tmp_path / "wb")
    results = await asyncio.gather(upload(client, "race", a), upload(client, "race", b))
    assert sorted(r.status_code for r in results) == [201, 409]
    loser = next(r for r in results if r.status_code == 409).json()["error"]["message"]
    assert "already running" in loser or "already exists" in loser
    assert [i["name"] for i in (await client.get("/v1/images")).json()["images"]].count("race") == 1
    assert not list((tmp_path / "state" / "imports").glob("*"))


async def _project_key(client: httpx.AsyncClient, project: str) -> dict[str, str]:
    r = await client.post("/v1/projects", json={"name": project})
    assert r.status_code == 201, r.text
    r = await client.post(f"/v1/projects/{project}/keys", json={"name": "k", "role": "developer"})
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['secret']}"}


async def test_images_are_per_project_and_a_name_may_exist_in_two(
    served: tuple[httpx.AsyncClient, Services], tmp_path: Path
) -> None:
    client, _ = served
    alpha, beta = await _project_key(client, "alpha"), await _project_key(client, "beta")
    one, two = tmp_path / "one.tar", tmp_path / "two.tar"
    write_oci_archive(image("alpha's"), one, tmp_path)
    write_oci_archive(image("beta's"), two, tmp_path)

    async def up(key: dict[str, str], name: str, path: Path) -> httpx.Response:
        return await client.post(
            "/v1/images",
            params={"name": name},
            content=path.read_bytes(),  # noqa: ASYNC240 - small test archives
            headers={"Content-Type": "application/x-tar", **key},
        )

    def names(r: httpx.Response) -> dict[str, str | None]:
        assert r.status_code == 200, r.text
        return {i["name"]: i["project"] for i in r.json()["images"]}

    made = await up(alpha, "app", one)
    assert made.status_code == 201, made.text
    assert made.json()["project"] == "alpha"
    # Only alpha sees and boots it; the built-ins are everyone's.
    assert names(await client.get("/v1/images", headers=alpha)) == {
        "base": None, "devbox": None, "app": "alpha",
    }  # fmt: skip
    assert names(await client.get("/v1/images", headers=beta)) == {"base": None, "devbox": None}
    r = await client.post("/v1/sandboxes", json={"image": "app"}, headers=beta)
    assert r.status_code == 400 and "unknown image 'app'" in r.json()["error"]["message"], r.text
    r = await client.delete("/v1/images/app", headers=beta)
    assert r.status_code == 404, r.text
    r = await client.get("/v1/images", params={"project": "alpha"}, headers=beta)
    assert r.status_code == 404, r.text
    # The same name in beta is its own image, with other content.
    theirs = await up(beta, "app", two)
    assert theirs.status_code == 201, theirs.text
    assert theirs.json()["digest"] != made.json()["digest"]
    # A name of a built-in is never taken.
    r = await up(beta, "base", two)
    assert r.status_code == 409 and "built-in" in r.json()["error"]["message"], r.text
    sandbox = await client.post("/v1/sandboxes", json={"image": "app"}, headers=alpha)
    assert sandbox.status_code == 201, sandbox.text
    assert sandbox.json()["image"] == "app"
    # The admin sees every project's (each naming its project), or one's with ?project=.
    every = (await client.get("/v1/images")).json()["images"]
    assert sorted((i["name"], i["project"]) for i in every if i["project"]) == [
        ("app", "alpha"), ("app", "beta"),
    ]  # fmt: skip
    assert names(await client.get("/v1/images", params={"project": "beta"}))["app"] == "beta"
    # beta's delete leaves alpha's, in use, alone; alpha's is refused while its sandbox lives.
    assert (await client.delete("/v1/images/app", headers=beta)).status_code == 204
    r = await client.delete("/v1/images/app", headers=alpha)
    assert r.status_code == 409 and sandbox.json()["id"] in r.json()["error"]["message"]
    assert (
        await client.delete(f"/v1/sandboxes/{sandbox.json()['id']}", headers=alpha)
    ).status_code == 204
    assert (await client.delete("/v1/images/app", headers=alpha)).status_code == 204
    assert leftovers(tmp_path) == []
