"""What copy-on-write template memory relies on in this host's QEMU, checked without
running a guest (QEMU started with ``-S``; guest RAM read back with ``pmemsave``):

* a clone mapping the template's memory file ``share=off`` and loading a stream saved
  with ``x-ignore-shared`` sees the file's content (its private block gets no pages);
* a full stream loaded into such a private mapping of a file with *other* content gives
  the stream's content, zero pages included (a clone of a clone maps the template's
  file again: ARCHITECTURE.md, "Copy-on-write memory");
* none of it writes the template's file;
* a full stream loaded by a helper whose RAM is ``share=on`` on a new file, then saved
  with ``x-ignore-shared``, leaves the content in that file and a small stream (the
  rebase of a clone's fork snapshot, ``hutch.vm.snapshot_rebase``).

Guest-visible behaviour with a booted guest is checked by tests/vm/test_snapshot.py and
tests/vm/test_templates.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vm, pytest.mark.timeout(120)]

MIB = 32
#: pmemsave reads guest-physical addresses, where the ISA BIOS ROM shadows this window.
ROM_WINDOW = (0xE0000, 0x100000)

Qmp = Callable[..., Any]


def _outside_rom(data: bytes) -> bytes:
    return data[: ROM_WINDOW[0]] + data[ROM_WINDOW[1] :]


sockets: list[socket.socket] = []
files: list[Any] = []


@pytest.fixture
def qemus() -> Iterator[list[subprocess.Popen[bytes]]]:
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 is not installed")
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for f in files:
        f.close()
    for s in sockets:
        s.close()
    files.clear()
    sockets.clear()
    for p in procs:
        p.kill()
        p.wait()


def _qemu(
    procs: list[subprocess.Popen[bytes]], d: Path, name: str, mem: Path, share: str, **kw: bool
) -> Qmp:
    sock = d / f"{name}.qmp"
    argv = [
        "qemu-system-x86_64",
        "-M",
        "microvm,x-option-roms=off,isa-serial=off,rtc=off,memory-backend=mem",
        "-accel",
        "tcg",
        "-m",
        f"{MIB}M",
        "-object",
        f"memory-backend-file,id=mem,size={MIB}M,mem-path={mem},share={share}",
        "-S",
        "-display",
        "none",
        "-nodefaults",
        "-qmp",
        f"unix:{sock},server=on,wait=off",
        *(["-incoming", "defer"] if kw.get("incoming") else []),
    ]
    procs.append(subprocess.Popen(argv, stderr=subprocess.DEVNULL))
    deadline = time.monotonic() + 20
    s = socket.socket(socket.AF_UNIX)
    sockets.append(s)
    while True:
        try:
            s.connect(str(sock))
            break
        except (FileNotFoundError, ConnectionRefusedError):
            assert time.monotonic() < deadline, f"QEMU {name} did not start"
            time.sleep(0.02)
    f = s.makefile("rw")
    files.append(f)
    json.loads(f.readline())

    def qmp(command: str, **args: Any) -> Any:
        f.write(json.dumps({"execute": command, "arguments": args}) + "\n")
        f.flush()
        while True:
            reply = json.loads(f.readline())
            if "error" in reply:
                raise AssertionError(f"{name} {command}: {reply['error']}")
            if "return" in reply:
                return reply["return"]

    qmp("qmp_capabilities")
    return qmp


def _migrated(qmp: Qmp) -> None:
    deadline = time.monotonic() + 30
    while (status := qmp("query-migrate").get("status")) != "completed":
        assert status not in ("failed", "cancelled"), qmp("query-migrate")
        assert time.monotonic() < deadline, status
        time.sleep(0.01)


def _ignore_shared(qmp: Qmp, on: bool) -> None:
    qmp(
        "migrate-set-capabilities",
        capabilities=[{"capability": "x-ignore-shared", "state": on}],
    )


def _ram(qmp: Qmp, dump: Path) -> bytes:
    qmp("pmemsave", val=0, size=MIB << 20, filename=str(dump))
    return _outside_rom(dump.read_bytes())


def test_private_clone_of_a_shared_template_and_full_streams_over_it(
    tmp_path: Path, qemus: list[subprocess.Popen[bytes]]
) -> None:
    size = MIB << 20
    content = bytearray(os.urandom(size))
    content[2 << 20 : 6 << 20] = bytes(4 << 20)  # zero pages the stream sends as a flag
    tpl, other = tmp_path / "tpl.ram", tmp_path / "other.ram"
    tpl.write_bytes(content)
    other.write_bytes(os.urandom(size))
    state, full = tmp_path / "state.mig", tmp_path / "full.mig"

    src = _qemu(qemus, tmp_path, "src", tpl, "on")
    _ignore_shared(src, True)
    src("migrate", uri=f"exec:cat > {state}")
    _migrated(src)
    assert state.stat().st_size < 1 << 20, "x-ignore-shared must leave RAM out of the stream"
    frozen = tpl.read_bytes()
    os.chmod(tpl, 0o444)

    clone = _qemu(qemus, tmp_path, "clone", tpl, "off", incoming=True)
    _ignore_shared(clone, True)
    clone("migrate-incoming", uri=f"exec:cat {state}")
    _migrated(clone)
    assert _ram(clone, tmp_path / "clone.dump") == _outside_rom(frozen)

    # A clone of the clone: its private RAM goes whole into the stream, and a QEMU that
    # maps a file with other content privately ends with the stream's content.
    _ignore_shared(clone, False)
    clone("migrate", uri=f"exec:cat > {full}")
    _migrated(clone)
    assert full.stat().st_size > size // 2
    grandchild = _qemu(qemus, tmp_path, "grandchild", other, "off", incoming=True)
    grandchild("migrate-incoming", uri=f"exec:cat {full}")
    _migrated(grandchild)
    assert _ram(grandchild, tmp_path / "gc.dump") == _outside_rom(frozen)
    assert tpl.read_bytes() == frozen, "the template's file was written"

    # The rebase of a clone's snapshot (hutch.vm.snapshot_rebase): a helper, never run,
    # loads the full stream into RAM shared on a new file, then saves device state only;
    # a clone mapping that file privately has the content back.
    rebased, small = tmp_path / "rebased.ram", tmp_path / "small.mig"
    helper = _qemu(qemus, tmp_path, "helper", rebased, "on", incoming=True)
    helper("migrate-incoming", uri=f"exec:cat {full}")
    _migrated(helper)
    _ignore_shared(helper, True)
    helper("migrate", uri=f"exec:cat > {small}")
    _migrated(helper)
    assert small.stat().st_size < 1 << 20, "the rebased stream still carries RAM"
    assert _outside_rom(rebased.read_bytes()) == _outside_rom(frozen)
    child = _qemu(qemus, tmp_path, "child", rebased, "off", incoming=True)
    _ignore_shared(child, True)
    child("migrate-incoming", uri=f"exec:cat {small}")
    _migrated(child)
    assert _ram(child, tmp_path / "child.dump") == _outside_rom(frozen)
