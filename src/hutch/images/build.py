"""Building, finding and listing guest images (the ``hutch.images`` contract).

Layers, each cached and rebuilt only when its inputs change::

    kernel       by the Debian kernel package version         kernel.prepare_kernel
    tree         by suite + packages + mirrors                rootfs.prepare_tree
    image        by tree digest + agent + init + initramfs    here

An image lives in ``<images_dir>/<name>/<digest>/`` (rootfs.ext4 read-only, initrd.img,
vmlinux hard-linked from the kernel layer, manifest.json). The directory is assembled
under a temporary name with ``manifest.json`` written last and renamed into place, so a
directory that exists is complete; ``<name>/current`` then names the digest in use.
Builds of one image serialize on ``<images_dir>/<name>.lock``; the kernel layer, shared by
all images, on ``<images_dir>/kernel.lock``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hutch.errors import ImageBuildError
from hutch.images import _proc, identity
from hutch.images.cache import atomic_write_text, file_lock, file_sha256, short_digest
from hutch.images.catalog import IMAGES, get_recipe
from hutch.images.initramfs import build_initramfs
from hutch.images.kernel import KernelArtifacts, prepare_kernel, resolve_kernel_package
from hutch.images.rootfs import PackageTree, ext4_size_bytes, make_ext4, prepare_tree
from hutch.images.sources import host_mirror_lines

__all__ = [
    "DEFAULT_AGENT_PATH",
    "KERNEL_CMDLINE",
    "ImageArtifacts",
    "ImageInfo",
    "Progress",
    "agent_files",
    "agent_sha256",
    "build_image",
    "built_digests",
    "find_image",
    "image_at",
    "image_digest",
    "list_images",
]

_FORMAT = "image-v1"
#: A final image's digest (``short_digest``): the name of its directory.
_DIGEST = re.compile(r"^[0-9a-f]{16}$")
ROOTFS_LABEL = "hutch-root"

#: Where the guest agent's source lives in a checkout (src/hutch/images/ -> repo root):
#: a launcher ``agent.py`` and the ``hutch_agent`` package beside it.
DEFAULT_AGENT_PATH = Path(__file__).resolve().parents[3] / "guest_agent"
AGENT_LAUNCHER = "agent.py"
AGENT_PACKAGE = "hutch_agent"


def agent_files(agent_dir: Path) -> list[Path]:
    """The files of the guest agent, relative to ``agent_dir``, in a stable order."""
    files = [Path(AGENT_LAUNCHER)]
    files += sorted(p.relative_to(agent_dir) for p in (agent_dir / AGENT_PACKAGE).glob("*.py"))
    return files


def agent_sha256(agent_dir: Path) -> str:
    """One digest over the agent's file names and contents."""
    h = hashlib.sha256()
    for rel in agent_files(agent_dir):
        h.update(f"{rel}\0{file_sha256(agent_dir / rel)}\0".encode())
    return h.hexdigest()


#: Kernel command line the image's init needs; the VM layer appends hutch.hostname=<name>,
#: optionally hutch.dns=<ip>[,<ip>...] (written to /etc/resolv.conf), and under TCG its
#: TSC settings. reboot=t + panic=-1: a panic resets at once, which
#: QEMU -no-reboot turns into an exit. 8250.nr_uarts=1: microvm has only ttyS0; don't
#: probe more. i8042.*: microvm has no PS/2 controller; don't wait for one.
KERNEL_CMDLINE = (
    "console=ttyS0 reboot=t panic=-1 quiet 8250.nr_uarts=1 "
    "i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd"
)

#: ``progress(stage, fraction)``: stage names are "kernel", "packages", "initramfs",
#: "rootfs", "done"; fraction is 0.0-1.0 of the whole build, or None when unknown.
Progress = Callable[[str, float | None], None]


@dataclass(frozen=True)
class ImageArtifacts:
    """A complete image: what the VM layer boots."""

    name: str
    digest: str
    kernel: Path
    initrd: Path
    rootfs: Path
    kernel_release: str
    cmdline: str
    size_bytes: int  # virtual size of rootfs.ext4; a sandbox disk must be at least this
    #: The agent runtime disk (imported OCI images; hutch's own images carry the agent
    #: in their root filesystem and have None).
    runtime_disk: Path | None = None
    #: ``raw`` (an ext4 image), or ``qcow2`` (a Dockerfile build's step layer).
    rootfs_format: str = "raw"
    #: Booted once and thrown away (a Dockerfile build step): no template, no pool.
    ephemeral: bool = False


@dataclass(frozen=True)
class ImageInfo:
    """A catalog entry and what is built of it."""

    name: str
    description: str
    packages: tuple[str, ...]
    built: bool
    digest: str | None
    size_bytes: int | None
    built_at: float | None  # unix time


def _noop(stage: str, fraction: float | None) -> None:
    del stage, fraction


def image_digest(
    name: str,
    tree_digest: str,
    agent_sha: str,
    init_sha: str,
    initrd_sha: str,
    kernel_key: str,
    cmdline: str,
) -> str:
    """Content key of a final image (pure)."""
    return short_digest(
        _FORMAT, name, tree_digest, agent_sha, init_sha, initrd_sha, kernel_key, cmdline
    )


def _init_path() -> Path:
    return Path(__file__).resolve().parent / "guest_files" / "hutch-init"


def _read_manifest(image_dir: Path) -> dict[str, object] | None:
    try:
        data = json.loads((image_dir / "manifest.json").read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _artifacts(image_dir: Path, manifest: dict[str, object]) -> ImageArtifacts:
    return ImageArtifacts(
        name=str(manifest["name"]),
        digest=str(manifest["digest"]),
        kernel=image_dir / "vmlinux",
        initrd=image_dir / "initrd.img",
        rootfs=image_dir / "rootfs.ext4",
        kernel_release=str(manifest["kernel_release"]),
        cmdline=str(manifest["cmdline"]),
        size_bytes=int(str(manifest["size_bytes"])),
    )


def image_at(image_dir: Path) -> ImageArtifacts | None:
    """The complete image in ``image_dir`` (a ``<name>/<digest>/`` directory: its
    manifest and the kernel, initramfs and rootfs it names), or None."""
    manifest = _read_manifest(image_dir)
    if manifest is None:
        return None
    try:
        arts = _artifacts(image_dir, manifest)
    except (KeyError, ValueError):
        return None
    if not (arts.kernel.is_file() and arts.initrd.is_file() and arts.rootfs.is_file()):
        return None
    return arts


def find_image(name: str, images_dir: Path) -> ImageArtifacts | None:
    """The complete image ``<name>/current`` names, or None. Raises ``UnknownImage`` for
    a name not in the catalog. Does no building and no apt look-ups."""
    get_recipe(name)
    try:
        digest = (images_dir / name / "current").read_text().strip()
    except FileNotFoundError:
        return None
    return image_at(images_dir / name / digest)


def built_digests(name: str, images_dir: Path) -> list[str]:
    """The digests of image ``name`` built (or fetched) complete on this host, each a
    ``<name>/<digest>/`` directory, ``current``'s among them; sorted."""
    root = images_dir / name
    if not root.is_dir():
        return []
    return sorted(
        d.name
        for d in root.iterdir()
        if _DIGEST.match(d.name) and d.is_dir() and image_at(d) is not None
    )


def list_images(images_dir: Path) -> list[ImageInfo]:
    """Every catalog entry, sorted by name, with its built status."""
    out: list[ImageInfo] = []
    for name in sorted(IMAGES):
        recipe = IMAGES[name]
        arts = find_image(name, images_dir)
        built_at = None
        if arts is not None:
            manifest = _read_manifest(arts.rootfs.parent) or {}
            built_at = float(str(manifest.get("built_at", 0)))
        out.append(
            ImageInfo(
                name=name,
                description=recipe.description,
                packages=recipe.packages,
                built=arts is not None,
                digest=arts.digest if arts else None,
                size_bytes=arts.size_bytes if arts else None,
                built_at=built_at,
            )
        )
    return out


def _assemble(
    name: str,
    digest: str,
    tree: PackageTree,
    kernel: KernelArtifacts,
    agent: Path,
    initrd_src: Path,
    image_dir: Path,
) -> None:
    """Build ``image_dir`` (must not exist) from the layers."""
    work = Path(tempfile.mkdtemp(prefix=f".{digest}.", dir=image_dir.parent))
    try:
        # Hard-link copy of the tree: nothing is copied, and the files added below are
        # new inodes, so the cached tree stays untouched.
        staging = work / "root"
        _proc.run(["cp", "-al", tree.root, staging], what="linking the package tree")
        (staging / "opt/hutch").mkdir(parents=True, exist_ok=True)
        for rel in agent_files(agent):
            agent_dst = staging / "opt/hutch" / rel
            agent_dst.parent.mkdir(parents=True, exist_ok=True)
            agent_dst.unlink(missing_ok=True)
            shutil.copyfile(agent / rel, agent_dst)
            agent_dst.chmod(0o644)
        # mmdebstrap leaves the build host's resolv.conf; it means nothing in a guest.
        # hutch-init writes it from hutch.dns= on the kernel command line.
        resolv = staging / "etc/resolv.conf"
        resolv.unlink(missing_ok=True)
        resolv.write_text("# hutch-init writes this from hutch.dns= at boot\n")
        resolv.chmod(0o644)
        init_dst = staging / "sbin/hutch-init"
        init_dst.unlink(missing_ok=True)
        shutil.copyfile(_init_path(), init_dst)
        init_dst.chmod(0o755)
        rootfs = work / "rootfs.ext4"
        size = ext4_size_bytes(tree.size_bytes, tree.files)
        make_ext4(staging, rootfs, size, ROOTFS_LABEL, uuid.UUID(hex=(digest * 2)[:32]))
        shutil.rmtree(staging)
        rootfs.chmod(0o444)
        # The content identity (issue 14): hashed once here, kept beside the rootfs
        # (.rootfs.ext4.sha256: it moves with the directory's rename below).
        rootfs_sha256 = identity.record(rootfs)
        shutil.copyfile(initrd_src, work / "initrd.img")
        (work / "initrd.img").chmod(0o444)
        try:
            os.link(kernel.vmlinux, work / "vmlinux")
        except OSError:  # another filesystem: copy instead
            shutil.copyfile(kernel.vmlinux, work / "vmlinux")
        manifest = {
            "name": name,
            "digest": digest,
            "kernel_release": kernel.release,
            "kernel_package": f"{kernel.package.name}={kernel.package.version}",
            "kernel_key": kernel.key,
            "cmdline": KERNEL_CMDLINE,
            "size_bytes": size,
            "tree_key": tree.key,
            "tree_digest": tree.digest,
            "agent_sha256": agent_sha256(agent),
            "rootfs_sha256": rootfs_sha256,
            "built_at": time.time(),
        }
        # Last: a directory with a manifest is complete.
        atomic_write_text(work / "manifest.json", json.dumps(manifest, indent=2) + "\n")
        work.chmod(0o755)
        if image_dir.exists():  # force=True over the same digest: swap, then remove
            old = image_dir.with_name(f".{digest}.old-{os.getpid()}")
            os.rename(image_dir, old)
            os.rename(work, image_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(work, image_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def build_image(
    name: str,
    images_dir: Path,
    progress: Progress | None = None,
    force: bool = False,
    *,
    mirrors: Sequence[str] | None = None,
    agent_path: Path = DEFAULT_AGENT_PATH,
) -> ImageArtifacts:
    """Build what is missing of image ``name`` and return the complete image.

    ``force`` rebuilds every layer (kernel, package tree, image) even when cached.
    ``mirrors``: apt lines (``deb URI SUITE COMPONENTS``) for mmdebstrap; default: the
    host's sources for the recipe's suite. ``agent_path``: the guest agent to bake in.
    Raises ``UnknownImage`` (name not in the catalog) or ``ImageBuildError`` (missing host
    tool or package, failing command with its stderr tail, missing agent source).
    Safe to call from several processes at once: they serialize on lock files.
    """
    recipe = get_recipe(name)
    report = progress or _noop
    tools = _proc.require_tools()
    if not (agent_path / AGENT_LAUNCHER).is_file() or not (agent_path / AGENT_PACKAGE).is_dir():
        raise ImageBuildError(
            f"guest agent source {agent_path} does not exist; pass agent_path= or restore it"
        )
    images_dir.mkdir(parents=True, exist_ok=True)
    lines = list(mirrors) if mirrors is not None else host_mirror_lines(recipe.suite)

    report("kernel", 0.0)
    with file_lock(images_dir / "kernel.lock"):
        kernel = prepare_kernel(images_dir, resolve_kernel_package(), force=force)

    with file_lock(images_dir / f"{name}.lock"):
        report("packages", 0.05)
        tree = prepare_tree(recipe, lines, images_dir, force=force)

        report("initramfs", 0.7)
        (images_dir / name).mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory(dir=images_dir / name, prefix=".initrd.") as tmp:
            initrd = Path(tmp) / "initrd.img"
            build_initramfs(tools["busybox"], kernel.modules, initrd)
            digest = image_digest(
                name,
                tree.digest,
                agent_sha256(agent_path),
                file_sha256(_init_path()),
                file_sha256(initrd),
                kernel.key,
                KERNEL_CMDLINE,
            )
            image_dir = images_dir / name / digest
            if force or _read_manifest(image_dir) is None:
                report("rootfs", 0.75)
                _assemble(name, digest, tree, kernel, agent_path, initrd, image_dir)
        atomic_write_text(images_dir / name / "current", digest + "\n")
        _prune_trees(images_dir, name, keep=tree.key)

    arts = find_image(name, images_dir)
    if arts is None:
        raise ImageBuildError(f"image {name} {digest}: built but not found in {images_dir}")
    report("done", 1.0)
    return arts


def _prune_trees(images_dir: Path, name: str, keep: str) -> None:
    """Drop this image's older package trees (images built from them keep their own
    ext4 file; trees are only an input). Other images' trees are left alone."""
    trees = images_dir / "cache" / "trees"
    for tdir in trees.iterdir() if trees.is_dir() else ():
        if tdir.name == keep or tdir.name.startswith("."):
            continue
        try:
            owner = json.loads((tdir / "tree.json").read_text()).get("image")
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        if owner == name:
            shutil.rmtree(tdir, ignore_errors=True)
