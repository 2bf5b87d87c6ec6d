"""The guest agent's own runtime, for images that are not hutch's: a read-only ext4 disk
with a Python interpreter, the standard library, every shared library they load, their
dynamic loader, ``tini`` and the agent itself, all taken from the Debian package
tree hutch already builds for the ``base`` image (mmdebstrap, cached).

In the guest the initramfs mounts it at :data:`MOUNT` (on the ``/run`` tmpfs: nothing is
added to the image's own filesystem, and it is on no one's ``PATH``) and starts the agent
through the runtime's loader, so the image's libc (musl, glibc or none) never matters::

    /run/.hutch/rt/bin/tini -s -- /run/.hutch/rt/lib/ld-linux-x86-64.so.2
        --library-path /run/.hutch/rt/lib /run/.hutch/rt/usr/bin/python3 -I -S
        /run/.hutch/rt/agent/agent.py --runtime /run/.hutch/rt

Layout of the disk (``runtime.ext4``)::

    lib/ld-linux-x86-64.so.2, lib/<soname>...   the loader and the library closure
    usr/bin/python3                           the interpreter (prefix found from here)
    usr/lib/python3.<n>/                      the standard library (tests, tkinter,
                                              idle, ensurepip, ... left out), compiled
    bin/tini                                  tini-static, PID 1
    agent/agent.py, agent/hutch_agent/        the agent, compiled by this very Python

The agent's modules are compiled at build time by the runtime's own interpreter run on
the host through the runtime's loader: that checks the runtime works before it is used.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from hutch.errors import ImageBuildError
from hutch.images import _proc
from hutch.images.cache import atomic_write_text, file_lock, file_sha256, short_digest
from hutch.images.elf import needed_libraries
from hutch.images.rootfs import PackageTree, make_ext4
from hutch.vm.argv import RUNTIME_DISK_SERIAL

__all__ = [
    "BOOT_DONE",
    "MOUNT",
    "RuntimeDisk",
    "agent_argv",
    "prepare_runtime",
    "runtime_key",
    "runtime_python_argv",
]

# v2: no ``ip`` any more (the agent configures its NIC over rtnetlink, hutch_agent.rtnl).
_FORMAT = "agent-runtime-v2"
MOUNT = "/run/.hutch/rt"
#: Written by the agent on an imported image once its boot-time work (growing /) is done
#: (guest_agent/hutch_agent/runtime.py BOOT_DONE); what the host waits for.
BOOT_DONE = "/run/.hutch/boot-done"
LOADER = "ld-linux-x86-64.so.2"
RUNTIME_LABEL = "hutch-agent-rt"
#: The virtio-blk serial the initramfs finds the runtime disk by (the VM layer sets it).
SERIAL = RUNTIME_DISK_SERIAL

#: Standard library parts the agent never imports.
_STDLIB_SKIP = frozenset(
    {
        "test",
        "idlelib",
        "tkinter",
        "turtledemo",
        "ensurepip",
        "lib2to3",
        "pydoc_data",
        "unittest",
        "distutils",
        "venv",
        "sqlite3",
        "curses",
        "dbm",
        "turtle.py",
        "config-3.11-x86_64-linux-gnu",
    }
)
#: Extension modules the agent never loads; leaving them out drops their libraries
#: (OpenSSL, Kerberos, ncurses, sqlite: ~12 MB). hashlib falls back to its builtins.
_DYNLOAD_SKIP_PREFIXES = (
    "_test", "xxlimited", "_ctypes_test", "_xxtestfuzz", "_tkinter", "_sqlite3", "_dbm",
    "_gdbm", "_curses", "readline", "nis", "_ssl", "_hashlib", "_crypt", "ossaudiodev",
)  # fmt: skip
_LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu", "usr/lib", "lib")


@dataclass(frozen=True)
class RuntimeDisk:
    key: str
    path: Path  # runtime.ext4
    python: str  # e.g. "3.11"


def agent_argv(mount: str = MOUNT) -> list[str]:
    """PID 1 of an imported image, as the initramfs starts it."""
    return [
        f"{mount}/bin/tini",
        "-s",
        "--",
        f"{mount}/lib/{LOADER}",
        "--library-path",
        f"{mount}/lib",
        f"{mount}/usr/bin/python3",
        "-I",
        "-S",
        f"{mount}/agent/agent.py",
        "--runtime",
        mount,
    ]


def runtime_python_argv(*args: str, mount: str = MOUNT) -> list[str]:
    """A command that runs the runtime's Python in a guest (through the runtime's own
    loader: the image's libc does not matter), for hutch's own chores there."""
    return [
        f"{mount}/lib/{LOADER}",
        "--library-path",
        f"{mount}/lib",
        f"{mount}/usr/bin/python3",
        "-I",
        "-S",
        *args,
    ]


def _python_version(tree: Path) -> str:
    for candidate in sorted((tree / "usr/lib").glob("python3.*"), reverse=True):
        if (candidate / "os.py").is_file():
            return candidate.name.removeprefix("python")
    raise ImageBuildError(f"the package tree {tree} has no Python standard library")


def runtime_key(tree: PackageTree, agent_sha: str) -> str:
    return short_digest(_FORMAT, tree.digest, agent_sha, *sorted(_STDLIB_SKIP))


def _find_lib(tree: Path, soname: str) -> Path:
    for d in _LIB_DIRS:
        candidate = tree / d / soname
        if os.path.lexists(candidate):
            real = Path(os.path.realpath(candidate))
            if real.is_file() and real.is_relative_to(tree.resolve()):
                return real
    raise ImageBuildError(f"the package tree has no {soname} (needed by the agent runtime)")


class _Closure:
    """The libraries a set of ELF files needs, transitively, found in ``tree``."""

    def __init__(self, tree: Path) -> None:
        self.tree = tree
        self.libs: dict[str, Path] = {}

    def needs(self, elf: Path) -> list[str]:
        return [n for n in needed_libraries(elf.read_bytes()) if n != LOADER]

    def add(self, elf: Path) -> None:
        queue = self.needs(elf)
        while queue:
            name = queue.pop()
            if name in self.libs:
                continue
            self.libs[name] = _find_lib(self.tree, name)
            queue.extend(self.needs(self.libs[name]))

    def resolvable(self, elf: Path) -> bool:
        try:
            probe = _Closure(self.tree)
            probe.libs = dict(self.libs)
            probe.add(elf)
        except ImageBuildError:
            return False
        return True


def _copy_file(src: Path, dst: Path, mode: int) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    dst.chmod(mode)


def _populate(tree: Path, agent_dir: Path, agent_files: list[Path], out: Path) -> str:
    version = _python_version(tree)
    closure = _Closure(tree)
    python = tree / "usr/bin" / f"python{version}"
    tini = tree / "usr/bin/tini-static"
    for need, what in ((python, "python3"), (tini, "tini (tini-static)")):
        if not need.is_file():
            raise ImageBuildError(f"the package tree {tree} lacks {what} for the agent runtime")
    closure.add(python)
    _copy_file(python, out / "usr/bin/python3", 0o755)
    _copy_file(tini, out / "bin/tini", 0o755)
    stdlib = tree / "usr/lib" / f"python{version}"
    dest = out / "usr/lib" / f"python{version}"
    for dirpath, dirnames, filenames in os.walk(stdlib):
        rel = Path(dirpath).relative_to(stdlib)
        dirnames[:] = sorted(
            d
            for d in dirnames
            if not (rel == Path(".") and d in _STDLIB_SKIP)
            and d not in ("site-packages", "dist-packages")
        )
        for name in sorted(filenames):
            if rel == Path(".") and name in _STDLIB_SKIP:
                continue
            src = Path(dirpath) / name
            if src.is_symlink() or not src.is_file():
                continue
            if rel.parts[:1] == ("lib-dynload",):
                if name.startswith(_DYNLOAD_SKIP_PREFIXES) or not closure.resolvable(src):
                    continue
                closure.add(src)
            _copy_file(src, dest / rel / name, 0o644 if not name.endswith(".so") else 0o755)
    _copy_file(_find_lib(tree, LOADER), out / "lib" / LOADER, 0o755)
    for soname, path in sorted(closure.libs.items()):
        _copy_file(path, out / "lib" / soname, 0o755)
    for rel in agent_files:
        _copy_file(agent_dir / rel, out / "agent" / rel, 0o644)
    # The initramfs reads PID 1's argv from here, one argument per line.
    (out / "argv").write_text("".join(f"{arg}\n" for arg in agent_argv()))
    return version


def _compile_agent(out: Path) -> None:
    """Byte-compile the agent with the runtime's own Python, run through its loader
    (the disk is read-only in the guest, so nothing could cache the bytecode there),
    then import it once: a runtime that cannot run the agent fails here, not at boot."""
    run = [
        str(out / "lib" / LOADER),
        "--library-path",
        str(out / "lib"),
        str(out / "usr/bin/python3"),
        "-I",
        "-S",
    ]
    _proc.run(
        [
            *run,
            "-m",
            "compileall",
            "-q",
            "--invalidation-mode",
            "unchecked-hash",
            str(out / "agent"),
        ],
        what="compiling the agent with the runtime's Python",
    )
    _proc.run(
        [*run, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import hutch_agent.core",
         str(out / "agent")],
        what="importing the agent with the runtime's Python",
    )  # fmt: skip


def prepare_runtime(
    images_dir: Path, tree: PackageTree, agent_dir: Path, agent_files: list[Path], agent_sha: str
) -> RuntimeDisk:
    """The runtime disk for (tree, agent): cached in ``<images_dir>/runtime/<key>/``
    (``runtime.json`` written last), built when missing. Raises ``ImageBuildError``."""
    key = runtime_key(tree, agent_sha)
    final = images_dir / "runtime" / key
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / f"{key}.lock"):
        meta = final / "runtime.json"
        if meta.is_file():
            info = json.loads(meta.read_text())
            return RuntimeDisk(key, final / "runtime.ext4", str(info["python"]))
        work = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=final.parent))
        try:
            staging = work / "root"
            staging.mkdir()
            staging.chmod(0o755)
            version = _populate(tree.root, agent_dir, agent_files, staging)
            _compile_agent(staging)
            used = sum(f.stat().st_blocks * 512 for f in staging.rglob("*") if f.is_file())
            size = -(-(used * 5 // 4 + (16 << 20)) // (4 << 20)) * (4 << 20)
            disk = work / "runtime.ext4"
            make_ext4(staging, disk, size, RUNTIME_LABEL, uuid.UUID(hex=(key * 2)[:32]))
            shutil.rmtree(staging)
            disk.chmod(0o444)
            atomic_write_text(
                work / "runtime.json",
                json.dumps(
                    {
                        "key": key,
                        "python": version,
                        "tree_digest": tree.digest,
                        "agent_sha256": agent_sha,
                        "disk_sha256": file_sha256(disk),
                    },
                    indent=2,
                )
                + "\n",
            )
            work.chmod(0o755)
            if final.exists():
                shutil.rmtree(final)
            os.rename(work, final)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return RuntimeDisk(key, final / "runtime.ext4", version)
