"""The initramfs: static busybox, the virtio modules and an ``/init`` that mounts
``/dev/vda`` and switches to the root disk's ``/sbin/hutch-init``.

The cpio archive is written here (newc format, every mtime 0, owner root) rather than by
the host's ``cpio``: that makes it byte-for-byte reproducible, so its digest can key the
image cache, and lets it hold ``/dev/console`` without ``mknod`` on the host.
"""

from __future__ import annotations

import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from hutch.errors import ImageBuildError
from hutch.images.elf import parse_elf

__all__ = [
    "BUSYBOX_APPLETS",
    "OCI_APPLETS",
    "CpioEntry",
    "build_initramfs",
    "init_script",
    "write_cpio",
]

#: Applets /init calls, linked to /bin/busybox (busybox picks the applet by argv[0]).
BUSYBOX_APPLETS: tuple[str, ...] = (
    "sh",
    "mount",
    "umount",
    "insmod",
    "switch_root",
    "poweroff",
    "reboot",
    "sleep",
    "mkdir",
    "cat",
    "test",
    "[",
    "ln",
    "ip",
)
MODULES_DIR = "lib/modules"
LOAD_ORDER_FILE = "lib/modules/load-order"


@dataclass(frozen=True)
class CpioEntry:
    """One archive member; ``name`` has no leading '/'."""

    name: str
    mode: int  # including the file-type bits
    data: bytes = b""
    rdev: tuple[int, int] = (0, 0)


def _pad4(n: int) -> bytes:
    return b"\0" * (-n % 4)


def write_cpio(entries: Iterable[CpioEntry]) -> bytes:
    """A newc ("070701") archive of ``entries`` plus the trailer. Pure and deterministic:
    inode numbers are assigned in order, uid/gid and mtime are 0."""
    out = bytearray()
    for ino, entry in enumerate((*entries, CpioEntry("TRAILER!!!", 0)), start=1):
        name = entry.name.encode() + b"\0"
        is_dir = stat.S_ISDIR(entry.mode)
        fields = (
            ino if entry.name != "TRAILER!!!" else 0,
            entry.mode,
            0,
            0,
            2 if is_dir else 1,
            0,
            len(entry.data),
            0,
            0,
            entry.rdev[0],
            entry.rdev[1],
            len(name),
            0,
        )
        header = b"070701" + b"".join(b"%08X" % f for f in fields)
        out += header + name + _pad4(len(header) + len(name))
        out += entry.data + _pad4(len(entry.data))
    return bytes(out)


#: What the initramfs of imported (OCI) images calls on top: it does hutch-init's work
#: itself, since the image may have no shell and none of the tools.
OCI_APPLETS: tuple[str, ...] = (*BUSYBOX_APPLETS, "printf")


def init_script(name: str = "initramfs-init") -> bytes:
    """An initramfs ``/init`` shipped in guest_files/ (``initramfs-init`` for hutch's
    own images, ``initramfs-init-oci`` for imported ones)."""
    return resources.files("hutch.images").joinpath(f"guest_files/{name}").read_bytes()


def initramfs_entries(
    busybox: bytes,
    modules: Sequence[tuple[str, bytes]],
    init: bytes | None = None,
    applets: Sequence[str] = BUSYBOX_APPLETS,
) -> list[CpioEntry]:
    """Archive members: directories, device nodes, busybox + applet links, the modules
    (``(file name, bytes)`` in load order) and the order file /init reads. ``init``:
    the /init script (default: hutch's own images')."""
    d, f, x = stat.S_IFDIR | 0o755, stat.S_IFREG | 0o644, stat.S_IFREG | 0o755
    entries = [
        CpioEntry(n, d) for n in ("bin", "dev", "proc", "sys", "newroot", "lib", MODULES_DIR)
    ]
    # The kernel opens /dev/console for /init's stdio before anything mounts devtmpfs.
    entries.append(CpioEntry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1)))
    entries.append(CpioEntry("dev/null", stat.S_IFCHR | 0o666, rdev=(1, 3)))
    entries.append(CpioEntry("bin/busybox", x, busybox))
    entries += [CpioEntry(f"bin/{a}", stat.S_IFLNK | 0o777, b"busybox") for a in applets]
    entries += [CpioEntry(f"{MODULES_DIR}/{name}", f, data) for name, data in modules]
    order = "".join(f"{name}\n" for name, _ in modules).encode()
    entries.append(CpioEntry(LOAD_ORDER_FILE, f, order))
    entries.append(CpioEntry("init", x, init if init is not None else init_script()))
    return entries


def build_initramfs(
    busybox: Path,
    modules: Sequence[Path],
    out: Path,
    init: bytes | None = None,
    applets: Sequence[str] = BUSYBOX_APPLETS,
) -> None:
    """Write the uncompressed initramfs to ``out``.

    Uncompressed because the kernel unpacks it in the guest, where gzip costs TCG time
    and the archive is only ~2.5 MB. Raises ``ImageBuildError`` for a dynamic busybox.
    """
    data = busybox.read_bytes()
    info = parse_elf(data)
    if info.has_interp:
        raise ImageBuildError(
            f"{busybox} is dynamically linked; the initramfs needs a static busybox "
            "(apt-get install busybox-static)"
        )
    out.write_bytes(
        write_cpio(
            initramfs_entries(data, [(m.name, m.read_bytes()) for m in modules], init, applets)
        )
    )
