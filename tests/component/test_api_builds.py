"""``POST /v1/images?dockerfile=...`` refusals through the real REST app, service, store
and builder: a Dockerfile or context hutch cannot build is a 400 naming what is wrong
(the line, for a Dockerfile), before any build sandbox exists, and leaves nothing
behind (no image, no sandbox, no spooled context, no half-made layer). What builds do
in real VMs is tests/vm/test_dockerfile_build.py."""

from __future__ import annotations

import asyncio
import io
import json
import tarfile
from pathlib import Path

import httpx
import pytest

from hutch.services.composed import Services
from tests.component.test_api_images import leftovers, served

__all__ = ["served"]  # the fixture, shared with test_api_images

pytestmark = pytest.mark.usefixtures("served")


def context_tar(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def build(
    client: httpx.AsyncClient,
    files: dict[str, str],
    ctype: str = "application/x-tar",
    **params: str,
) -> httpx.Response:
    return await client.post(
        "/v1/images",
        params={"name": "built", "dockerfile": "Dockerfile", **params},
        content=context_tar(files),
        headers={"Content-Type": ctype},
    )


def nothing_left(tmp_path: Path, svc: Services) -> None:
    assert leftovers(tmp_path) == []
    assert svc.sandboxes.list_sandboxes() == []  # no build sandbox was ever made
    cache = svc.settings.build_cache_dir
    assert not cache.exists() or [p.name for p in cache.iterdir()] == []


BAD = [
    ("FROM base\nRUN true\nFROBNICATE now\n", "line 3", "FROBNICATE"),
    ("FROM base\nHEALTHCHECK CMD true\n", "line 2", "HEALTHCHECK"),
    ("FROM base\nCOPY missing.txt /app/\n", "line 2", "missing.txt"),
    ("RUN true\n", "line 1", "FROM"),
    ("FROM base AS one\nRUN true\nFROM one\n", "line 3", "FROM"),
    ("FROM not a/valid ref!\n", "line 1", "FROM"),
]


@pytest.mark.parametrize(("dockerfile", "line", "word"), BAD)
async def test_a_bad_dockerfile_is_400_naming_the_line(
    served: tuple[httpx.AsyncClient, Services],
    tmp_path: Path,
    dockerfile: str,
    line: str,
    word: str,
) -> None:
    client, svc = served
    r = await build(client, {"Dockerfile": dockerfile, "present.txt": "x"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_dockerfile", error
    assert line in error["message"] and word in error["message"], error["message"]
    names = [i["name"] for i in (await client.get("/v1/images")).json()["images"]]
    assert "built" not in names
    nothing_left(tmp_path, svc)


async def test_bad_requests_name_what_is_accepted(
    served: tuple[httpx.AsyncClient, Services], tmp_path: Path
) -> None:
    client, svc = served
    ok = {"Dockerfile": "FROM base\nARG V=1\nRUN echo $V\n"}
    cases = [
        (await build(client, {"other": "x"}), "no Dockerfile at 'Dockerfile'"),
        (await build(client, ok, build_arg="NOPE=1"), "NOPE"),
        (await build(client, ok, build_arg="novalue"), "NAME=value"),
        (await build(client, ok, ctype="application/json"), "context as a tar"),
        (await build(client, ok, egress="not a rule!"), "not a rule!"),
        (await build(client, ok, network="none", egress="pypi.org"), 'network "none"'),
    ]
    for r, needle in cases:
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]["message"], r.json()
    bad_tar = await client.post(
        "/v1/images", params={"name": "built", "dockerfile": "Dockerfile"},
        content=b"not a tar" * 100, headers={"Content-Type": "application/x-tar"},
    )  # fmt: skip
    assert bad_tar.status_code == 400 and "not a tar" in bad_tar.json()["error"]["message"]
    nothing_left(tmp_path, svc)


async def test_refusals_as_ndjson_carry_their_status(
    served: tuple[httpx.AsyncClient, Services], tmp_path: Path
) -> None:
    client, svc = served
    async with client.stream(
        "POST", "/v1/images",
        params={"name": "built", "dockerfile": "Dockerfile", "progress": "true"},
        content=context_tar({"Dockerfile": "FROM base\nONBUILD RUN true\n"}),
        headers={"Content-Type": "application/x-tar"},
    ) as s:  # fmt: skip
        assert s.status_code == 201
        events = [json.loads(line) async for line in s.aiter_lines() if line]
    assert events[0]["type"] == "status"
    last = events[-1]
    assert last["type"] == "error" and last["status"] == 400
    assert last["error"]["code"] == "invalid_dockerfile" and "line 2" in last["error"]["message"]
    nothing_left(tmp_path, svc)


async def test_a_restarted_daemon_removes_what_interrupted_builds_left(
    served: tuple[httpx.AsyncClient, Services], tmp_path: Path
) -> None:
    """A build cut by a daemon stop leaves a build sandbox (tagged hutch.build) and maybe
    a step being committed (.work-*): the next start removes both, and keeps the build
    sandboxes of builds that run now."""
    from hutch.images.build import ImageArtifacts
    from hutch.models import SandboxSpec
    from hutch.services.image_builder import BUILD_TAG, ImageBuilder
    from hutch.services.image_import import ImageImporter
    from hutch.services.images import HostImages

    _, svc = served
    images = svc.core.image_source
    assert isinstance(images, HostImages)
    step = ImageArtifacts(
        name=".build-stale-2", digest="1" * 16, kernel=tmp_path / "vmlinux",
        initrd=tmp_path / "initrd", rootfs=tmp_path / "layer.qcow2",
        kernel_release="6.1.0-fake", cmdline="", size_bytes=1 << 30, ephemeral=True,
    )  # fmt: skip
    images.add_ephemeral(step)
    stale = await svc.sandboxes.create(SandboxSpec(image=step.name, metadata={BUILD_TAG: "stale"}))
    live = await svc.sandboxes.create(SandboxSpec(image=step.name, metadata={BUILD_TAG: "running"}))
    mine = await svc.sandboxes.create(SandboxSpec(image=step.name))
    work = svc.settings.build_cache_dir / ".work-abc"
    work.mkdir(parents=True)
    (work / "disk.qcow2").write_bytes(b"half")

    builder = ImageBuilder(
        svc.settings,
        images,
        ImageImporter(svc.settings, images, svc.core),
        sandboxes=svc.sandboxes,
        lifecycle=svc.lifecycle,
        guest=svc.guest,
        reconciler=svc.reconciler,
    )
    builder._in_use["running"] = set()  # a build of this daemon, running now
    builder.start()
    try:
        for _ in range(100):
            if svc.sandboxes.get(stale.id).state.value == "destroyed":
                break
            await asyncio.sleep(0.05)
        assert svc.sandboxes.get(stale.id).state.value == "destroyed"
        assert svc.sandboxes.get(live.id).state.is_live and svc.sandboxes.get(mine.id).state.is_live
        assert not work.exists()
    finally:
        await builder.close()
        images.drop_ephemeral(step.name)
