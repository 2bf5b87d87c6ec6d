"""`hutch image import|pull|rm` and `hutch images` as a user runs them: the CLI process
against a real hutchd subprocess (and a real registry on loopback). No VM is booted:
what the guest sees is tests/vm/test_oci_images.py."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from hutch.images.build import ImageArtifacts
from tests.e2e.conftest import Daemon
from tests.ocikit import E, Image, Layer, layer_tar, push, write_docker_archive, write_layout
from tests.registry_server import running_registry


def small_image(tag: str) -> Image:
    return Image(
        layers=[
            Layer(layer_tar([E("etc", "dir"), E("etc/tag", data=tag.encode())])),
            Layer(layer_tar([E("srv", "dir"), E("srv/x", data=b"x" * 5000)]), "zstd"),
        ],
        working_dir="/srv",
        user="1000",
    )


def test_import_list_and_remove(daemon: Daemon, base_image: ImageArtifacts, tmp_path: Path) -> None:
    del base_image
    suffix = secrets.token_hex(3)
    img = small_image(f"e2e-{suffix}")
    archive = tmp_path / "img.tar"
    write_docker_archive(img, archive, tag="e2e/app:1")
    name = f"e2e-{suffix}"
    imported = daemon.cli("image", "import", name, str(archive), "--json")
    assert imported.returncode == 0, imported.stderr
    info = json.loads(imported.stdout)
    assert info["source"]["format"] == "docker-archive" and info["built"] is True
    assert f"{name}: " in imported.stderr  # progress, one line per stage off a terminal
    listed = {i["name"]: i for i in json.loads(daemon.cli("images", "--json").stdout)}
    assert listed[name]["config"]["working_dir"] == "/srv"
    table = daemon.cli("images").stdout
    assert any(
        line.startswith(name) and "docker-archive:img.tar" in line for line in table.splitlines()
    )
    again = daemon.cli("image", "import", name, str(archive))
    assert again.returncode == 1 and "already exists" in again.stderr
    layout = tmp_path / "layout"
    bad_img = Image(layers=[Layer(layer_tar([E("big", data=b"y" * 5000)]), "none")])
    write_layout([bad_img], layout)
    blob = layout / "blobs/sha256" / bad_img.layers[0].digest.split(":")[1]
    data = bytearray(blob.read_bytes())
    data[2000] ^= 0xFF  # inside the file's data: the tar still parses, the digest differs
    blob.write_bytes(bytes(data))
    bad = daemon.cli("image", "import", f"bad-{suffix}", str(layout))
    assert bad.returncode == 1 and "digest mismatch" in bad.stderr
    removed = daemon.cli("image", "rm", name)
    assert removed.returncode == 0 and removed.stdout.strip() == name
    names = {i["name"] for i in json.loads(daemon.cli("images", "--json").stdout)}
    assert name not in names and f"bad-{suffix}" not in names


def test_pull_with_basic_auth(daemon: Daemon, base_image: ImageArtifacts, tmp_path: Path) -> None:
    del base_image
    suffix = secrets.token_hex(3)
    img = small_image(f"pull-{suffix}")
    creds = ("ci", secrets.token_hex(8))
    with running_registry(tmp_path / "registry", creds) as registry:
        push(img, registry.url, "team/app", "1", creds)
        ref = f"{registry.host}/team/app:1"
        denied = daemon.cli("image", "pull", f"p-{suffix}", ref)
        assert denied.returncode == 1 and "needs credentials" in denied.stderr
        pulled = daemon.cli(
            "image", "pull", f"p-{suffix}", ref, "-u", creds[0], "--password-stdin", "--json",
            input=creds[1] + "\n",
        )  # fmt: skip
        assert pulled.returncode == 0, pulled.stderr
        assert json.loads(pulled.stdout)["digest"] == img.digest
        assert creds[1] not in pulled.stdout + pulled.stderr
    assert daemon.cli("image", "rm", f"p-{suffix}").returncode == 0
