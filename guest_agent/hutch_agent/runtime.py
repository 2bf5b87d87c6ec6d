"""Running on an image that is not hutch's own (``--runtime DIR``).

On an imported OCI image the agent does not use the image's Python or libc: hutch
attaches its own runtime (a read-only disk the initramfs mounts at ``DIR``, by default
``/run/.hutch/rt``) holding a Python interpreter, the standard library, the shared
libraries they need with their own dynamic loader, ``tini`` and ``ip``. The agent is
started as ``DIR/lib/ld-linux-x86-64.so.2 --library-path DIR/lib DIR/usr/bin/python3 ...``,
so nothing depends on the image's libc (musl, glibc or none at all). Commands the agent
runs get an environment built from scratch (``spawn``): they never see the runtime.

Here also the boot-time chores that ``/sbin/hutch-init`` does on hutch's own images and
that need tools an arbitrary image may lack: growing the root filesystem to the disk
(``EXT4_IOC_RESIZE_FS``, what ``resize2fs`` does online). When they are done the agent
creates ``BOOT_DONE`` (a template is only taken after that).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import sys
import threading

log = logging.getLogger("hutch-agent")

#: Where the runtime is mounted; None on hutch's own images.
RUNTIME: str | None = None
BOOT_DONE = "/run/.hutch/boot-done"
LOADER = "lib/ld-linux-x86-64.so.2"
EXT4_IOC_RESIZE_FS = 0x40086610  # _IOW('f', 16, __u64)


def configure(runtime_dir: str | None) -> None:
    global RUNTIME
    RUNTIME = runtime_dir.rstrip("/") if runtime_dir else None


def wrap(argv: list[str]) -> list[str]:
    """``argv`` of a runtime program (a path inside ``RUNTIME``) run through the
    runtime's own loader; unchanged on hutch's own images."""
    if RUNTIME is None:
        return argv
    return [f"{RUNTIME}/{LOADER}", "--library-path", f"{RUNTIME}/lib", *argv]


def self_argv() -> tuple[str, list[str]]:
    """(program, argv) that start this agent again: through the loader in runtime mode
    (the interpreter's own ELF interpreter path may not exist in the image)."""
    if RUNTIME is None:
        return sys.executable, list(sys.orig_argv)
    argv = wrap(list(sys.orig_argv))
    return argv[0], argv


def python_command() -> str:
    """The interpreter for code-interpreter kernels: the image's own ``python3`` in
    runtime mode (the user's packages are there, not in hutch's runtime)."""
    return "python3" if RUNTIME is not None else (sys.executable or "python3")


def _root_device_bytes() -> int | None:
    st = os.stat("/")
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    try:
        with open(f"/sys/dev/block/{major}:{minor}/size") as f:
            return int(f.read().strip()) * 512
    except (OSError, ValueError):
        return None


def grow_root() -> None:
    """Grow the root ext4 filesystem to the size of its disk, online."""
    with contextlib.suppress(OSError):  # this thread only: the agent comes first
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    size = _root_device_bytes()
    vfs = os.statvfs("/")
    if size is None or vfs.f_frsize <= 0:
        return
    blocks = size // vfs.f_frsize
    if blocks <= vfs.f_blocks:
        return
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, EXT4_IOC_RESIZE_FS, struct.pack("Q", blocks))
        log.info("grew / from %d to %d blocks", vfs.f_blocks, blocks)
    except OSError as exc:
        log.warning("could not grow the root filesystem: %s", exc)
    finally:
        os.close(fd)


def start_boot_tasks() -> None:
    """In runtime mode: grow / in the background, then mark the boot done."""
    if RUNTIME is None:
        return

    def run() -> None:
        try:
            grow_root()
            os.sync()
        finally:
            try:
                os.makedirs(os.path.dirname(BOOT_DONE), exist_ok=True)
                with open(BOOT_DONE, "w") as f:
                    f.write("ok\n")
            except OSError as exc:
                log.warning("could not write %s: %s", BOOT_DONE, exc)

    threading.Thread(target=run, name="boot-tasks", daemon=True).start()
