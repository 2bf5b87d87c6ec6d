"""Imported OCI images in real VMs, end to end: REST + SDK + service + QEMU.

Two images are made here, offline, with tests/ocikit.py (not hutch's reader):

- ``debian``: the base image's mmdebstrap tree as its first layer (glibc, Python), then
  layers with whiteouts, an opaque directory, hard links, symlinks, xattrs, a setuid file
  and owned files; Env, WorkingDir, User (by name) and a start command (opted in);
- ``busybox``: static busybox only (no libc, no Python), a passwd without the image's
  user (User is numeric), no /proc, /sys, /dev, /run or /tmp; layers uncompressed, gzip
  and zstd.

They are served from a real registry (Debian's docker-registry on loopback; the busybox
one behind basic auth) and also imported as oci-archive and docker-archive. One sandbox
per image (VM boots are few: a fork and one template are restores or one extra boot),
several checks each: the tree in the guest equals the layers' tree, file by file
(checksums, modes, owners, link counts, symlink targets); Env/WorkingDir/User apply;
exec, files, background processes; the agent's runtime stays out of the user's way;
the code interpreter uses the image's Python or says clearly that there is none.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from hutch.errors import Conflict, InvalidArgument, InvalidImage, NotFound
from hutch.images.build import ImageArtifacts
from hutch.images.oci.importer import MOUNT_POINTS, content_dir
from hutch.models import Shape
from hutch.runtime.qemu.backend import QemuBackend
from hutch.sdk import AsyncClient, AsyncSandbox, ImageProgress
from hutch.services.composed import Services
from tests.conftest import ensure_image, test_images_dir
from tests.ocikit import (
    E,
    Image,
    Layer,
    Node,
    TreeModel,
    index_of,
    layer_tar,
    parse_guest_listing,
    push,
    tree_tar,
    write_docker_archive,
    write_layout,
    write_oci_archive,
)
from tests.registry_server import Registry, running_registry
from tests.vm.services import image_service, served

pytestmark = [pytest.mark.vm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

API_KEY = "hk_oci-test"
SHAPE = Shape(vcpus=1, memory_mib=512, disk_gib=2)
#: Paths the guest changes at boot by design: mount points (their own filesystems), the
#: files a container runtime provides (hostname, hosts, resolver, machine-id) and the
#: lost+found mkfs.ext4 makes.
BOOT_PATHS = (
    "/proc", "/sys", "/dev", "/run", "/lost+found",
    "/etc/hostname", "/etc/hosts", "/etc/resolv.conf", "/etc/machine-id",
)  # fmt: skip
CREDS = ("hutch", "s3cret-pw")


# -- the images ------------------------------------------------------------------------


def _base_tree() -> Path:
    base = ensure_image("base")
    assert isinstance(base, ImageArtifacts)
    manifest = json.loads((base.rootfs.parent / "manifest.json").read_text())
    tree: Path = test_images_dir() / "cache" / "trees" / manifest["tree_key"] / "root"
    assert (tree / "usr/bin/python3").exists(), tree
    return tree


def debian_image(work: Path) -> Image:
    tar = work / "debian-base.tar"
    tree_tar(_base_tree(), tar)
    layer1 = Layer(tar.read_bytes(), "gzip")
    tar.unlink()
    layer2 = Layer(
        layer_tar(
            [
                E("etc/motd", "whiteout"),
                E("usr/share/doc", "opaque"),
                E("usr/share/doc/README.hutch", data=b"only this is left\n"),
                E("srv", "dir"),
                E("srv/app", "dir", mode=0o775, uid=1000, gid=1000),
                E("srv/app/main.py", data=b"print('app')\n", uid=1000, gid=1000),
                E("srv/app/attrs", data=b"x", xattrs={"user.hutch": "kept", "user.two": "2"}),
                E("srv/app/data.bin", data=os.urandom(300_000)),
                E("srv/app/data.link", "hardlink", target="srv/app/data.bin"),
                E("srv/app/data.sym", "symlink", target="data.bin"),
                E("usr/local/bin/suid-tool", data=b"#!/bin/sh\nid\n", mode=0o4755),
                E("srv/shared", "dir", mode=0o2775, gid=100),
                E("srv/www", "dir"),
                E("srv/www/index.html", data=b"hello from the image\n"),
            ]
        ),
        "gzip",
    )
    layer3 = Layer(
        layer_tar(
            [
                E("srv/app/data.bin", data=b"replaced in layer 3\n"),  # the link keeps the old
                E("srv/app/main.py", "whiteout"),
                E("srv/www/second.html", data=b"2\n", mode=0o600, uid=1000, gid=1000),
            ]
        ),
        "zstd",
    )
    return Image(
        layers=[layer1, layer2, layer3],
        env=["PATH=/usr/local/bin:/usr/bin:/bin", "APP_MODE=test"],
        working_dir="/srv/app",
        user="user",
        cmd=["python3", "-m", "http.server", "8000", "--bind", "127.0.0.1", "-d", "/srv/www"],
        exposed_ports=["8000/tcp"],
    )


def busybox_image() -> Image:
    busybox = Path(shutil.which("busybox") or "/bin/busybox").read_bytes()
    applets = subprocess.run(
        ["busybox", "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    entries = [E("bin", "dir"), E("bin/busybox", data=busybox, mode=0o755)]
    entries += [E(f"bin/{a}", "symlink", target="busybox") for a in applets if a != "busybox"]
    entries += [
        E("usr", "dir"),
        E("usr/lib", "dir"),
        E("lib", "symlink", target="usr/lib"),
        E("etc", "dir"),
        E("etc/passwd", data=b"root:x:0:0:root:/root:/bin/sh\n"),
        E("etc/group", data=b"root:x:0:\n"),
        E("home", "dir"),
        E("home/app", "dir", mode=0o750, uid=1000, gid=1000),
        E("home/app/lower", "dir"),
        E("home/app/lower/a", data=b"a"),
        E("home/app/lower/b", data=b"b"),
        E("opt", "dir"),
        E("opt/old", data=b"old"),
        E("opt/keep", data=b"keep"),
    ]
    layer2 = [
        E("home/app/lower", "opaque"),
        E("home/app/lower/c", data=b"c", uid=1000, gid=1000),
        E("opt/old", "whiteout"),
        E("lib/libthing.so", data=b"\x7fELF not really"),  # through the lib symlink
        E("opt/keep-link", "hardlink", target="opt/keep"),
        E("opt/fifo", "fifo"),
    ]
    layer3 = [
        E("opt/keep-link-2", "hardlink", target="opt/keep"),
        E("opt/setgid", "dir", mode=0o2750, gid=1000),
    ]
    return Image(
        layers=[
            Layer(layer_tar(entries), "gzip"),
            Layer(layer_tar(layer2), "none"),
            Layer(layer_tar(layer3), "zstd"),
        ],
        env=["PATH=/bin", "GREETING=hi from busybox"],
        working_dir="/home/app",
        user="1000:1000",
    )


def model_listing(img: Image, exclude: tuple[str, ...] = BOOT_PATHS) -> list[str]:
    """The layers' tree, plus the mount points hutch documents adding to an image that
    lacks them (MOUNT_POINTS; as a container runtime makes them)."""
    model = TreeModel()
    for layer in img.layers:
        model.apply(layer.tar)
    for name, mode in MOUNT_POINTS:
        model.nodes.setdefault(f"/{name}", Node("directory", mode, 0, 0))
    return model.listing(exclude)


# -- the service -----------------------------------------------------------------------


@dataclass
class Env:
    svc: Services
    client: AsyncClient
    anon: Registry
    authed: Registry
    debian: Image
    busybox: Image
    work: Path
    arm: Image


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Env]:
    work = tmp_path_factory.mktemp("oci")
    debian, busybox = await asyncio.to_thread(debian_image, work), busybox_image()
    images_dir = test_images_dir()
    # Content is cached by manifest digest: drop this test's, so the layers are applied
    # (and checked) every run.
    for img in (debian, busybox):
        shutil.rmtree(content_dir(images_dir, img.digest), ignore_errors=True)
    svc = image_service(work / "state")
    async with served(svc, API_KEY) as client:
        with (
            running_registry(work / "registry") as anon,
            running_registry(work / "registry-auth", CREDS) as authed,
        ):
            arm = Image(layers=[Layer(layer_tar([E("arm", data=b"arm")]))], architecture="arm64")
            both = index_of(
                [(arm.manifest(), "linux", "arm64"), (debian.manifest(), "linux", "amd64")]
            )
            await asyncio.to_thread(push, arm, anon.url, "test/debian", arm.digest)
            await asyncio.to_thread(push, debian, anon.url, "test/debian", "1", index=both)
            await asyncio.to_thread(push, arm, anon.url, "test/arm-only", "1")
            await asyncio.to_thread(push, busybox, authed.url, "test/busybox", "1", CREDS)
            yield Env(svc, client, anon, authed, debian, busybox, work, arm)


async def listing(sb: AsyncSandbox) -> list[str]:
    stat = await sb.exec(
        "find / -xdev -print0 | xargs -0 stat -c '%n|%F|%a|%u|%g|%h|%N'",
        user="root",
        env={"LC_ALL": "C", "QUOTING_STYLE": "literal"},
        timeout_s=600,
    )
    sums = await sb.exec(
        "find / -xdev -type f -print0 | xargs -0 sha256sum", user="root", timeout_s=600
    )
    assert stat.exit_code == 0 and sums.exit_code == 0, (stat.stderr, sums.stderr)
    return parse_guest_listing(stat.stdout, sums.stdout, BOOT_PATHS)


def diff(got: list[str], want: list[str]) -> str:
    a, b = set(got), set(want)
    return (
        "guest only:\n  "
        + "\n  ".join(sorted(a - b)[:40])
        + "\nlayers only:\n  "
        + ("\n  ".join(sorted(b - a)[:40]))
    )


# -- tests -----------------------------------------------------------------------------


async def test_pull_and_imports_give_the_same_image(env: Env) -> None:
    steps: list[ImageProgress] = []
    pulled = await env.client.pull_image(
        "debian", f"{env.anon.host}/test/debian:1", start=True, on_progress=steps.append
    )
    assert pulled.digest == env.debian.digest  # the index resolved to linux/amd64
    assert pulled.source["type"] == "registry"
    assert pulled.source["ref"] == f"{env.anon.host}/test/debian:1"
    assert pulled.source["digest"] == env.debian.digest
    assert {(p.layer, p.layers) for p in steps if p.stage == "layer"} == {(1, 3), (2, 3), (3, 3)}
    assert pulled.config is not None and pulled.config["user"] == "user"
    # The same image as an oci-archive: same digest, the cached content (no rebuild).
    archive = env.work / "debian.tar"
    await asyncio.to_thread(write_oci_archive, env.debian, archive, env.work / "l")
    again = await env.client.import_image("debian-archive", archive)
    assert again.digest == env.debian.digest
    assert again.source["format"] == "oci-archive"
    archive.unlink()
    # busybox: basic auth on the registry; then also as a docker-archive.
    with pytest.raises(InvalidArgument, match="needs credentials"):
        await env.client.pull_image("nope", f"{env.authed.host}/test/busybox:1")
    with pytest.raises(InvalidArgument, match="refused the credentials"):
        await env.client.pull_image(
            "nope", f"{env.authed.host}/test/busybox:1", username="hutch", password="wrong"
        )
    bb = await env.client.pull_image(
        "busybox", f"{env.authed.host}/test/busybox:1", username=CREDS[0], password=CREDS[1]
    )
    assert bb.digest == env.busybox.digest
    docker = env.work / "busybox-docker.tar"
    write_docker_archive(env.busybox, docker, tag="test/busybox:1")
    imported = await env.client.import_image("busybox-docker", docker)
    assert imported.source["format"] == "docker-archive"
    assert imported.config == bb.config
    names = {i.name: i for i in await env.client.list_images()}
    assert {"debian", "debian-archive", "busybox", "busybox-docker", "base"} <= set(names)
    assert names["busybox"].built and names["busybox"].source["type"] == "registry"


async def test_bad_pulls_are_refused_and_leave_nothing(env: Env) -> None:
    oci = test_images_dir() / "oci"
    # The content dirs, work dirs and locks a pull of the arm image could make, by its
    # digests: the images dir is shared with a test run beside this one (`make test`'s
    # other lane), which imports images of its own meanwhile.
    arm_hexes = {json.loads(env.arm.manifest())["config"]["digest"], env.arm.digest}
    arm_hexes |= {layer.digest for layer in env.arm.layers}
    arm_hexes = {d.split(":", 1)[1] for d in arm_hexes}

    def arm_entries() -> list[str]:
        return sorted(p.name for p in oci.iterdir() if any(h in p.name for h in arm_hexes))

    assert arm_entries() == []
    with pytest.raises(InvalidImage, match=r"is for linux/arm64|no linux/amd64"):
        await env.client.pull_image("arm", f"{env.anon.host}/test/arm-only:1")
    with pytest.raises(NotFound, match=r"MANIFEST_UNKNOWN|has no image"):
        await env.client.pull_image("missing", f"{env.anon.host}/test/debian:nope")
    assert arm_entries() == []
    names = {i.name for i in await env.client.list_images()}
    assert not {"arm", "missing"} & names
    assert not list((env.svc.settings.state_dir / "imports").glob("*"))


async def test_debian_image_runs_with_its_defaults(env: Env) -> None:
    sb = await AsyncSandbox.create(
        "debian", client=env.client, vcpus=SHAPE.vcpus, memory_mib=SHAPE.memory_mib,
        disk_gib=SHAPE.disk_gib, env={"FROM_SANDBOX": "1"},
    )  # fmt: skip
    got = await listing(sb)
    want = model_listing(env.debian)
    assert got == want, diff(got, want)
    assert len(got) > 5000

    who = await sb.exec("echo $APP_MODE $FROM_SANDBOX; pwd; id -un; echo $PATH")
    assert who.stdout.split() == ["test", "1", "/srv/app", "user", "/usr/local/bin:/usr/bin:/bin"]
    root = await sb.exec(["id", "-u"], user="root", cwd="/")
    assert root.stdout.strip() == "0"
    xattr = await sb.exec(
        ["python3", "-c", "import os; print(os.getxattr('/srv/app/attrs', 'user.hutch'))"]
    )
    assert xattr.stdout.strip() == "b'kept'"

    # The start command runs as the image's user, from its WorkingDir.
    procs = await sb.processes.list()
    assert [p.info.argv for p in procs] == [env.debian.cmd]
    fetch = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/').read())"
    for _ in range(100):
        page = await sb.exec(["python3", "-c", fetch])
        if page.exit_code == 0:
            break
        await asyncio.sleep(0.2)
    assert "hello from the image" in page.stdout
    owner = await sb.exec(f"ps -o user= -p {procs[0].pid}")
    assert owner.stdout.strip() == "user"

    # Files and background processes.
    blob = os.urandom(1 << 20)
    await sb.files.write("/srv/app/upload.bin", blob)
    assert await sb.files.read("/srv/app/upload.bin") == blob
    assert "upload.bin" in {e.name for e in await sb.files.list("/srv/app")}
    bg = await sb.processes.start("sleep 300")
    assert (await bg.refresh()).state == "running"
    await bg.kill()

    # The code interpreter runs the image's own Python.
    run = await sb.run_code("import sys; print(sys.executable); 6 * 7")
    assert run.error is None, run.error
    assert run.stdout.strip() == "/usr/bin/python3" and run.text == "42"

    # Nothing of the agent's runtime in the user's way.
    peek = await sb.exec(
        "env | grep -c -e LD_LIBRARY_PATH -e PYTHONHOME -e GLIBC_TUNABLES; "
        "ls -a /; grep -c ' /run/.hutch/rt ext4 ro' /proc/mounts; command -v python3"
    )
    lines = peek.stdout.split()
    assert lines[0] == "0" and ".hutch" not in lines and "/usr/bin/python3" in lines

    # Fork: a restore of a VM with the runtime disk attached.
    (child,) = await sb.fork(1)
    seen = await child.exec("cat /srv/www/index.html; hostname; echo $APP_MODE")
    assert seen.stdout.split()[:4] == ["hello", "from", "the", "image"]
    assert seen.stdout.split()[-2] == child.id and seen.stdout.split()[-1] == "test"
    # The start command is the parent's, carried over in memory, not started again.
    running = [p.info.argv for p in await child.processes.list() if p.info.running]
    assert running == [env.debian.cmd]
    await child.kill()
    await sb.kill()


async def test_busybox_image_without_libc_or_python(env: Env) -> None:
    sb = await AsyncSandbox.create(
        "busybox", client=env.client, vcpus=SHAPE.vcpus, memory_mib=SHAPE.memory_mib,
        disk_gib=SHAPE.disk_gib,
    )  # fmt: skip
    got = await listing(sb)
    want = model_listing(env.busybox)
    assert got == want, diff(got, want)
    assert "/usr/lib/libthing.so|regular" in "\n".join(got)

    who = await sb.exec("echo $GREETING; pwd; id")
    out = who.stdout.splitlines()
    assert out[:2] == ["hi from busybox", "/home/app"]
    assert out[2].startswith("uid=1000 gid=1000")
    nolibc = await sb.exec("ls /lib/ld-* /usr/lib/x86_64-linux-gnu /usr/bin/python3 2>&1; true")
    assert "No such file" in nolibc.stdout

    await sb.files.write("/home/app/note.txt", b"written from the host")
    cat = await sb.exec(["cat", "/home/app/note.txt"])
    assert cat.stdout == "written from the host"
    bg = await sb.processes.start(["sh", "-c", "echo bg-started; exec sleep 300"])
    for _ in range(50):
        if "bg-started" in (await bg.output()).stdout:
            break
        await asyncio.sleep(0.1)
    assert "bg-started" in (await bg.output()).stdout
    assert (await bg.refresh()).state == "running"
    await bg.kill()

    with pytest.raises(InvalidArgument) as err:
        await sb.run_code("1 + 1")
    assert "image 'busybox' has no python3" in err.value.message

    # The agent grew the filesystem to the disk (no resize2fs in the image).
    for _ in range(100):
        df = await sb.exec("df -m / | tail -1")
        if int(df.stdout.split()[1]) > 1500:
            break
        await asyncio.sleep(0.2)
    assert int(df.stdout.split()[1]) > 1500, df.stdout

    # In use: the image cannot be deleted, and the error names the sandbox.
    with pytest.raises(Conflict) as in_use:
        await env.client.delete_image("busybox")
    assert sb.id in in_use.value.message
    await sb.kill()


async def test_image_without_a_shell_or_etc(env: Env) -> None:
    """A distroless-like root: one static program, no /bin/sh, no /etc at all; imported
    from an OCI layout directory (the SDK sends it as an oci-archive)."""
    busybox = await asyncio.to_thread(Path(shutil.which("busybox") or "/bin/busybox").read_bytes)
    tool = E("app/busybox", data=busybox, mode=0o755)
    img = Image(layers=[Layer(layer_tar([E("app", "dir"), tool]))], env=["PATH=/app"])
    layout = env.work / "noshell-layout"
    write_layout([img], layout)
    info = await env.client.import_image("noshell", layout)
    assert info.source["format"] == "oci-archive" and info.digest == img.digest
    sb = await AsyncSandbox.create("noshell", client=env.client, memory_mib=256, disk_gib=1)
    out = await sb.exec(
        ["busybox", "sh", "-c", "echo distroless; busybox ls -a /; busybox hostname"]
    )
    lines = out.stdout.split()
    assert lines and lines[0] == "distroless" and lines[-1] == sb.id, (out, out.stderr)
    assert sorted(lines[1:-1]) == sorted([".", "..", "app", "dev", "lost+found", "proc",
                                          "run", "sys", "tmp"])  # fmt: skip
    with pytest.raises(InvalidArgument, match=r"command not found.*/bin/sh"):
        await sb.exec("echo needs a shell")
    await sb.files.write("/app/data", b"12345")
    assert await sb.files.read("/app/data") == b"12345"
    proc = await sb.processes.start(["busybox", "sleep", "100"])
    assert (await proc.refresh()).state == "running"
    with pytest.raises(InvalidArgument, match="has no python3"):
        await sb.run_code("1")
    await sb.kill()
    await env.client.delete_image("noshell")


async def test_template_of_an_imported_image(env: Env) -> None:
    """A template is taken after the agent says boot work is done (the image has no
    pgrep or sync to wait with); a create then restores it instead of booting."""
    svc = env.svc
    image = svc.core.image_source.find("busybox", "default")
    assert image is not None and image.runtime_disk is not None
    backend = svc.backend
    assert isinstance(backend, QemuBackend)
    await backend.templates.build(image, SHAPE)
    assert backend.templates.find(image, SHAPE) is not None
    svc.core.settings = dataclasses.replace(svc.settings, templates=True)
    try:
        sb = await AsyncSandbox.create(
            "busybox", client=env.client, vcpus=SHAPE.vcpus, memory_mib=SHAPE.memory_mib,
            disk_gib=SHAPE.disk_gib,
        )  # fmt: skip
    finally:
        svc.core.settings = dataclasses.replace(svc.settings, templates=False)
    out = await sb.exec("hostname; df -m / | tail -1; echo $GREETING")
    lines = out.stdout.splitlines()
    assert lines[0] == sb.id
    assert int(lines[1].split()[1]) > 1500
    assert lines[2] == "hi from busybox"
    await sb.kill()


async def test_delete_an_unused_image(env: Env) -> None:
    image = env.svc.core.image_source.find("busybox", "default")
    assert image is not None
    backend = env.svc.backend
    assert isinstance(backend, QemuBackend) and backend.templates.find(image, SHAPE)
    await env.client.delete_image("busybox")  # its sandboxes are gone: its template goes too
    assert backend.templates.find(image, SHAPE) is None
    assert not content_dir(test_images_dir(), env.busybox.digest).exists()
    await env.client.delete_image("busybox-docker")
    assert "busybox-docker" not in {i.name for i in await env.client.list_images()}
    with pytest.raises(NotFound):
        await env.client.delete_image("busybox-docker")
