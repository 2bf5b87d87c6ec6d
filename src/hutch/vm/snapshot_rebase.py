"""A full-stream snapshot turned into a copy-on-write one: its RAM written once into a
``memory.ram`` of its own, its stream cut to device state.

Why
===
A clone's RAM is a *private* mapping of its template's ``memory.ram``, and QEMU 7.2
sends every page of a private block, so a fork or named snapshot of a clone carries
all of its RAM in ``state.mig``; every child then loads that whole stream (and writes
every page that differs from the template's file into its own anonymous memory). Here
the stream is loaded once, by a *helper* QEMU whose RAM is ``share=on`` on a new file:
the pages land in that file. The helper, never run (no ``cont``), then saves again with
``x-ignore-shared`` (state only, tens of KB). Children map the file ``share=off``
(``MAP_PRIVATE``, as template clones do) and load the small stream.

The helper: the snapshot's VM configuration with names and sockets of its own (a fresh
sandbox id no row owns, so a daemon killed meanwhile has it removed with every other
leftover at the next start), a throwaway qcow2 overlay on the frozen disk, the frozen
VM's own tap (see :func:`rebase_memory`), its own cgroup. ``late-block-activate`` stays
off, so QEMU activates the block devices once the incoming stream is loaded and the
outgoing save can inactivate them again (QEMU 7.2 aborts a save of a VM whose devices
are still inactive).

Crash safety: the commit
========================
Until the last step the snapshot is the full stream and stays valid:

1. the helper writes ``memory.ram.new`` and ``state.mig.new``; QEMU ends;
2. ``memory.ram.new`` -> ``memory.ram`` (a clone of a full-stream snapshot maps
   ``memory.ram`` privately and the stream rewrites every page that differs, so an extra
   file there changes nothing);
3. the new manifest is written as ``manifest.rebase.json`` (crash point
   ``rebase.staged``);
4. ``state.mig.new`` -> ``state.mig`` (``rebase.swapped``);
5. ``manifest.rebase.json`` -> ``manifest.json``; then sealed (:func:`seal_memory`).

Cut between 4 and 5, ``manifest.json`` describes the old stream: :func:`settle_rebase`
(called by ``load_manifest``) finishes the rename when ``state.mig`` has the staged size
(a state-only stream is tens of KB, a full one tens of MB), else drops the staged
manifest. Every restore still checks the stream's digest, so a wrong guess fails closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path

from hutch.crashpoints import crash_point
from hutch.errors import SnapshotError, VmError
from hutch.vm.argv import VmConfig
from hutch.vm.cgroup_driver import SandboxCgroup
from hutch.vm.migration import (
    elapsed_ms,
    query_qemu_version,
    set_ignore_shared,
    wait_migration,
)
from hutch.vm.process import QemuVm
from hutch.vm.snapshot_manifest import (
    MANIFEST_FILE,
    MEMORY_FILE,
    READ_ONLY,
    STATE_DIGEST,
    STATE_FILE,
    FileStamp,
    SnapshotManifest,
    fd_digest,
    write_atomic,
)

__all__ = ["NEW_MEMORY", "NEW_STATE", "REBASE_MANIFEST", "rebase_memory", "settle_rebase"]

log = logging.getLogger(__name__)

REBASE_MANIFEST = "manifest.rebase.json"
NEW_MEMORY = "memory.ram.new"
NEW_STATE = "state.mig.new"
_FD_NAME = "hutch-rebase"


def settle_rebase(snapshot_dir: Path) -> None:
    """Finish or drop a rebase cut between its stream swap and its manifest (see the
    module note). Idempotent; a no-op without ``manifest.rebase.json``."""
    staged_path = snapshot_dir / REBASE_MANIFEST
    try:
        staged = SnapshotManifest.from_json(staged_path.read_text(), staged_path)
    except FileNotFoundError:
        return
    except (OSError, SnapshotError):
        with contextlib.suppress(FileNotFoundError):
            staged_path.unlink()
        return
    try:
        size = (snapshot_dir / STATE_FILE).stat().st_size
    except FileNotFoundError:
        size = -1
    with contextlib.suppress(FileNotFoundError):
        if size == staged.state_size:
            os.replace(staged_path, snapshot_dir / MANIFEST_FILE)
        else:
            staged_path.unlink()


async def rebase_memory(
    snapshot_dir: Path,
    manifest: SnapshotManifest,
    helper_cfg: VmConfig,
    *,
    qemu_version: str,
    cgroup: SandboxCgroup | None = None,
    timeout_s: float = 120.0,
) -> SnapshotManifest:
    """Rewrite the full-stream snapshot ``snapshot_dir`` (its ``manifest``) as RAM in
    ``memory.ram`` plus a state-only stream, through a helper QEMU of ``helper_cfg``
    (the snapshot's VM with the helper's own names, sockets and overlay disk, and the
    snapshot's VM's tap, which must be free: QEMU opens it; its ``memory_file`` is
    replaced here). Returns the new manifest, not yet sealed.

    Raises SnapshotError (VmError wrapped) when the helper fails; the snapshot is then
    the full stream it was, and what the helper wrote is removed. The helper QEMU is
    always ended here.
    """
    if manifest.ram_in_file:
        return manifest
    for leftover in (NEW_MEMORY, NEW_STATE, REBASE_MANIFEST):
        with contextlib.suppress(FileNotFoundError):
            (snapshot_dir / leftover).unlink()
    new_memory = snapshot_dir / NEW_MEMORY
    new_state = snapshot_dir / NEW_STATE
    # The NIC keeps its tap (``helper_cfg.tap``: the frozen VM's own, free while that
    # VM is stopped): a stream saved over a tap records vnet_hdr, and QEMU refuses to
    # load it into a NIC on a hub port ("saved image requires vnet_hdr=on"), which is
    # what made every rebase of a networked sandbox fail. The helper never runs, so
    # nothing crosses the tap.
    cfg = dataclasses.replace(helper_cfg, memory_file=new_memory, memory_shared=True, incoming=True)
    timings: dict[str, float] = {}
    t_all = time.perf_counter()
    src = os.open(snapshot_dir / STATE_FILE, os.O_RDONLY | os.O_CLOEXEC)
    out = -1
    vm: QemuVm | None = None
    try:
        # The stream is input to QEMU's parser: the very fd it reads is checked first.
        digest, size = await asyncio.to_thread(fd_digest, src, STATE_DIGEST)
        if (digest, size) != (manifest.state_digest, manifest.state_size):
            raise SnapshotError(f"snapshot {snapshot_dir}: {STATE_FILE} is not what was saved")
        os.lseek(src, 0, os.SEEK_SET)
        t = time.perf_counter()
        vm = await QemuVm.launch(cfg, cgroup=cgroup)
        timings["launch"] = elapsed_ms(t)
        version = await query_qemu_version(vm)
        if version != qemu_version:
            raise SnapshotError(f"the helper QEMU is {version!r}, the stream {qemu_version!r}")
        t = time.perf_counter()
        await set_ignore_shared(vm, ignore_shared=False)
        await vm.send_fd(_FD_NAME, src)
        await vm.qmp("migrate-incoming", uri=f"fd:{_FD_NAME}")
        await wait_migration(
            vm,
            f"rebasing {snapshot_dir} on a memory file: loading the stream into the helper",
            timeout_s,
        )
        timings["load"] = elapsed_ms(t)
        t = time.perf_counter()
        out = os.open(new_state, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        await set_ignore_shared(vm, ignore_shared=True)
        await vm.send_fd(_FD_NAME, out)
        await vm.qmp("migrate", uri=f"fd:{_FD_NAME}")
        await wait_migration(
            vm, f"rebasing {snapshot_dir} on a memory file: saving the helper's state", timeout_s
        )
        timings["save"] = elapsed_ms(t)
        await vm.kill()
        vm = None
        os.lseek(out, 0, os.SEEK_SET)
        state_digest, state_size = await asyncio.to_thread(fd_digest, out, STATE_DIGEST)
    except BaseException as exc:
        if vm is not None:
            await vm.kill(grace_s=0)
        for made in (new_memory, new_state):
            with contextlib.suppress(FileNotFoundError):
                made.unlink()
        if isinstance(exc, VmError):
            raise SnapshotError(f"rebasing {snapshot_dir} on a memory file failed: {exc}") from exc
        raise
    finally:
        os.close(src)
        if out >= 0:
            os.close(out)
    os.chmod(new_state, READ_ONLY)
    os.chmod(new_memory, READ_ONLY)  # never written again: clones map it privately
    memory = snapshot_dir / MEMORY_FILE
    os.replace(new_memory, memory)
    timings["total"] = elapsed_ms(t_all)
    rebased = dataclasses.replace(
        manifest,
        ram_in_file=True,
        state_size=state_size,
        state_digest=state_digest,
        memory=FileStamp.of(memory),
        timings_ms={**manifest.timings_ms, **{f"rebase_{k}": v for k, v in timings.items()}},
    )
    write_atomic(snapshot_dir / REBASE_MANIFEST, rebased.to_json(), fsync=False)
    crash_point("rebase.staged")
    os.replace(new_state, snapshot_dir / STATE_FILE)
    crash_point("rebase.swapped")
    manifest_path = snapshot_dir / MANIFEST_FILE
    with contextlib.suppress(OSError):
        os.chmod(manifest_path, 0o600)
    os.replace(snapshot_dir / REBASE_MANIFEST, manifest_path)
    log.info(
        "snapshot %s: RAM moved into %s (%d bytes of state left) in %.1f ms",
        snapshot_dir,
        MEMORY_FILE,
        state_size,
        timings["total"],
    )
    return rebased
