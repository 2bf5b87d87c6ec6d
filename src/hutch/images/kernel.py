"""The guest kernel: Debian's ``linux-image-cloud-amd64`` as an uncompressed PVH ``vmlinux``
plus the virtio modules the initramfs loads.

Layout under ``<images_dir>``::

    cache/debs/<package>_<version>_amd64.deb     downloaded once
    kernel/<key>/vmlinux                         uncompressed ELF with the PVH note
    kernel/<key>/modules/<name>.ko               in load order (see kernel.json)
    kernel/<key>/kernel.json                     written last: its presence = complete

``<key>`` hashes the real package name, version and .deb checksum, the module list and
this module's format version, so a new Debian kernel makes a new directory.
"""

from __future__ import annotations

import gzip
import json
import lzma
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hutch.errors import ImageBuildError
from hutch.images import _proc
from hutch.images.cache import atomic_write_text, file_sha256, short_digest
from hutch.images.elf import find_payload, parse_elf

__all__ = [
    "KERNEL_METAPACKAGE",
    "VIRTIO_MODULES",
    "KernelArtifacts",
    "KernelPackage",
    "kernel_key",
    "parse_apt_show",
    "prepare_kernel",
    "resolve_module_order",
]

KERNEL_METAPACKAGE = "linux-image-cloud-amd64"
#: Load order the guest needs (design.md); their dependencies are added from modules.dep.
#: virtio_rng is extra: it lets the VM layer feed host entropy with virtio-rng-device;
#: fuse (no dependencies; devtmpfs then makes /dev/fuse) serves shared volumes in the
#: guest (guest_agent ops_sharefs).
VIRTIO_MODULES: tuple[str, ...] = (
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_blk",
    "failover",
    "net_failover",
    "virtio_net",
    "virtio_console",
    "virtio_rng",
    "fuse",
)
_FORMAT = "kernel-v1"


@dataclass(frozen=True)
class KernelPackage:
    """The real kernel package behind the metapackage, as apt describes it."""

    name: str
    version: str


@dataclass(frozen=True)
class KernelArtifacts:
    key: str
    vmlinux: Path
    release: str
    modules: tuple[Path, ...]  # in load order
    package: KernelPackage
    builtin_ext4: bool


def parse_apt_show(text: str) -> dict[str, str]:
    """Fields of the first stanza of ``apt-cache show`` output (continuation lines folded)."""
    fields: dict[str, str] = {}
    last = ""
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        if line[0] in " \t" and last:
            fields[last] += "\n" + line.strip()
            continue
        key, sep, value = line.partition(":")
        if sep:
            last = key.strip()
            fields[last] = value.strip()
    return fields


def _depends_kernel(depends: str) -> KernelPackage:
    """The ``linux-image-<abi>-<flavour> (= <version>)`` dependency of the metapackage."""
    for alt in depends.split(","):
        m = re.match(r"^\s*(linux-image-\d\S*)\s*\(\s*=\s*([^)\s]+)\s*\)", alt.split("|")[0])
        if m:
            return KernelPackage(name=m.group(1), version=m.group(2))
    raise ImageBuildError(
        f"{KERNEL_METAPACKAGE} depends on no linux-image-<version> (= <version>): {depends!r}"
    )


def resolve_kernel_package() -> KernelPackage:
    """Ask the host's apt which real package the metapackage points at (no download).

    One ``apt-cache`` call (~1.3 s here, apt rebuilds its cache in memory each time): the
    metapackage pins the exact version; apt-get download checks the .deb's hash later.
    """
    hint = "; run apt-get update (the host's apt lists may be missing or stale)"
    try:
        meta = parse_apt_show(
            _proc.run(
                ["apt-cache", "show", "--no-all-versions", KERNEL_METAPACKAGE],
                what=f"looking up {KERNEL_METAPACKAGE}",
            )
        )
    except ImageBuildError as exc:
        raise ImageBuildError(f"{exc.message}{hint}") from exc
    if "Depends" not in meta:
        raise ImageBuildError(f"apt knows no {KERNEL_METAPACKAGE}{hint}")
    return _depends_kernel(meta["Depends"])


def kernel_key(pkg: KernelPackage, modules: Sequence[str] = VIRTIO_MODULES) -> str:
    """Cache key of the kernel layer (pure)."""
    return short_digest(_FORMAT, pkg.name, pkg.version, *modules)


def _module_name(path: str) -> str:
    base = path.rsplit("/", 1)[-1]
    base = re.sub(r"\.ko(\.(xz|zst|gz))?$", "", base)
    return base.replace("-", "_")


def resolve_module_order(modules_dep: str, wanted: Sequence[str]) -> list[str]:
    """Paths (relative to lib/modules/<release>) to insmod, dependencies first, each
    once, in ``wanted`` order otherwise. Raises ``ImageBuildError`` for a module that
    modules.dep does not list (it is built in or missing; the caller checks which)."""
    deps: dict[str, tuple[str, list[str]]] = {}
    for line in modules_dep.splitlines():
        path, sep, rest = line.partition(":")
        if sep:
            deps[_module_name(path)] = (path.strip(), rest.split())
    order: list[str] = []

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if name in chain:
            raise ImageBuildError(f"module dependency cycle: {' -> '.join((*chain, name))}")
        if name not in deps:
            raise ImageBuildError(f"module {name} is not in modules.dep")
        path, needs = deps[name]
        if path in order:
            return
        # modules.dep lists dependencies nearest-first; load the farthest first.
        for dep in reversed(needs):
            visit(_module_name(dep), (*chain, name))
        order.append(path)

    for name in wanted:
        visit(name.replace("-", "_"), ())
    return order


def _decompress_payload(bzimage: Path, out: Path) -> None:
    data = bzimage.read_bytes()
    payload = find_payload(data)
    blob = data[payload.offset : payload.offset + payload.length]
    # The kernel build appends the uncompressed size (u32 LE) to the payload; for gzip it
    # is the stream's own ISIZE trailer, for the others an extra word their tools reject.
    expected = int.from_bytes(blob[-4:], "little")
    if payload.compression == "gzip":
        out.write_bytes(gzip.decompress(blob))
    elif payload.compression == "xz":
        out.write_bytes(lzma.decompress(blob[:-4]))
    else:  # lz4 (legacy frame) and zstd: the host tools read them from a file
        with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".payload") as tmp:
            tmp.write(blob[:-4])
            tmp.flush()
            tool = {"lz4": "lz4", "zstd": "zstd"}[payload.compression]
            _proc.run([tool, "-dc", tmp.name], what="decompressing the kernel", stdout=out)
    elf = out.read_bytes()
    if len(elf) & 0xFFFFFFFF != expected:
        raise ImageBuildError(
            f"{bzimage.name}: decompressed kernel is {len(elf)} bytes, the bzImage says {expected}"
        )
    info = parse_elf(elf)
    if not info.pvh_bootable:
        raise ImageBuildError(
            f"{bzimage.name}: the kernel ELF has no Xen PVH entry note "
            "(XEN_ELFNOTE_PHYS32_ENTRY); it cannot boot with qemu -kernel vmlinux"
        )


def _copy_module(src: Path, dst: Path) -> None:
    if src.suffix == ".xz":
        dst.write_bytes(lzma.decompress(src.read_bytes()))
    elif src.suffix == ".gz":
        dst.write_bytes(gzip.decompress(src.read_bytes()))
    elif src.suffix == ".zst":
        _proc.run(["zstd", "-dc", src], what=f"decompressing {src.name}", stdout=dst)
    else:
        shutil.copyfile(src, dst)


def _load(kdir: Path, key: str) -> KernelArtifacts | None:
    meta_path = kdir / "kernel.json"
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    return KernelArtifacts(
        key=key,
        vmlinux=kdir / "vmlinux",
        release=meta["release"],
        modules=tuple(kdir / "modules" / m for m in meta["modules"]),
        package=KernelPackage(meta["package"]["name"], meta["package"]["version"]),
        builtin_ext4=meta["builtin_ext4"],
    )


def _download(pkg: KernelPackage, debs: Path) -> Path:
    """The .deb of ``pkg`` in ``debs``, downloaded by apt-get (which checks its hash
    against the signed index) unless already there."""
    debs.mkdir(parents=True, exist_ok=True)
    # Debian file names quote an epoch's ':' as %3a.
    final = debs / f"{pkg.name}_{pkg.version.replace(':', '%3a')}_amd64.deb"
    if final.is_file():
        return final
    with tempfile.TemporaryDirectory(dir=debs) as tmp:
        # apt's sandbox user cannot write into a root-owned temp dir; let it.
        os.chmod(tmp, 0o755)
        _proc.run(
            ["apt-get", "download", f"{pkg.name}={pkg.version}"],
            cwd=Path(tmp),
            what=f"downloading {pkg.name} {pkg.version}",
        )
        got = list(Path(tmp).glob("*.deb"))
        if len(got) != 1:
            raise ImageBuildError(f"apt-get download {pkg.name}={pkg.version} made {got}")
        os.replace(got[0], final)
    return final


def prepare_kernel(
    images_dir: Path, pkg: KernelPackage | None = None, force: bool = False
) -> KernelArtifacts:
    """Make sure the kernel layer for ``pkg`` (default: apt's candidate) exists; return it.

    The caller holds the kernel lock. Raises ``ImageBuildError``.
    """
    pkg = pkg or resolve_kernel_package()
    key = kernel_key(pkg)
    kdir = images_dir / "kernel" / key
    if not force and (found := _load(kdir, key)) is not None:
        return found
    deb = _download(pkg, images_dir / "cache" / "debs")
    kdir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=kdir.parent))
    try:
        root = work / "deb"
        _proc.run(["dpkg-deb", "-x", deb, root], what=f"unpacking {deb.name}")
        releases = [p.name for p in (root / "lib/modules").iterdir() if p.is_dir()]
        if len(releases) != 1:
            raise ImageBuildError(f"{deb.name}: expected one lib/modules/<release>, got {releases}")
        release = releases[0]
        vmlinuz = root / "boot" / f"vmlinuz-{release}"
        config = (root / "boot" / f"config-{release}").read_text()
        _decompress_payload(vmlinuz, work / "vmlinux")
        _proc.run(["depmod", "-b", root, release], what="depmod on the kernel's modules")
        mod_root = root / "lib/modules" / release
        builtin_ext4 = "\nCONFIG_EXT4_FS=y\n" in f"\n{config}\n"
        # ext4 as a module pulls jbd2, mbcache and crc16 in through modules.dep.
        wanted = VIRTIO_MODULES if builtin_ext4 else (*VIRTIO_MODULES, "ext4")
        order = resolve_module_order((mod_root / "modules.dep").read_text(), wanted)
        (work / "modules").mkdir()
        names: list[str] = []
        for rel in order:
            name = _module_name(rel) + ".ko"
            _copy_module(mod_root / rel, work / "modules" / name)
            names.append(name)
        shutil.rmtree(root)
        atomic_write_text(
            work / "kernel.json",
            json.dumps(
                {
                    "release": release,
                    "modules": names,
                    "package": {"name": pkg.name, "version": pkg.version},
                    "deb_sha256": file_sha256(deb),
                    "builtin_ext4": builtin_ext4,
                },
                indent=2,
            )
            + "\n",
        )
        if kdir.exists():  # force=True: images hard-link vmlinux, so they keep theirs
            shutil.rmtree(kdir)
        os.rename(work, kdir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    found = _load(kdir, key)
    assert found is not None
    return found
