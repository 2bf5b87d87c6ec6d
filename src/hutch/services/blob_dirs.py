"""A frozen VM state directory (a named snapshot's, a memory pause's) to and from the
blob store, with the qcow2 chain under its disk: :func:`upload_dir`, :func:`fetch_dir`.

``hutch.services.snapshot_blobs`` uses them for named snapshots under
``snapshots/<id>/``; a cross-host resume can use them for a pause directory under a
prefix of its own (the disk then goes in as ``disk.qcow2`` through ``disk=``).

Index (``<prefix>index.json``, written last: its presence = the upload is complete)::

    {"format": 1, "owner": "<id>",
     "files":  {"state.mig": {"size": n, "sha256": h}, "disk.qcow2": {...}, ...},
     "layers": [{"name": "layer-1.qcow2", "size": n, "sha256": h}, ...],  # under the disk
     "base": "<the raw image at the chain's bottom>", "base_size": n,
     "base_sha256": "<its content identity>",                     # hutch.images.identity
     "depends": {"<another image file the guest reads>": "<its sha256>"},  # runtime disk
     "sparse": {"memory.ram": {"blob": "memory.ram.data", "size": n,   # format 2 only
                               "extents": [[offset, length], ...]}}}

``sparse`` (``upload_dir(sparse=...)``; a template's ``memory.ram``): the file is sent
as its non-zero extents only (``hutch.storage.sparse``: holes and zero pages stay
behind), in the blob the entry names, which ``files`` lists like any other; the fetch
recreates the file at its size with holes elsewhere and removes the blob. An index
with such entries is format 2 (a fetcher that knows only format 1 refuses it, as it
must: it would miss the file); without, format 1 as before.

``base_sha256`` and ``depends`` (issue 14): images are not byte-reproducible across
hosts, so the same image name (or OCI digest) can be other bytes on another host, and a
frozen disk opened over other bytes than it was taken on is silently corrupt. A fetch
compares each with this host's file before it downloads anything and refuses a
difference with ``ImageMismatch`` (nothing is downloaded, renamed or changed). An index
written before these fields existed has neither and is fetched as before (unchecked).

The raw image under the chain may be a built-in image's rootfs
(``<images>/<name>/<digest>/rootfs.ext4``) of a digest this host lacks (another hutch
version, other apt mirrors): ``fetch_dir``'s ``images`` (``BaseImages``,
``services/builtin_blobs.py``) fetches it from the blob store first, verified, when the
bucket has a complete recorded upload of it, and holds this host's copy from an
adoption (its bytes replaced) until the fetch is done. Without one it is refused with
``ImageMissing`` naming the image, the digest and what to do.

A fetch trusts nothing it reads from the store: every blob is checked against the
index (size + sha256) as it is written; names are checked (no path can leave the
staging directory); the raw image the chain is rebased onto must be inside this host's
images directory (an index naming ``/etc/shadow`` as base would otherwise give a guest
a host file as its disk), and so must every file ``depends`` names; the migration
stream must match the manifest's own digest, and a sealed memory file the digest its
manifest recorded (the seal is kept: the caller's ``seal_memory`` re-hashes the file
and refuses other bytes). ``index_sha256`` (the uploader's record of the index's
bytes, kept where the bucket cannot write: ``before_index``) makes the index itself,
and so every file it names, trusted only as far as that record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import secrets
import subprocess
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Protocol

from hutch.crashpoints import crash_point
from hutch.errors import BlobError, ImageMismatch, ImageMissing, SnapshotError
from hutch.images import identity
from hutch.images.catalog import IMAGES
from hutch.storage.blobs import BlobInfo, BlobStore
from hutch.storage.blobs.flat import FILE_NAME, INDEX, Put, read_small
from hutch.storage.sparse import SparseLayout, pack, unpack
from hutch.vm.disk_chain import disk_chain
from hutch.vm.snapshot import MANIFEST_FILE, STATE_FILE
from hutch.vm.snapshot_dir import load_manifest
from hutch.vm.snapshot_manifest import FileStamp, fd_digest, write_atomic

__all__ = [
    "DISK",
    "INDEX",
    "INDEX_FORMAT",
    "SPARSE_FORMAT",
    "BaseImages",
    "builtin_of",
    "fetch_dir",
    "frozen_base",
    "upload_dir",
]

INDEX_FORMAT = 1
#: An index with ``sparse`` entries (older fetchers refuse it rather than miss a file).
SPARSE_FORMAT = 2
#: The blob a sparse file's non-zero extents are sent in: ``<name>`` + this.
SPARSE_BLOB = ".data"
DISK = "disk.qcow2"
_LAYER_NAME = re.compile(r"^layer-[0-9]{1,3}\.qcow2$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
#: The VM configuration a frozen directory carries (``runtime.qemu.host``): where the
#: runtime disk it depends on is named.
_VM_JSON = "vm.json"
#: A built-in image's directory name (``hutch.images.build``: its digest).
_BUILTIN_DIGEST = re.compile(r"^[0-9a-f]{16}$")


class BaseImages(Protocol):
    """This host's images as the raw base of a fetched chain (``builtin_blobs``)."""

    def hold(self, path: Path, what: str) -> contextlib.AbstractContextManager[None]:
        """Hold this host's copy of the image file ``path`` (an index's base) from a
        replacement for the block; a built-in image this host lacks is fetched from the
        blob store first when it has a complete recorded upload of it (else nothing
        happens and the check that follows refuses it). Blocking; ``BlobError`` when
        the store fails or a blob fails its check."""
        ...


def builtin_of(path: Path, images_dir: Path) -> tuple[str, str] | None:
    """(name, digest) when ``path`` is a built-in image's rootfs in ``images_dir``
    (``<name>/<digest>/rootfs.ext4``), else None. Pure but for resolving links."""
    try:
        rel = path.resolve().relative_to(images_dir.resolve())
    except ValueError:
        return None
    parts = rel.parts
    if len(parts) != 3 or parts[0] not in IMAGES or parts[2] != "rootfs.ext4":
        return None
    return (parts[0], parts[1]) if _BUILTIN_DIGEST.match(parts[1]) else None


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
    sparse: Collection[str] = (),
    before_index: Callable[[bytes], None] | None = None,
) -> int:
    """Upload every file of ``d`` (None: no directory, e.g. a disk-mode pause), the
    ``extra`` files under their names (a pause's ``vm.json``), ``disk`` as
    ``disk.qcow2`` when it lives elsewhere, the qcow2 layers under the disk, then the
    index; return the bytes sent. ``put`` (default ``store.put``) lets a caller stop
    between blobs; ``scratch``: where the index is written before it is sent, and the
    packed extents of the ``sparse`` files of ``d`` (kept there until the index is
    sent, so that an upload retried after a failure or a restart sends the same file
    and its S3 journal continues it); ``before_index`` is called with the index's bytes
    just before they go (to record them where the bucket cannot write). The files must
    not change meanwhile (frozen)."""
    send = put or store.put
    files: dict[str, dict[str, Any]] = {}
    layouts: dict[str, dict[str, Any]] = {}
    packs: list[Path] = []
    found = [
        f
        for f in (sorted(d.iterdir()) if d is not None else ())
        if f.is_file() and not f.name.startswith(".")
    ]
    if {f.name + SPARSE_BLOB for f in found if f.name in sparse} & {f.name for f in found}:
        raise SnapshotError(f"{owner}: a file is named like a sparse file's blob; not sent")
    for f in found:
        if f.name in sparse:
            blob = f.name + SPARSE_BLOB
            data, layout = _packed(scratch, prefix, f)
            packs += [data, _pack_record(data)]
            files[blob] = _rec(send(prefix + blob, data))
            layouts[f.name] = {"blob": blob, **layout.to_json()}
        else:
            files[f.name] = _rec(send(prefix + f.name, f))
    for name, path in sorted((extra or {}).items()):
        files[name] = _rec(send(prefix + name, path))
    if disk is None and d is None:
        raise SnapshotError(f"{owner}: nothing to upload (no directory and no disk)")
    top = disk if disk is not None else d / DISK  # type: ignore[operator]
    if disk is not None:
        files[DISK] = _rec(send(prefix + DISK, disk))
    layers, base = disk_chain(top)
    vm_json = (extra or {}).get(_VM_JSON) or (d / _VM_JSON if d is not None else None)
    depends = _depends(vm_json)
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
        # Recorded once beside the image when it was built, imported or fetched
        # (hutch.images.identity); hashed here only for an image made before that.
        "base_sha256": identity.identity(base) if base is not None else None,
        "depends": depends,
    }
    if layouts:
        index["format"] = SPARSE_FORMAT
        index["sparse"] = layouts
    text = json.dumps(index, indent=2, sort_keys=True)
    if before_index is not None:
        before_index(text.encode())
    tmp = scratch / f".index-{owner}-{secrets.token_hex(4)}.json"
    try:
        tmp.write_text(text)
        send(prefix + INDEX, tmp)
    finally:
        tmp.unlink(missing_ok=True)
    for p in packs:  # complete: a retry no longer needs them
        p.unlink(missing_ok=True)
    return sum(int(f["size"]) for f in [*files.values(), *chain])


def _pack_record(data: Path) -> Path:
    return data.with_name(data.name + ".json")


def _packed(scratch: Path, prefix: str, source: Path) -> tuple[Path, SparseLayout]:
    """``source``'s non-zero extents packed in ``scratch`` (one file per prefix and
    name, with a record of what it was packed from), reused while the record still
    matches ``source`` and the packed file: a retried upload sends the same file."""
    tag = hashlib.sha256(f"{prefix}{source.name}".encode()).hexdigest()[:16]
    data = scratch / f".pack-{tag}"
    record = _pack_record(data)
    st = source.stat()
    made_from = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        kept = json.loads(record.read_text())
        dst = data.stat()
        if kept["source"] == made_from and kept["data"] == [dst.st_size, dst.st_mtime_ns]:
            return data, SparseLayout.from_json(kept["layout"])
    scratch.mkdir(parents=True, exist_ok=True)
    layout = pack(source, data)
    dst = data.stat()
    doc = {"source": made_from, "data": [dst.st_size, dst.st_mtime_ns], "layout": layout.to_json()}
    tmp = record.with_name(record.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.rename(tmp, record)
    return data, layout


def fetch_dir(
    store: BlobStore,
    prefix: str,
    staging: Path,
    final: Path,
    *,
    owner: str,
    images_dir: Path,
    memory: bool = True,
    image: str = "",
    index_sha256: str | None = None,
    images: BaseImages | None = None,
) -> dict[str, Any]:
    """Download what :func:`upload_dir` stored under ``prefix`` into ``staging`` (an
    empty directory), made ready to be renamed to ``final``: the chain rebased onto
    itself at ``final`` and onto the raw image (inside ``images_dir``), sparse files
    recreated, the manifest's disk stamp renewed for ``final``, every file read-only.
    ``memory`` False: a disk-only state (a disk-mode pause: no manifest nor stream to
    check). ``image``: the image's name, for messages. ``index_sha256``: the sha256 the
    uploader recorded of the index's bytes (None: the index is taken as it is).
    ``images``: fetches a built-in base this host lacks and holds the base from a
    replacement while this runs. Returns the index. Raises ``ImageMismatch`` before
    anything but the index is downloaded when the index records other image bytes than
    this host holds, ``ImageMissing`` when it names a built-in image this host lacks
    and cannot fetch, ``BlobError`` naming what failed otherwise; the caller removes
    ``staging`` then."""
    found = store.stat(prefix + INDEX)
    if found is None:
        raise BlobError(
            f"{owner} is not on this host and its upload to {store.url} has not completed "
            f"(no {prefix}{INDEX}); retry once it has, or on the host that saved it"
        )
    index_path = staging / ".index.json"
    store.get(prefix + INDEX, index_path, expect=found)
    if index_sha256 is not None:
        got = hashlib.sha256(index_path.read_bytes()).hexdigest()
        if got != index_sha256:
            index_path.unlink()
            raise BlobError(
                f"blob {prefix}{INDEX} at {store.url} is not the index its uploader "
                f"recorded (sha256 {got[:16]}..., recorded {index_sha256[:16]}...); "
                f"{owner} is not fetched"
            )
    index = _parse_index(index_path, owner, prefix, store.url, memory=memory)
    index_path.unlink()
    base = index["base"]
    held = (
        images.hold(Path(base), owner)
        if images is not None and base is not None
        else contextlib.nullcontext()
    )
    with held:  # the base's bytes stay these until the chain is relinked onto them
        _check_images(index, owner, images_dir, image)
        for name, rec in index["files"].items():
            store.get(prefix + name, staging / name, expect=_expect(prefix + name, rec))
            crash_point("fetch.blob")
        for rec in index["layers"]:
            name = rec["name"]
            store.get(prefix + name, staging / name, expect=_expect(prefix + name, rec))
        for name, entry in index.get("sparse", {}).items():
            blob = staging / entry["blob"]
            try:
                unpack(blob, SparseLayout.from_json(entry), staging / name)
            except ValueError as exc:
                raise BlobError(
                    f"{owner}: {name} cannot be recreated from {blob.name}: {exc}"
                ) from exc
            blob.unlink()
        _relink(index, staging, final, owner, images_dir, memory=memory)
    for f in staging.iterdir():
        os.chmod(f, 0o444)
    return index


def frozen_base(store: BlobStore, prefix: str, scratch: Path) -> tuple[str, str | None] | None:
    """The raw image a frozen directory uploaded under ``prefix`` was taken over and
    the identity recorded for it (None when the index records none), or None when there
    is no index or it names no base. Blocking; ``BlobError`` when the store fails or
    the index is not one."""
    raw = read_small(store, prefix + INDEX, scratch)
    if raw is None:
        return None
    try:
        index = json.loads(raw)
        base, sha = index.get("base"), index.get("base_sha256")
    except (ValueError, AttributeError) as exc:
        raise BlobError(
            f"blob {prefix}{INDEX} at {store.url} is not a valid index ({exc})"
        ) from exc
    if not isinstance(base, str):
        return None
    return base, sha if isinstance(sha, str) else None


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
        # The sealed digest stays (the ctime goes: this is another file): sealing it
        # here re-hashes it and refuses other bytes than the saving host sealed.
        mem_stamp = FileStamp(
            str(final / mem.name), mst.st_size, mst.st_mtime_ns, digest=mem_stamp.digest
        )
    renewed = dataclasses.replace(
        manifest,
        disk=FileStamp(str(final / DISK), st.st_size, st.st_mtime_ns),
        memory=mem_stamp,
    )
    write_atomic(manifest_path, renewed.to_json(), fsync=True)


def _depends(vm_json: Path | None) -> dict[str, str]:
    """The image files besides the base that the frozen guest read, by path, with their
    identity: the runtime disk ``vm.json`` names (imported images), if it is here."""
    if vm_json is None:
        return {}
    try:
        runtime = json.loads(vm_json.read_text()).get("runtime_disk")
    except (OSError, ValueError, AttributeError):
        return {}
    if not isinstance(runtime, str) or not Path(runtime).is_file():
        return {}
    return {runtime: identity.identity(Path(runtime))}


def _check_images(index: dict[str, Any], owner: str, images_dir: Path, image: str) -> None:
    """The image files the index depends on are this host's, inside its images
    directory, and (where the index records their identity) the same bytes."""
    base = index["base"]
    if base is not None:
        path = _inside(base, owner, images_dir, "the image under its disk")
        builtin = builtin_of(path, images_dir)
        if builtin is not None and not path.is_file():
            name, digest = builtin
            raise ImageMissing(
                f"{owner} was frozen over the built-in image {name!r} of digest {digest}, "
                "which this host does not have and the blob store has no complete upload "
                "of (recorded in the database); start the daemon of a host that holds it "
                "(it uploads its built-in images), or build that digest here (`hutch image "
                f"build {name}` with the hutch version and apt mirrors of the host that "
                "saved it), or resume/open it on a host that has it"
            )
        if path.is_file() and index.get("base_sha256") is not None:
            # Other bytes (of any size) under the same name: a mismatch, said as one.
            _same(path, str(index["base_sha256"]), owner, images_dir, image)
        if not path.is_file() or path.stat().st_size != index["base_size"]:
            raise BlobError(
                f"{owner} is built on the image {base}, which this host does not have "
                "(build or import that image here first)"
            )
    for name, sha in sorted(index.get("depends", {}).items()):
        path = _inside(name, owner, images_dir, "an image file its guest reads")
        if not path.is_file():
            raise BlobError(
                f"{owner} depends on the image file {name}, which this host does not have "
                "(import that image here first)"
            )
        _same(path, sha, owner, images_dir, image)


def _inside(name: str, owner: str, images_dir: Path, what: str) -> Path:
    path = Path(name).resolve()
    if not path.is_relative_to(images_dir.resolve()):
        raise BlobError(
            f"{owner}: its index names {name} as {what}, which is not in this host's "
            f"images directory {images_dir}; it is not used"
        )
    return path


def _same(path: Path, recorded: str, owner: str, images_dir: Path, image: str) -> None:
    """``ImageMismatch`` unless ``path`` (this host's) holds the bytes ``recorded``."""
    here = identity.identity(path)
    if here == recorded:
        return
    rel = path.relative_to(images_dir.resolve()).as_posix()
    what = f"image {image!r}" if image else f"the image of {rel}"
    if rel.startswith(("oci/", "oci-boot/")):
        fix = (
            "import it from the blob store (a host whose copy differs from the image's "
            "upload there replaces it by the uploaded bytes once nothing on it uses the "
            "image, at the latest when its daemon starts)"
        )
    else:
        fix = (
            "every host takes the bytes of the built-in image uploaded first to the blob "
            "store (a host whose copy differs replaces it once nothing on it uses the "
            "image, at the latest when its daemon starts; placement prefers hosts that "
            "hold the right bytes)"
        )
    raise ImageMismatch(
        f"{owner} was frozen over other bytes of {what} than this host holds: {rel} is "
        f"sha256 {identity.short(here)}... here and was {identity.short(recorded)}... on the "
        "host that saved it, so opening it here would corrupt its disk; it is not fetched "
        "and nothing here changed. Use the same image bytes on every host: "
        f"{fix}; or resume/open it on the host that saved it"
    )


def _rec(info: BlobInfo) -> dict[str, Any]:
    return {"size": info.size, "sha256": info.sha256}


def _expect(key: str, rec: dict[str, Any]) -> BlobInfo:
    return BlobInfo(key, int(rec["size"]), str(rec["sha256"]))


def _parse_index(
    path: Path, owner: str, prefix: str, url: str, *, memory: bool = True
) -> dict[str, Any]:
    try:
        index: dict[str, Any] = json.loads(path.read_text())
        if index.get("format") not in (INDEX_FORMAT, SPARSE_FORMAT) or index.get("owner") != owner:
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
        sparse = index.setdefault("sparse", {})
        if not isinstance(sparse, dict) or (sparse and index["format"] != SPARSE_FORMAT):
            raise ValueError(f"sparse {sparse!r}")
        for name, entry in sparse.items():
            SparseLayout.from_json(entry)
            blob = entry.get("blob")
            if (
                not FILE_NAME.match(name)
                or name in index["files"]
                or blob != name + SPARSE_BLOB
                or blob not in index["files"]
                or int(index["files"][blob]["size"]) != SparseLayout.from_json(entry).data_size
            ):
                raise ValueError(f"sparse file {name!r}: {blob!r}")
        required = {MANIFEST_FILE, STATE_FILE, DISK} if memory else {DISK}
        if not required <= set(index["files"]):
            raise ValueError(f"no {' or '.join(sorted(required))}")
        if index["base"] is not None:
            str(index["base"]), int(index["base_size"])
        sha = index.get("base_sha256")
        if sha is not None and not _SHA256.match(str(sha)):
            raise ValueError(f"base_sha256 {sha!r}")
        depends = index.setdefault("depends", {})  # none recorded: an older index
        if not isinstance(depends, dict) or not all(
            isinstance(k, str) and _SHA256.match(str(v)) for k, v in depends.items()
        ):
            raise ValueError(f"depends {depends!r}")
        return index
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise BlobError(
            f"blob {prefix}{INDEX} at {url} is not a valid index ({exc}); {owner} cannot be fetched"
        ) from exc


def _qemu_img(args: list[str]) -> None:
    done = subprocess.run(["qemu-img", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SnapshotError(f"qemu-img {' '.join(args)} failed: {done.stderr.strip()}")
