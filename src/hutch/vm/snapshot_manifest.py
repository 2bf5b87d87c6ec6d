"""The snapshot manifest: what a memory snapshot was taken from, and the checks that a
restore must pass (pure: no I/O except the file digests, which are cached).

See :mod:`hutch.vm.snapshot` for the design note. A manifest is JSON, written last
(its presence means the snapshot is complete), and versioned by ``format``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from hutch.errors import SnapshotError
from hutch.vm.argv import MACHINE, TCG_CPU, VmConfig, guest_cmdline

__all__ = [
    "MANIFEST_FILE",
    "MANIFEST_FORMAT",
    "MEMORY_FILE",
    "STATE_FILE",
    "CompatFields",
    "FileStamp",
    "SnapshotManifest",
    "compat_fields",
    "compat_mismatches",
    "fd_digest",
    "file_sha256",
    "fsync_path",
    "write_atomic",
]

# 2: the stream's checksum is ``state_digest`` ("<algorithm>:<hex>"); format 1
# manifests (``state_sha256``) are read as "sha256:<hex>".
MANIFEST_FORMAT = 2
# The stream is checksummed against corruption at rest, not against someone able to
# rewrite the manifest beside it: XXH3-128 runs at ~7 GB/s here against ~1.4 GB/s for
# sha256, which put ~270 ms on every resume of a 512 MiB sandbox and trailed the pause.
STATE_DIGEST = "xxh3_128"
_DIGESTS: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}

# The files of a snapshot directory.
STATE_FILE = "state.mig"
MEMORY_FILE = "memory.ram"
MANIFEST_FILE = "manifest.json"

_HASH_CHUNK = 1 << 20
READ_ONLY = 0o444


@dataclass(frozen=True)
class CompatFields:
    """What must be equal between the VM that was saved and the one restoring it.

    A migration stream only loads into the same machine: same QEMU machine type and
    options, CPU model (the CPUID the guest saw), accelerator, RAM size and layout
    (``memory_backend``: the RAM block is named ``microvm.ram`` or ``/objects/mem``),
    vCPU count, kernel (the guest is running it; its modules are on the disk) and TSC
    rate (the guest's clocksource was calibrated to it).
    """

    machine: str
    cpu: str
    accel: str
    memory_mib: int
    vcpus: int
    memory_backend: str  # "ram" (anonymous) | "file" (memory-backend-file)
    kernel_sha256: str
    tsc_khz: int | None


@dataclass(frozen=True)
class FileStamp:
    """Identity of a large file we do not hash on every restore (disk, memory file).

    ``mtime_ns`` and ``size`` change on any write through the file system; the check is
    against accidents (a disk written after the snapshot), not against host root.
    """

    path: str
    size: int
    mtime_ns: int
    #: Set by sealing (``hutch.vm.snapshot_seal.seal_memory``; None in manifests from before
    #: it, which are read as they were): the content digest taken once the file was
    #: made read-only, and the file's ctime from that moment. Every write, chmod or
    #: rename changes ctime, which user space cannot set back, so an unchanged ctime
    #: proves the content is the digested one without reading it (the hot path); a
    #: changed ctime costs one full re-hash (a copy from a blob store, a moved
    #: directory) and a mismatch refuses the file.
    digest: str | None = None
    ctime_ns: int | None = None

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        st = path.stat()
        return cls(str(path), st.st_size, st.st_mtime_ns)

    def changed(self, path: Path) -> str | None:
        """None if ``path`` still matches, else what differs (for an error message)."""
        try:
            st = path.stat()
        except OSError as exc:
            return f"{path} is unreadable: {exc.strerror}"
        if st.st_size != self.size:
            return f"{path} changed size ({self.size} → {st.st_size} bytes)"
        if st.st_mtime_ns != self.mtime_ns:
            return f"{path} was modified after the snapshot (mtime differs)"
        return None


@dataclass(frozen=True)
class SnapshotManifest:
    """``manifest.json`` of one snapshot directory.

    ``state_digest``/``state_size`` cover the migration stream (``state.mig``): QEMU
    parses it, so it is never loaded unless it matches. ``ram_in_file``: guest RAM is
    ``memory.ram`` in the snapshot directory (the stream then holds device state only).
    ``disk`` is the qcow2 the VM was using, left where it was; it belongs to the
    snapshot from now on. ``timings_ms`` are the save's phases, for benchmarks.
    """

    format: int
    name: str
    created_ns: int
    qemu_version: str
    compat: CompatFields
    cmdline: str
    initrd_sha256: str
    state_size: int
    state_digest: str
    ram_in_file: bool
    memory: FileStamp | None
    disk: FileStamp
    timings_ms: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: Path) -> SnapshotManifest:
        """Parse; raises ``SnapshotError`` naming ``where`` for anything malformed."""
        try:
            raw: dict[str, Any] = json.loads(text)
            if raw.get("format") == 1:
                raw["format"] = MANIFEST_FORMAT
                raw["state_digest"] = "sha256:" + raw.pop("state_sha256")
            if raw.get("format") != MANIFEST_FORMAT:
                raise SnapshotError(
                    f"{where}: snapshot format {raw.get('format')!r} is not the "
                    f"supported {MANIFEST_FORMAT}; take a new snapshot with this hutch"
                )
            memory = raw.pop("memory")
            return cls(
                **{
                    **raw,
                    "compat": CompatFields(**raw["compat"]),
                    "memory": FileStamp(**memory) if memory is not None else None,
                    "disk": FileStamp(**raw["disk"]),
                }
            )
        except SnapshotError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise SnapshotError(f"{where}: the snapshot manifest is malformed: {exc}") from exc


# Digests of big read-only inputs (kernels), keyed by what changes on any modification
# (ctime cannot be set from user space), so a restore does not re-read 30 MB each time.
_digest_cache: dict[tuple[int, int, int, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """sha256 hex of ``path``; cached per (device, inode, size, mtime, ctime)."""
    st = path.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    cached = _digest_cache.get(key)
    if cached is not None:
        return cached
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    _digest_cache[key] = digest.hexdigest()
    return _digest_cache[key]


def new_digest(algorithm: str) -> Any:
    """A hashlib-style object for a ``state_digest`` algorithm; ``SnapshotError`` names
    the ones accepted."""
    try:
        return _DIGESTS[algorithm]()
    except KeyError:
        raise SnapshotError(
            f"unknown snapshot checksum {algorithm!r}; accepted: {', '.join(_DIGESTS)}"
        ) from None


def fd_digest(fd: int, algorithm: str = STATE_DIGEST) -> tuple[str, int]:
    """``"<algorithm>:<hex>"`` and size of everything readable from ``fd`` from offset 0
    (pread: the fd's offset is left alone, so the same fd can then be handed to QEMU)."""
    digest = new_digest(algorithm)
    offset = 0
    while chunk := os.pread(fd, _HASH_CHUNK, offset):
        digest.update(chunk)
        offset += len(chunk)
    return f"{algorithm}:{digest.hexdigest()}", offset


class TailHasher:
    """Checksum of a file another process is appending to, computed while it writes.

    QEMU writes the migration stream sequentially, and a byte below the file's size is
    already in the page cache, so reading up to the current size is safe. Hashing during
    the save instead of after it takes the hash off the pause's critical path (a second
    core does it while QEMU writes). ``finish()`` is called once the writer is done.
    """

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._digest = new_digest(STATE_DIGEST)
        self._offset = 0
        self._done = threading.Event()
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="hutch-tail-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                writer_done = self._done.is_set()
                chunk = os.pread(self._fd, _HASH_CHUNK, self._offset)
                if chunk:
                    self._digest.update(chunk)
                    self._offset += len(chunk)
                elif writer_done:
                    return
                else:
                    self._done.wait(0.005)
        except OSError as exc:
            self._error = exc

    def finish(self) -> tuple[str, int]:
        """The writer is done: hash the rest, return ("<algorithm>:<hex>", size). Blocks."""
        self._done.set()
        self._thread.join()
        os.close(self._fd)
        if self._error is not None:
            raise SnapshotError(f"reading the snapshot to hash it failed: {self._error}")
        return f"{STATE_DIGEST}:{self._digest.hexdigest()}", self._offset

    def abandon(self) -> None:
        """Stop without a result (the save failed)."""
        self._done.set()
        self._thread.join()
        with contextlib.suppress(OSError):
            os.close(self._fd)


def compat_fields(cfg: VmConfig) -> CompatFields:
    """The fields of ``cfg`` a snapshot is tied to (see :class:`CompatFields`)."""
    return CompatFields(
        machine=MACHINE,
        cpu="host" if cfg.accel == "kvm" else TCG_CPU,
        accel=cfg.accel,
        memory_mib=cfg.memory_mib,
        vcpus=cfg.vcpus,
        memory_backend="file" if cfg.memory_file is not None else "ram",
        kernel_sha256=file_sha256(cfg.kernel),
        tsc_khz=cfg.tsc_khz if cfg.accel == "tcg" else None,
    )


def compat_mismatches(saved: CompatFields, now: CompatFields) -> list[str]:
    """Human-readable differences (empty when a restore may proceed)."""
    out = []
    for name, was in asdict(saved).items():
        is_ = getattr(now, name)
        if was != is_:
            out.append(f"{name}: snapshot has {was!r}, this VM config has {is_!r}")
    return out


def describe_cmdline(cfg: VmConfig) -> str:
    """Recorded, not enforced: after a restore the guest keeps the command line it
    booted with (it is in guest RAM), so clones may differ here (e.g. hostname)."""
    return guest_cmdline(cfg)


def fsync_path(path: Path, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str, *, fsync: bool) -> None:
    """Replace ``path`` with ``text`` (read-only) so that a crash leaves old or new."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.chmod(tmp, READ_ONLY)
    os.rename(tmp, path)
    if fsync:
        fsync_path(path.parent, directory=True)
