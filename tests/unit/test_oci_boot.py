"""The boot path of imported images, the parts that need no VM: the facts the OCI
initramfs, the agent runtime, the VM layer and the agent must agree on; the initramfs
of hutch's own images left byte-for-byte as it was; ELF DT_NEEDED parsing; the agent's
``User`` resolution (uid[:gid], name[:group], images without /etc/passwd)."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hutch.errors import ImageBuildError
from hutch.images import agent_runtime
from hutch.images.elf import needed_libraries
from hutch.images.initramfs import (
    BUSYBOX_APPLETS,
    OCI_APPLETS,
    init_script,
    initramfs_entries,
)
from hutch.images.oci.boot import INIT_SCRIPT
from hutch.runtime.qemu import templates as qemu_templates
from hutch.vm.argv import VmConfig, build_argv

REPO = Path(__file__).resolve().parents[2]
AGENT_DIR = REPO / "guest_agent"


def test_the_oci_init_and_the_runtime_agree() -> None:
    script = init_script(INIT_SCRIPT).decode()
    assert re.search(r"^RT=(\S+)$", script, re.M).group(1) == agent_runtime.MOUNT  # type: ignore[union-attr]
    assert re.search(r"^SERIAL=(\S+)$", script, re.M).group(1) == agent_runtime.SERIAL  # type: ignore[union-attr]
    # The file the host waits for is the one the agent writes.
    agent = (Path(__file__).parents[2] / "guest_agent/hutch_agent/runtime.py").read_text()
    assert re.search(r'^BOOT_DONE = "(\S+)"$', agent, re.M).group(1) == agent_runtime.BOOT_DONE  # type: ignore[union-attr]
    # PID 1's argv comes from the runtime disk, one argument per line: no argument may
    # hold a newline, and the first is the init switch_root runs.
    argv = agent_runtime.agent_argv()
    assert all("\n" not in a for a in argv)
    assert argv[0] == f"{agent_runtime.MOUNT}/bin/tini"
    assert argv[-2:] == ["--runtime", agent_runtime.MOUNT]
    called = commands(script)
    assert {"mount", "insmod", "switch_root", "printf", "ip"} <= called
    missing = called - set(OCI_APPLETS)
    assert not missing, f"the OCI init calls {sorted(missing)}, not in its initramfs"


SHELL_WORDS = {
    "fail", "export", "while", "for", "do", "done", "if", "then", "fi", "else", "elif", "case",
    "esac", "set", "exec", "read", "echo", "break", "continue", "exit", "in", "[", ":",
}  # fmt: skip


def commands(script: str) -> set[str]:
    """The words in command position of a shell script (functions, keywords and
    builtins left out): what must exist as a program."""
    out: set[str] = set()
    for raw in script.splitlines():
        line = raw.split("#", 1)[0] if not raw.lstrip().startswith("#!") else ""
        for piece in re.split(r";|&&|\|\||\||\$\(|\bthen\b|\bdo\b|\belse\b", line):
            words = [w for w in piece.split() if "=" not in w or w.startswith("-")]
            while words and words[0] in ("exec", "!"):
                words = words[1:]
            if words and re.fullmatch(r"[a-z_][a-z0-9_]*", words[0]):
                out.add(words[0])
    return out - SHELL_WORDS - {w for w in out if w.endswith(")")}


def test_the_agent_marks_boot_done_where_the_backend_looks() -> None:
    sys.path.insert(0, str(AGENT_DIR))
    try:
        from hutch_agent import runtime
    finally:
        sys.path.remove(str(AGENT_DIR))
    assert runtime.BOOT_DONE == qemu_templates.RUNTIME_BOOT_DONE
    assert f"lib/{agent_runtime.LOADER}" == runtime.LOADER
    assert runtime.BOOT_DONE.startswith(agent_runtime.MOUNT.rsplit("/", 1)[0] + "/")


def test_builtin_initramfs_is_unchanged() -> None:
    """Imported images get their own /init and applets; hutch's own images' initramfs
    (part of their digest) stays what it was."""
    default = initramfs_entries(b"BB", [("m.ko", b"k")])
    names = [e.name for e in default]
    assert f"bin/{BUSYBOX_APPLETS[0]}" in names
    assert not {f"bin/{a}" for a in set(OCI_APPLETS) - set(BUSYBOX_APPLETS)} & set(names)
    init = next(e for e in default if e.name == "init")
    assert init.data == init_script() == init_script("initramfs-init")
    oci = initramfs_entries(b"BB", [("m.ko", b"k")], init_script(INIT_SCRIPT), OCI_APPLETS)
    assert next(e for e in oci if e.name == "init").data == init_script(INIT_SCRIPT)


def test_runtime_disk_argv() -> None:
    common = dict(
        name="t", vcpus=1, memory_mib=256, kernel=Path("/k"), initrd=Path("/i"), cmdline="",
        disk=Path("/d.qcow2"), accel="tcg", qmp_socket=Path("/r/q"), agent_socket=Path("/r/a"),
        console_log=Path("/c"), pidfile=Path("/p"), qemu_log=Path("/l"),
    )  # fmt: skip
    plain = build_argv(VmConfig(**common))  # type: ignore[arg-type]
    assert not any("hutch-agent-rt" in a for a in plain)
    with_rt = build_argv(VmConfig(**common, runtime_disk=Path("/rt.ext4")))  # type: ignore[arg-type]
    drive = with_rt[with_rt.index("virtio-blk-device,drive=root") + 2]
    assert drive.startswith("id=rt,if=none,file=/rt.ext4,format=raw,readonly=on")
    assert with_rt[with_rt.index(drive) + 2] == "virtio-blk-device,drive=rt,serial=hutch-agent-rt"
    # The root disk comes first: the guest sees it as vda.
    assert with_rt.index("virtio-blk-device,drive=root") < with_rt.index(drive)


def test_needed_libraries() -> None:
    ls = Path(shutil.which("ls") or "/bin/ls").read_bytes()
    assert "libc.so.6" in needed_libraries(ls)
    busybox = Path(shutil.which("busybox") or "/bin/busybox").read_bytes()
    assert needed_libraries(busybox) == []  # busybox-static
    with pytest.raises(ImageBuildError):
        needed_libraries(b"not an elf")


@pytest.fixture(scope="module")
def spawn() -> ModuleType:
    sys.path.insert(0, str(AGENT_DIR))
    try:
        from hutch_agent import spawn as module
    finally:
        sys.path.remove(str(AGENT_DIR))
    return module


def test_user_forms(spawn: ModuleType) -> None:
    root = spawn.resolve_user(None)
    assert (root.pw_name, root.pw_uid, root.pw_gid) == ("root", 0, 0)
    assert spawn.resolve_user("0:0").pw_uid == 0
    assert spawn.resolve_user("root").pw_dir == "/root"
    # A uid the image's passwd lacks works, as in a container runtime: home is "/".
    ghost = spawn.resolve_user("54321")
    assert (ghost.pw_uid, ghost.pw_gid, ghost.pw_dir) == (54321, 54321, "/")
    both = spawn.resolve_user("54321:4242")
    assert (both.pw_uid, both.pw_gid) == (54321, 4242)
    assert spawn.resolve_user("root:0").pw_gid == 0
    assert spawn.resolve_user(7).pw_uid == 7
    for bad in ("no-such-user", "root:no-such-group", "", "9" * 30, "a\0b"):
        with pytest.raises(spawn.AgentError):
            spawn.resolve_user(bad)
