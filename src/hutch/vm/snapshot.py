"""Memory snapshots of a running QEMU: pause to files, resume, fork.

Design note
===========
A snapshot directory holds::

    state.mig       QEMU migration stream (device + CPU state; and all RAM unless
                    ram_in_file). Written by QEMU through an fd hutch opened (``getfd``
                    + ``migrate fd:``; ``exec:`` dies under ``-sandbox spawn=deny``).
    memory.ram      (ram_in_file only) the guest RAM: the VM ran with
                    ``memory-backend-file,share=on`` on this very file, so nothing was
                    copied at pause time; QEMU skipped it (``x-ignore-shared``).
    manifest.json   written last: its presence means the snapshot is complete.
    consumed        marker: a non-clone restore took the snapshot over (the guest was
                    about to run from it).
    frozen          marker: clones may be running on it.

What is frozen when
-------------------
* ``save_snapshot`` ``stop``s the guest (QEMU flushes the disk), migrates, checks
  the result, then ends QEMU: a paused sandbox costs no CPU. From then on the VM's disk
  (the qcow2 named in the manifest) and ``memory.ram`` are the snapshot's: the guest's
  page cache in RAM matches exactly that disk, so neither may change while the snapshot
  may still be restored.
* ``restore(clone=False)`` (resume) *consumes* the snapshot: it writes ``consumed``, gives
  ``memory.ram`` back to the VM (renamed to ``cfg.memory_file``, mapped ``share=on``) and
  runs on the same disk. The guest then changes both, so the snapshot cannot be
  restored again; a frozen snapshot refuses this. ``consumed`` is written at the last
  moment before the guest runs (just before ``cont``): until then a QEMU that has only
  loaded the stream has written nothing (its disk stays inactive), so a restore cut
  short before that point - a daemon killed, a QEMU gone - leaves the snapshot whole
  and restorable. (A ram_in_file resume moves ``memory.ram`` before QEMU starts, so it
  is consumed from that moment.)
* ``restore(clone=True)`` (fork) *freezes* the snapshot: ``frozen`` is written and
  ``memory.ram``, ``state.mig`` and the disk are made read-only (mode 0444). Every clone
  maps ``memory.ram`` ``share=off`` (copy-on-write: a clone's writes stay in its own
  anonymous pages, the file never changes) and runs on its own qcow2 overlay whose
  backing file is the frozen disk (:func:`create_clone_disk`). ``memory.ram`` and the
  frozen disk must never change while any clone runs: MAP_PRIVATE pages a clone has not
  yet written still read through to the file. Resuming the original sandbox after a fork
  means restoring it as one more clone.

What is checked before a restore (``verify_snapshot``; any failure → SnapshotError)
-------------------------------------------------------------------------------------
* manifest present, parseable, known ``format``; not consumed; not frozen for a resume.
* the config matches what the stream was taken from (``CompatFields``): machine string,
  CPU model, accelerator, RAM size and backend kind, vCPUs, kernel sha256, TSC rate.
  The QEMU version (QMP ``query-version``, build string included) is compared in the new
  QEMU before it reads a byte of the stream.
* ``state.mig`` size and digest (XXH3-128) equal the recorded ones. The stream is
  untrusted input to QEMU's parser: restore checks the very fd it then passes to QEMU.
  A file that matched once in this process is not hashed again while its ``fstat``
  (inode, size, mtime, ctime) is unchanged (the clones of one frozen snapshot, whose
  files are read-only: any write, chmod or rename moves ctime).
* the disk: same size and mtime as recorded (not hashed: a multi-GiB disk per restore).
* ``memory.ram``: same size and mtime, and, once sealed
  (:func:`hutch.vm.snapshot_seal.seal_memory`, done when a template is published), its
  content digest: sealing hashes the file (XXH3-128, ~40 ms for 256 MiB) after making it
  read-only and records its ctime. A restore whose file still has that ctime has the
  digested bytes (any write, chmod or rename changes ctime, and user space cannot set it
  back), so the hot path is one ``stat``; a changed ctime (a copy from a blob store, a
  moved directory) costs one full re-hash, remembered per process, and a mismatch
  refuses the snapshot. Against corruption at rest, not a security boundary: RAM content
  is guest-controlled anyway and QEMU treats guest memory as hostile.
* clone: ``cfg.disk`` is a qcow2 whose backing file is the snapshot's disk.

Clones and identity: every clone resumes with the template's kernel RNG state, boot_id,
hostname, clock and MAC. The agent's hello (``AgentClient.connect``) sets the clock and
credits host entropy; see tests/vm/test_snapshot.py for what that does and does not
reseed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

from hutch.crashpoints import crash_point
from hutch.errors import SnapshotError, VmError
from hutch.vm.argv import VmConfig
from hutch.vm.cgroup_driver import SandboxCgroup
from hutch.vm.disk_chain import qcow2_backing_file, stop_disk_jobs
from hutch.vm.migration import (
    elapsed_ms,
    query_qemu_version,
    set_ignore_shared,
    wait_migration,
)
from hutch.vm.process import QemuVm
from hutch.vm.snapshot_dir import CONSUMED_MARKER, FROZEN_MARKER, freeze, load_manifest
from hutch.vm.snapshot_manifest import (
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    MEMORY_FILE,
    STATE_FILE,
    FileStamp,
    SnapshotManifest,
    TailHasher,
    compat_fields,
    compat_mismatches,
    describe_cmdline,
    fd_digest,
    file_sha256,
    write_atomic,
)
from hutch.vm.snapshot_pending import finish_interrupted_save, finish_save, write_pending
from hutch.vm.snapshot_seal import check_memory

__all__ = [
    "MANIFEST_FILE",
    "MEMORY_FILE",
    "STATE_FILE",
    "SnapshotManifest",
    "create_clone_disk",
    "finish_interrupted_save",
    "move_disk",
    "restore",
    "save_snapshot",
    "verify_snapshot",
]

log = logging.getLogger(__name__)

_FD_NAME = "hutch-snapshot"
# QEMU's default migration bandwidth cap (128 MiB/s) is meant for live migration over
# a network; a stopped VM writing to a local file should go as fast as the disk.
_MAX_BANDWIDTH = 1 << 40


async def save_snapshot(
    vm: QemuVm,
    dest_dir: Path,
    *,
    ram_in_file: bool,
    fsync: bool = False,
    timeout_s: float = 300.0,
) -> SnapshotManifest:
    """Pause ``vm`` into ``dest_dir`` (created; must not exist or be empty) and end QEMU.

    ``ram_in_file``: the VM runs with ``memory_file`` + ``memory_shared`` and its RAM
    stays in that file, which is moved to ``dest_dir/memory.ram`` (same file system
    required); the stream is device state only (tens of KB). Otherwise all RAM goes into
    ``state.mig``. ``fsync``: make the files durable before returning (else they reach
    the disk with normal writeback; a host crash before that loses the snapshot).

    On success QEMU has exited and the VM's disk belongs to the snapshot. On failure the
    partial files are removed and, if QEMU is still alive, the guest is resumed
    (``cont``) so the sandbox keeps running; raises ``SnapshotError`` (or ``StateError``
    when the VM is not running).
    """
    cfg = vm.cfg
    if ram_in_file and (cfg.memory_file is None or not cfg.memory_shared):
        raise SnapshotError(
            f"VM {cfg.name}: ram_in_file needs guest RAM in a shared memory file "
            "(VmConfig memory_file=..., memory_shared=True); save with ram_in_file=False"
        )
    _prepare_dest(dest_dir, cfg.memory_file if ram_in_file else None)
    timings: dict[str, float] = {}
    t_all = time.perf_counter()
    # Checked before the guest stops: a missing kernel must not cost a pause.
    compat = compat_fields(cfg)
    initrd_sha = file_sha256(cfg.initrd)
    qemu_version = await query_qemu_version(vm)
    state_path = dest_dir / STATE_FILE
    stopped_here = False
    fd = os.open(state_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        t = time.perf_counter()
        # A chain compaction still copying would write the disk after it is stamped.
        await stop_disk_jobs(vm)
        if await vm.query_status() == "running":
            await vm.qmp("stop")
            stopped_here = True
        timings["stop"] = elapsed_ms(t)
        crash_point("save.stopped")
        t = time.perf_counter()
        await set_ignore_shared(vm, ignore_shared=ram_in_file)
        await vm.qmp("migrate-set-parameters", **{"max-bandwidth": _MAX_BANDWIDTH})
        await vm.send_fd(_FD_NAME, fd)
        hasher = TailHasher(state_path)
        try:
            await vm.qmp("migrate", uri=f"fd:{_FD_NAME}")
            await wait_migration(vm, f"saving VM {cfg.name}", timeout_s)
        except BaseException:
            await asyncio.to_thread(hasher.abandon)
            raise
        timings["migrate"] = elapsed_ms(t)
        t = time.perf_counter()
        state_digest, state_size = await asyncio.to_thread(hasher.finish)
        timings["hash_rest"] = elapsed_ms(t)
        if fsync:
            t = time.perf_counter()
            await asyncio.to_thread(os.fsync, fd)
            timings["fsync_state"] = elapsed_ms(t)
    except BaseException:
        os.close(fd)
        shutil.rmtree(dest_dir, ignore_errors=True)
        if stopped_here and vm.is_alive():
            with contextlib.suppress(Exception):
                await vm.qmp("cont")
        raise
    os.close(fd)
    crash_point("save.migrated")
    memory_source = cfg.memory_file if ram_in_file else None
    pending = SnapshotManifest(
        format=MANIFEST_FORMAT,
        name=cfg.name,
        created_ns=time.time_ns(),
        qemu_version=qemu_version,
        compat=compat,
        cmdline=describe_cmdline(cfg),
        initrd_sha256=initrd_sha,
        state_size=state_size,
        state_digest=state_digest,
        ram_in_file=ram_in_file,
        memory=None,
        disk=FileStamp.of(cfg.disk.resolve()),
        timings_ms=timings,
    )
    write_pending(dest_dir, pending, memory_source)
    crash_point("save.pending")
    # The guest is stopped and its state saved: QEMU goes (quit flushes and closes the
    # disk, whose block layer the migration already inactivated).
    t = time.perf_counter()
    await vm.kill()
    timings["quit"] = elapsed_ms(t)
    crash_point("save.quit")
    # Recorded before the manifest is written (finishing takes a millisecond or two).
    timings["total"] = elapsed_ms(t_all)
    manifest = await asyncio.to_thread(finish_save, dest_dir, pending, memory_source, fsync=fsync)
    crash_point("save.manifest")
    log.info(
        "vm %s: snapshot %s (%d bytes of state, ram_in_file=%s) in %.1f ms",
        cfg.name,
        dest_dir,
        state_size,
        ram_in_file,
        timings["total"],
    )
    return manifest


def _prepare_dest(dest_dir: Path, memory_file: Path | None) -> None:
    dest_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    if any(dest_dir.iterdir()):
        raise SnapshotError(f"{dest_dir} is not empty; give a new snapshot directory")
    # Checked before the guest stops: the memory file is renamed into the snapshot
    # after QEMU has gone, when failing would lose the sandbox.
    if memory_file is not None and memory_file.stat().st_dev != dest_dir.stat().st_dev:
        raise SnapshotError(
            f"the memory file {memory_file} is on another file system than {dest_dir}; "
            "put the snapshot directory next to it (it is moved, not copied)"
        )


def move_disk(snapshot_dir: Path, new_path: Path) -> SnapshotManifest:
    """Move the snapshot's disk to ``new_path`` (same file system) and record it.

    A fork takes the parent's disk into the snapshot directory so that the frozen disk
    outlives the parent. Only allowed before anything restored from the snapshot.
    Idempotent: a move cut short between the rename and the manifest's update (the disk
    is at ``new_path`` with its recorded size and mtime, which a rename keeps) is
    recorded now.
    """
    manifest = load_manifest(snapshot_dir)
    if (snapshot_dir / CONSUMED_MARKER).exists() or (snapshot_dir / FROZEN_MARKER).exists():
        raise SnapshotError(f"snapshot {snapshot_dir} is in use; its disk cannot move")
    old = Path(manifest.disk.path)
    renamed = not old.exists() and manifest.disk.changed(new_path) is None
    if not renamed:
        why = manifest.disk.changed(old)
        if why:
            raise SnapshotError(f"snapshot {snapshot_dir}: disk: {why}")
        os.rename(old, new_path)
        crash_point("freeze.disk_moved")
    moved = dataclasses.replace(
        manifest, disk=dataclasses.replace(manifest.disk, path=str(new_path.resolve()))
    )
    manifest_path = snapshot_dir / MANIFEST_FILE
    os.chmod(manifest_path, 0o600)
    write_atomic(manifest_path, moved.to_json(), fsync=False)
    return moved


def _check_static(snapshot_dir: Path, cfg: VmConfig, *, clone: bool) -> SnapshotManifest:
    """Every check but the stream checksum (see the design note)."""
    manifest = load_manifest(snapshot_dir)
    if (snapshot_dir / CONSUMED_MARKER).exists():
        raise SnapshotError(
            f"snapshot {snapshot_dir} was already resumed; its disk and memory have moved "
            "on. Take a new snapshot"
        )
    if not clone and (snapshot_dir / FROZEN_MARKER).exists():
        raise SnapshotError(
            f"snapshot {snapshot_dir} is frozen (clones may run on it); restore it with "
            "clone=True on a new overlay (create_clone_disk)"
        )
    if manifest.ram_in_file and clone:
        # A clone's RAM is the snapshot's memory file, whatever cfg says.
        cfg = dataclasses.replace(cfg, memory_file=snapshot_dir / MEMORY_FILE)
    elif manifest.ram_in_file and cfg.memory_file is None:
        raise SnapshotError(
            f"snapshot {snapshot_dir} keeps RAM in a file: give VmConfig.memory_file "
            "(same file system as the snapshot) to resume into"
        )
    problems = compat_mismatches(manifest.compat, compat_fields(cfg))
    if problems:
        raise SnapshotError(
            f"snapshot {snapshot_dir} does not fit this VM config: " + "; ".join(problems)
        )
    if manifest.ram_in_file:
        assert manifest.memory is not None
        why = manifest.memory.changed(snapshot_dir / MEMORY_FILE)
        if why:
            raise SnapshotError(f"snapshot {snapshot_dir}: memory file: {why}")
    disk = Path(manifest.disk.path)
    why = manifest.disk.changed(disk)
    if why:
        raise SnapshotError(f"snapshot {snapshot_dir}: disk: {why}")
    if clone:
        backing = qcow2_backing_file(cfg.disk)
        if backing is None or Path(backing).resolve() != disk:
            raise SnapshotError(
                f"clone disk {cfg.disk} must be a qcow2 overlay on the snapshot's disk "
                f"{disk} (it has backing {backing!r}); create it with create_clone_disk()"
            )
    elif cfg.disk.resolve() != disk:
        raise SnapshotError(
            f"resume needs the snapshot's own disk {disk}, not {cfg.disk}; "
            "or restore with clone=True on an overlay"
        )
    return manifest


# Streams whose content matched their recorded digest in this process, by what any
# change to the file changes (ctime moves with every write, chmod or rename, and user
# space cannot set it back): the clones of one frozen snapshot (a fork's children, the
# creates from a named snapshot) hash its stream once, not once each.
_state_verified: set[tuple[int, int, int, int, int, str]] = set()


def _state_key(st: os.stat_result, digest: str) -> tuple[int, int, int, int, int, str]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, digest)


def _check_state_fd(snapshot_dir: Path, manifest: SnapshotManifest, fd: int) -> None:
    before = os.fstat(fd)
    if _state_key(before, manifest.state_digest) in _state_verified:
        return
    algorithm = manifest.state_digest.partition(":")[0]
    digest, size = fd_digest(fd, algorithm)
    if size == manifest.state_size and digest == manifest.state_digest:
        after = os.fstat(fd)
        if _state_key(after, digest) == _state_key(before, digest):
            _state_verified.add(_state_key(after, digest))
        return
    if size != manifest.state_size or digest != manifest.state_digest:
        raise SnapshotError(
            f"snapshot {snapshot_dir}: {STATE_FILE} does not match its recorded checksum "
            f"({size} bytes, {digest[:26]}…; recorded {manifest.state_size} bytes, "
            f"{manifest.state_digest[:26]}…); it will not be loaded. Take a new snapshot"
        )


def verify_snapshot(snapshot_dir: Path, cfg: VmConfig, *, clone: bool = False) -> SnapshotManifest:
    """All checks a restore of ``snapshot_dir`` with ``cfg`` makes before starting QEMU
    (the design note lists them), including the stream's checksum and a sealed memory
    file's. Raises SnapshotError saying what differs; returns the manifest."""
    manifest = _check_static(snapshot_dir, cfg, clone=clone)
    fd = _open_state(snapshot_dir)
    try:
        _check_state_fd(snapshot_dir, manifest, fd)
    finally:
        os.close(fd)
    check_memory(snapshot_dir, manifest)
    return manifest


def _open_state(snapshot_dir: Path) -> int:
    try:
        return os.open(snapshot_dir / STATE_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise SnapshotError(f"snapshot {snapshot_dir}: cannot open {STATE_FILE}: {exc}") from exc


def create_clone_disk(snapshot_dir: Path, path: Path) -> None:
    """Create ``path``: a qcow2 overlay on the snapshot's (frozen) disk, for one clone.

    Makes the snapshot's disk read-only first. Raises SnapshotError when the snapshot is
    unusable or ``qemu-img`` fails.
    """
    manifest = load_manifest(snapshot_dir)
    disk = Path(manifest.disk.path)
    why = manifest.disk.changed(disk)
    if why:
        raise SnapshotError(f"snapshot {snapshot_dir}: disk: {why}")
    freeze(snapshot_dir, manifest)
    argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(disk), str(path)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SnapshotError(f"cannot run qemu-img: {exc} (install qemu-utils)") from exc
    if done.returncode != 0:
        raise SnapshotError(f"creating clone disk {path} failed: {done.stderr.strip()}")


async def restore(
    cfg: VmConfig,
    snapshot_dir: Path,
    *,
    clone: bool,
    ready_timeout_s: float = 20.0,
    timeout_s: float = 300.0,
    cgroup: SandboxCgroup | None = None,
) -> QemuVm:
    """Start a QEMU for ``cfg`` from ``snapshot_dir`` and let the guest run (``cont``).

    ``cgroup``: the group QEMU runs in (``QemuVm.launch``).

    Resume (``clone=False``): ``cfg.disk`` must be the snapshot's disk; with a ram_in_file
    snapshot ``memory.ram`` is moved to ``cfg.memory_file`` (required) and mapped shared.
    The snapshot is consumed. Fork (``clone=True``): ``cfg.disk`` must be an overlay made
    by :func:`create_clone_disk`; RAM maps ``memory.ram`` copy-on-write
    (``cfg.memory_file`` is ignored); the snapshot is frozen. Names, sockets and logs
    come from ``cfg`` and must be the clone's own.

    The guest then runs with the template's clock, RNG and hostname: connect the agent
    (``AgentClient.connect`` - its hello fixes those) before running user code.
    Raises SnapshotError when a check fails, QEMU does not start or the stream does not
    load (wrapping the VmError); QEMU is then killed and a resume leaves the snapshot as
    it was.
    """
    t_all = time.perf_counter()
    manifest = _check_static(snapshot_dir, cfg, clone=clone)
    fd = _open_state(snapshot_dir)
    undo: list[tuple[Path, Path]] = []
    vm: QemuVm | None = None
    try:
        # Hash the very fd QEMU will read: no window to swap the file in between.
        await asyncio.to_thread(_check_state_fd, snapshot_dir, manifest, fd)
        await asyncio.to_thread(check_memory, snapshot_dir, manifest)
        run_cfg = dataclasses.replace(cfg, incoming=True)
        if manifest.ram_in_file:
            memory = snapshot_dir / MEMORY_FILE
            if clone:
                freeze(snapshot_dir, manifest)
                run_cfg = dataclasses.replace(run_cfg, memory_file=memory, memory_shared=False)
            else:
                assert cfg.memory_file is not None  # _check_static
                _consume(snapshot_dir)
                os.rename(memory, cfg.memory_file)
                undo.append((cfg.memory_file, memory))
                run_cfg = dataclasses.replace(run_cfg, memory_shared=True)
        elif clone:
            freeze(snapshot_dir, manifest)
        if not clone and manifest.ram_in_file and cfg.memory_file is not None:
            os.chmod(cfg.memory_file, 0o600)
        t = time.perf_counter()
        vm = await QemuVm.launch(run_cfg, cgroup=cgroup, ready_timeout_s=ready_timeout_s)
        launch_ms = elapsed_ms(t)
        version = await query_qemu_version(vm)
        if version != manifest.qemu_version:
            raise SnapshotError(
                f"snapshot {snapshot_dir} was taken with QEMU {manifest.qemu_version!r}; "
                f"this host runs {version!r}. Cold-boot the sandbox instead"
            )
        crash_point("restore.launched")
        t = time.perf_counter()
        await set_ignore_shared(vm, ignore_shared=manifest.ram_in_file)
        await vm.send_fd(_FD_NAME, fd)
        await vm.qmp("migrate-incoming", uri=f"fd:{_FD_NAME}")
        await wait_migration(vm, f"restoring VM {cfg.name}", timeout_s)
        load_ms = elapsed_ms(t)
        crash_point("restore.loaded")
        if not clone and not manifest.ram_in_file:
            # The point of no return: from here on the guest changes the disk.
            _consume(snapshot_dir)
        await vm.qmp("cont")
        crash_point("restore.running")
    except BaseException as exc:
        if vm is not None:
            await vm.kill(grace_s=0)
        for now, back in reversed(undo):
            with contextlib.suppress(OSError):
                os.rename(now, back)
        if not clone:
            with contextlib.suppress(FileNotFoundError):
                (snapshot_dir / CONSUMED_MARKER).unlink()
        if isinstance(exc, VmError):
            raise SnapshotError(f"restoring {snapshot_dir} failed: {exc}") from exc
        raise
    finally:
        os.close(fd)
    log.info(
        "vm %s: restored from %s (clone=%s): launch %.1f ms, load %.1f ms, total %.1f ms",
        cfg.name,
        snapshot_dir,
        clone,
        launch_ms,
        load_ms,
        elapsed_ms(t_all),
    )
    return vm


def _consume(snapshot_dir: Path) -> None:
    (snapshot_dir / CONSUMED_MARKER).write_text(f"{time.time_ns()}\n")
