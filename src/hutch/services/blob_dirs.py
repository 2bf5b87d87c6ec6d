"""A frozen VM state directory (a named snapshot's, a memory pause's) to and from the
blob store, with the qcow2 chain under its disk: :func:`upload_dir`, :func:`fetch_dir`.

``hutch.services.snapshot_blobs`` uses them for named snapshots under
``snapshots/<id>/``; a cross-host resume can use them for a pause directory under a
prefix of its own (the disk then goes in as ``disk.qcow2`` through ``disk=``).

Index (``<prefix>index.json``, written last: its presence = the upload is complete)::

    {"format": 1, "owner": "<id>",
     "files":  {"state.mig": {"size": n, "sha256": h}, "disk.qcow2": {...}, ...},
     "layers": [{"name": "layer-1.qcow2", "size": n, "sha256": h}, ...],  # under the disk
     "base": "<the raw image at the chain's bottom>", "base_size": n}

A fetch trusts nothing it reads from the store: every blob is checked against the
index (size + sha256) as it is written; names are checked (no path can leave the
staging directory); the raw image the chain is rebased onto must be inside this host's
images directory (an index naming ``/etc/shadow`` as base would otherwise give a guest
a host file as its disk); the migration stream must match the manifest's own digest.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import subprocess
from pathlib import Path
from typing import Any

from hutch.errors import BlobError, SnapshotError
from hutch.storage.blobs import BlobInfo, BlobStore
from hutch.storage.blobs.flat import FILE_NAME, INDEX, Put
from hutch.vm.disk_chain import disk_chain
from hutch.vm.snapshot import MANIFEST_FILE, STATE_FILE
from hutch.vm.snapshot_dir import load_manifest
from hutch.vm.snapshot_manifest import FileStamp, fd_digest, write_atomic

__all__ = ["DISK", "INDEX", "INDEX_FORMAT", "fetch_dir", "upload_dir"]

INDEX_FORMAT = 1
DISK = "disk.qcow2"
_LAYER_NAME = re.compile(r"^layer-[0-9]{1,3}\.qcow2$")


def upload_dir(
    store: BlobStore,
    prefix: str,
    d: Path | None,
    *,
    owner: str,
    scratch: Path,
    disk: Path | None = None,
    extra: dict[str, Path] | None = None,
    put: Put | None = None,
) -> int:
    """Upload every file of ``d`` (None: no directory, e.g. a disk-mode pause), the
    ``extra`` files under their names (a pause's ``vm.json``), ``disk`` as
    ``disk.qcow2`` when it lives elsewhere, the qcow2 layers under the disk, then the
    index; return the bytes sent. ``put`` (default ``store.put``) lets a caller stop
    between blobs; ``scratch``: where the index is written before it is sent. The files
    must not change meanwhile (frozen)."""
    send = put or store.put
    files: dict[str, dict[str, Any]] = {}
    for f in sorted(d.iterdir()) if d is not None else ():
        if f.is_file() and not f.name.startswith("."):
            files[f.name] = _rec(send(prefix + f.name, f))
    for name, path in sorted((extra or {}).items()):
        files[name] = _rec(send(prefix + name, path))
    if disk is None and d is None:
        raise SnapshotError(f"{owner}: nothing to upload (no directory and no disk)")
    top = disk if disk is not None else d / DISK  # type: ignore[operator]
    if disk is not None:
        files[DISK] = _rec(send(prefix + DISK, disk))
    layers, base = disk_chain(top)
    chain = []
    for i, layer in enumerate(layers[1:], start=1):
        name = f"layer-{i}.qcow2"
        chain.append({"name": name, **_rec(send(prefix + name, layer))})
    index = {
        "format": INDEX_FORMAT,
        "owner": owner,
        "files": files,
        "layers": chain,
        "base": str(base) if base is not None else None,
        "base_size": base.stat().st_size if base is not None else None,
    }
    tmp = scratch / f".index-{owner}-{secrets.token_hex(4)}.json"
    try:
        tmp.write_text(json.dumps(index, indent=2, sort_keys=True))
        send(prefix + INDEX, tmp)
    finally:
        tmp.unlink(missing_ok=True)
    return sum(int(f["size"]) for f in [*files.values(), *chain])


def fetch_dir(
    store: BlobStore,
    prefix: str,
    staging: Path,
    final: Path,
    *,
    owner: str,
    images_dir: Path,
    memory: bool = True,
) -> dict[str, Any]:
    """Download what :func:`upload_dir` stored under ``prefix`` into ``staging`` (an
    empty directory), made ready to be renamed to ``final``: the chain rebased onto
    itself at ``final`` and onto the raw image (inside ``images_dir``), the manifest's
    disk stamp renewed for ``final``, every file read-only. ``memory`` False: a
    disk-only state (a disk-mode pause: no manifest nor stream to check). Returns the
    index. Raises ``BlobError`` naming what failed; the caller removes ``staging`` then."""
    found = store.stat(prefix + INDEX)
    if found is None:
        raise BlobError(
            f"{owner} is not on this host and its upload to {store.url} has not completed "
            f"(no {prefix}{INDEX}); retry once it has, or on the host that saved it"
        )
    index_path = staging / ".index.json"
    store.get(prefix + INDEX, index_path, expect=found)
    index = _parse_index(index_path, owner, prefix, store.url, memory=memory)
    index_path.unlink()
    for name, rec in index["files"].items():
        store.get(prefix + name, staging / name, expect=_expect(prefix + name, rec))
    for rec in index["layers"]:
        name = rec["name"]
        store.get(prefix + name, staging / name, expect=_expect(prefix + name, rec))
    _relink(index, staging, final, owner, images_dir, memory=memory)
    for f in staging.iterdir():
        os.chmod(f, 0o444)
    return index


def _relink(
    index: dict[str, Any],
    staging: Path,
    final: Path,
    owner: str,
    images_dir: Path,
    *,
    memory: bool = True,
) -> None:
    """Point the fetched chain at itself and at this host's raw image, check the stream
    against the manifest's digest, renew the manifest's disk (and memory) stamp."""
    final = final.parent.resolve() / final.name
    base = index["base"]
    if base is not None:
        path = Path(base).resolve()
        if not path.is_relative_to(images_dir.resolve()):
            raise BlobError(
                f"{owner}: its index names {base} as the image under its disk, which is "
                f"not in this host's images directory {images_dir}; it is not used"
            )
        if not path.is_file() or path.stat().st_size != index["base_size"]:
            raise BlobError(
                f"{owner} is built on the image {base}, which this host does not have "
                "(build or import that image here first)"
            )
    names = [DISK, *(rec["name"] for rec in index["layers"])]
    for i, name in enumerate(names):
        if i + 1 < len(names):
            backing, fmt = str(final / names[i + 1]), "qcow2"
        elif base is not None:
            backing, fmt = base, "raw"
        else:
            continue
        _qemu_img(["rebase", "-u", "-f", "qcow2", "-F", fmt, "-b", backing, str(staging / name)])
    if not memory:
        return
    manifest_path = staging / MANIFEST_FILE
    os.chmod(manifest_path, 0o644)
    manifest = load_manifest(staging)
    with open(staging / STATE_FILE, "rb") as f:
        digest, size = fd_digest(f.fileno(), manifest.state_digest.split(":", 1)[0])
    if (digest, size) != (manifest.state_digest, manifest.state_size):
        raise BlobError(
            f"{owner}: the fetched {STATE_FILE} does not match its manifest ({digest}, "
            f"{size} bytes; the manifest has {manifest.state_digest}, "
            f"{manifest.state_size}); it is not used"
        )
    st = (staging / DISK).stat()
    mem_stamp = manifest.memory
    if mem_stamp is not None:
        mem = staging / Path(mem_stamp.path).name
        mst = mem.stat()
        mem_stamp = FileStamp(str(final / mem.name), mst.st_size, mst.st_mtime_ns)
    renewed = dataclasses.replace(
        manifest,
        disk=FileStamp(str(final / DISK), st.st_size, st.st_mtime_ns),
        memory=mem_stamp,
    )
    write_atomic(manifest_path, renewed.to_json(), fsync=True)


def _rec(info: BlobInfo) -> dict[str, Any]:
    return {"size": info.size, "sha256": info.sha256}


def _expect(key: str, rec: dict[str, Any]) -> BlobInfo:
    return BlobInfo(key, int(rec["size"]), str(rec["sha256"]))


def _parse_index(
    path: Path, owner: str, prefix: str, url: str, *, memory: bool = True
) -> dict[str, Any]:
    try:
        index: dict[str, Any] = json.loads(path.read_text())
        if index.get("format") != INDEX_FORMAT or index.get("owner") != owner:
            raise ValueError(f"format {index.get('format')!r}, owner {index.get('owner')!r}")
        for rec in [*index["files"].values(), *index["layers"]]:
            if not re.fullmatch(r"[0-9a-f]{64}", str(rec["sha256"])) or int(rec["size"]) < 0:
                raise ValueError(f"record {rec!r}")
        for name in index["files"]:
            if not FILE_NAME.match(name) or name == INDEX:
                raise ValueError(f"file name {name!r}")
        for rec in index["layers"]:
            if not _LAYER_NAME.match(str(rec["name"])) or rec["name"] in index["files"]:
                raise ValueError(f"layer name {rec['name']!r}")
        required = {MANIFEST_FILE, STATE_FILE, DISK} if memory else {DISK}
        if not required <= set(index["files"]):
            raise ValueError(f"no {' or '.join(sorted(required))}")
        if index["base"] is not None:
            str(index["base"]), int(index["base_size"])
        return index
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise BlobError(
            f"blob {prefix}{INDEX} at {url} is not a valid index ({exc}); {owner} cannot be fetched"
        ) from exc


def _qemu_img(args: list[str]) -> None:
    done = subprocess.run(["qemu-img", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SnapshotError(f"qemu-img {' '.join(args)} failed: {done.stderr.strip()}")
