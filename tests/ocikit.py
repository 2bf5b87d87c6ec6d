"""Test tooling for OCI images, written from the spec independently of hutch's reader:
layer tars from entry lists or directory trees, images written as an OCI layout, an
oci-archive or a docker-archive (as ``docker save`` writes it), pushed to a registry
over the distribution API, and a model of the tree the layers make (whiteouts, opaque
directories, hard links), to compare with what a guest sees.

Nothing here imports ``hutch.images.oci``: a bug there cannot hide in its own test.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import subprocess
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

MTIME = 1_700_000_000
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_MEDIA = {
    "none": "application/vnd.oci.image.layer.v1.tar",
    "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
    "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
}


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class E:
    """One layer entry. kind: file dir symlink hardlink whiteout opaque chr fifo."""

    path: str
    kind: str = "file"
    data: bytes = b""
    mode: int | None = None
    uid: int = 0
    gid: int = 0
    target: str = ""
    xattrs: dict[str, str] = field(default_factory=dict)


def layer_tar(entries: Iterable[E]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            name = e.path.strip("/")
            if e.kind == "whiteout":
                head, _, base = name.rpartition("/")
                name = f"{head}/.wh.{base}" if head else f".wh.{base}"
                e = E(name, "file", mode=0o644)
            elif e.kind == "opaque":
                name = f"{name}/.wh..wh..opq" if name else ".wh..wh..opq"
                e = E(name, "file", mode=0o644)
            ti = tarfile.TarInfo(name)
            ti.mtime = MTIME
            ti.uid, ti.gid = e.uid, e.gid
            ti.uname = ti.gname = ""
            default = 0o644
            if e.kind == "file":
                ti.type = tarfile.REGTYPE
                ti.size = len(e.data)
            elif e.kind == "dir":
                ti.type = tarfile.DIRTYPE
                default = 0o755
            elif e.kind == "symlink":
                ti.type = tarfile.SYMTYPE
                ti.linkname = e.target
                default = 0o777
            elif e.kind == "hardlink":
                ti.type = tarfile.LNKTYPE
                ti.linkname = e.target.strip("/")
            elif e.kind == "chr":
                ti.type = tarfile.CHRTYPE
                ti.devmajor, ti.devminor = 1, 3
                default = 0o666
            elif e.kind == "fifo":
                ti.type = tarfile.FIFOTYPE
            else:
                raise ValueError(e.kind)
            ti.mode = e.mode if e.mode is not None else default
            if e.xattrs:
                ti.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in e.xattrs.items()}
            tar.addfile(ti, io.BytesIO(e.data) if e.kind == "file" else None)
    return buf.getvalue()


def tree_tar(root: Path, out: Path) -> None:
    """A layer tar of the directory ``root`` (every type, owner, mode, xattr; hard
    links as links), written with GNU tar so that it is not hutch's own code."""
    subprocess.run(
        ["tar", "--create", "--file", str(out), "--format=pax", "--xattrs",
         "--xattrs-include=*", "--numeric-owner", "--sort=name", f"--mtime=@{MTIME}",
         "--directory", str(root), "."],
        check=True,
    )  # fmt: skip


def compress(data: bytes, how: str) -> bytes:
    if how == "none":
        return data
    if how == "gzip":
        return gzip.compress(data, compresslevel=1, mtime=0)
    if how == "zstd":
        return subprocess.run(["zstd", "-q", "-c", "-3"], input=data, capture_output=True,
                              check=True).stdout  # fmt: skip
    raise ValueError(how)


@dataclass
class Layer:
    tar: bytes  # uncompressed
    compression: str = "gzip"

    def __post_init__(self) -> None:
        self.blob = compress(self.tar, self.compression)
        self.digest = sha256(self.blob)
        self.diff_id = sha256(self.tar)
        self.media_type = LAYER_MEDIA[self.compression]


@dataclass
class Image:
    layers: list[Layer]
    env: list[str] = field(default_factory=lambda: ["PATH=/usr/local/bin:/usr/bin:/bin"])
    working_dir: str = ""
    user: str = ""
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    exposed_ports: list[str] = field(default_factory=list)
    architecture: str = "amd64"
    os: str = "linux"

    def config(self) -> bytes:
        cfg: dict[str, Any] = {"Env": self.env}
        if self.working_dir:
            cfg["WorkingDir"] = self.working_dir
        if self.user:
            cfg["User"] = self.user
        if self.entrypoint is not None:
            cfg["Entrypoint"] = self.entrypoint
        if self.cmd is not None:
            cfg["Cmd"] = self.cmd
        if self.exposed_ports:
            cfg["ExposedPorts"] = {p: {} for p in self.exposed_ports}
        doc = {
            "architecture": self.architecture,
            "os": self.os,
            "created": "2024-01-01T00:00:00Z",
            "config": cfg,
            "rootfs": {"type": "layers", "diff_ids": [lay.diff_id for lay in self.layers]},
            "history": [{"created_by": "ocikit"} for _ in self.layers],
        }
        return json.dumps(doc, sort_keys=True).encode()

    def manifest(self) -> bytes:
        config = self.config()
        doc = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": sha256(config), "size": len(config)},
            "layers": [
                {"mediaType": lay.media_type, "digest": lay.digest, "size": len(lay.blob)}
                for lay in self.layers
            ],
        }
        return json.dumps(doc, sort_keys=True).encode()

    @property
    def digest(self) -> str:
        return sha256(self.manifest())

    def blobs(self) -> dict[str, bytes]:
        out = {sha256(self.config()): self.config()}
        for lay in self.layers:
            out[lay.digest] = lay.blob
        return out


def index_of(entries: list[tuple[bytes, str, str]]) -> bytes:
    """An index over (manifest, os, architecture) entries."""
    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "manifests": [
                {"mediaType": OCI_MANIFEST, "digest": sha256(m), "size": len(m),
                 "platform": {"os": o, "architecture": a}}
                for m, o, a in entries
            ],
        }
    ).encode()  # fmt: skip


def write_layout(images: list[Image], out: Path, *, index: bytes | None = None) -> None:
    """An OCI image layout directory. ``index`` replaces the generated index.json."""
    (out / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (out / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    entries = []
    for img in images:
        for digest, data in {**img.blobs(), img.digest: img.manifest()}.items():
            (out / "blobs" / "sha256" / digest.split(":")[1]).write_bytes(data)
        entries.append((img.manifest(), img.os, img.architecture))
    doc = index if index is not None else index_of(entries)
    (out / "index.json").write_bytes(doc)


def _tar_dir(src: Path, out: Path) -> None:
    with tarfile.open(out, "w") as tar:
        for path in sorted(src.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(src)), recursive=False)


def write_oci_archive(img: Image, out: Path, work: Path) -> None:
    layout = work / "layout"
    write_layout([img], layout)
    _tar_dir(layout, out)


def write_docker_archive(img: Image, out: Path, tag: str = "test/image:latest") -> None:
    """``docker save`` (before Docker 25): <id>.json, <layer>/layer.tar, manifest.json,
    repositories; a layer repeated by the image is a symlink to the first copy."""
    config = img.config()
    config_name = sha256(config).split(":")[1] + ".json"
    with tarfile.open(out, "w") as tar:

        def add(name: str, data: bytes) -> None:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime, ti.mode = len(data), MTIME, 0o644
            tar.addfile(ti, io.BytesIO(data))

        add(config_name, config)
        names: list[str] = []
        first: dict[str, str] = {}
        for lay in img.layers:
            layer_id = hashlib.sha256(lay.diff_id.encode() + str(len(names)).encode()).hexdigest()
            name = f"{layer_id}/layer.tar"
            names.append(name)
            dti = tarfile.TarInfo(layer_id)
            dti.type, dti.mode, dti.mtime = tarfile.DIRTYPE, 0o755, MTIME
            tar.addfile(dti)
            add(f"{layer_id}/VERSION", b"1.0")
            if lay.diff_id in first:
                link = tarfile.TarInfo(name)
                link.type, link.linkname = tarfile.SYMTYPE, f"../{first[lay.diff_id]}"
                tar.addfile(link)
            else:
                first[lay.diff_id] = name
                add(name, lay.tar)
        repo, _, t = tag.rpartition(":")
        add(
            "manifest.json",
            json.dumps([{"Config": config_name, "RepoTags": [tag], "Layers": names}]).encode(),
        )
        add("repositories", json.dumps({repo: {t: names[-1].split("/")[0]}}).encode())


def push(
    img: Image,
    base_url: str,
    repo: str,
    tag: str,
    auth: tuple[str, str] | None = None,
    *,
    index: bytes | None = None,
) -> None:
    """Push blobs and the manifest (and optionally an index naming it, as ``tag``)."""
    with httpx.Client(base_url=base_url, auth=auth, timeout=120) as http:
        for digest, data in {**img.blobs()}.items():
            if http.head(f"/v2/{repo}/blobs/{digest}").status_code == 200:
                continue
            start = http.post(f"/v2/{repo}/blobs/uploads/")
            start.raise_for_status()
            location = start.headers["Location"]
            sep = "&" if "?" in location else "?"
            put = http.put(
                f"{location}{sep}digest={digest}",
                content=data,
                headers={"Content-Type": "application/octet-stream"},
            )
            put.raise_for_status()
        manifest_ref = tag if index is None else img.digest
        r = http.put(
            f"/v2/{repo}/manifests/{manifest_ref}",
            content=img.manifest(),
            headers={"Content-Type": OCI_MANIFEST},
        )
        r.raise_for_status()
        if index is not None:
            r = http.put(
                f"/v2/{repo}/manifests/{tag}", content=index, headers={"Content-Type": OCI_INDEX}
            )
            r.raise_for_status()  # fmt: skip


# -- the expected tree ----------------------------------------------------------------


@dataclass
class Node:
    kind: str  # regular directory symlink character block fifo
    mode: int
    uid: int
    gid: int
    content: str = ""  # sha256 hex of a file, target of a symlink
    inode: int = 0


def _abs(name: str) -> str:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    return "/" + "/".join(parts)


class TreeModel:
    """What the union of the layers looks like: a dict from absolute path to node."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {"/": Node("directory", 0o755, 0, 0)}
        self._next = 1

    def _resolve_parent(self, path: str, hops: int = 0) -> str:
        """``path`` with every symlink among its parents resolved (inside the root)."""
        parts = [p for p in path.split("/") if p]
        real: list[str] = []
        queue = parts[:-1]
        while queue:
            p = queue.pop(0)
            if p == "..":
                if real:
                    real.pop()
                continue
            if p in ("", "."):
                continue
            cand = "/" + "/".join([*real, p])
            node = self.nodes.get(cand)
            if node is not None and node.kind == "symlink":
                target = node.content
                if target.startswith("/"):
                    real = []
                queue = [x for x in target.split("/") if x] + queue
                continue
            if node is None:
                self.nodes[cand] = Node("directory", 0o755, 0, 0)
            real.append(p)
        return "/" + "/".join([*real, parts[-1]]) if parts else "/"

    def _drop(self, path: str) -> None:
        for key in [k for k in self.nodes if k == path or k.startswith(path + "/")]:
            del self.nodes[key]

    def apply(self, tar_bytes: bytes) -> None:
        written: set[str] = set()
        later: list[tuple[str, str]] = []
        with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:") as tar:
            for m in tar:
                name = _abs(m.name)
                base = name.rsplit("/", 1)[1]
                if base == ".wh..wh..opq":
                    later.append((self._resolve_parent(name).rsplit("/", 1)[0] or "/", ""))
                    continue
                if base.startswith(".wh."):
                    parent = self._resolve_parent(name).rsplit("/", 1)[0]
                    later.append((parent, base[4:]))
                    continue
                if name == "/":
                    self.nodes["/"].mode = m.mode & 0o7777
                    continue
                path = self._resolve_parent(name)
                old = self.nodes.get(path)
                if not (m.isdir() and old is not None and old.kind == "directory"):
                    self._drop(path)
                if m.islnk():
                    src = self._resolve_parent(_abs(m.linkname))
                    self.nodes[path] = self.nodes[src]
                    written.add(path)
                    continue
                kind = {tarfile.REGTYPE: "regular", tarfile.AREGTYPE: "regular",
                        tarfile.DIRTYPE: "directory", tarfile.SYMTYPE: "symlink",
                        tarfile.CHRTYPE: "character", tarfile.BLKTYPE: "block",
                        tarfile.FIFOTYPE: "fifo"}[m.type]  # fmt: skip
                content = ""
                if m.isreg():
                    f = tar.extractfile(m)
                    content = hashlib.sha256(f.read() if f else b"").hexdigest()
                elif m.issym():
                    content = m.linkname
                self.nodes[path] = Node(kind, m.mode & 0o7777, m.uid, m.gid, content, self._next)
                self._next += 1
                written.add(path)
        for parent, name in later:
            if name == "":
                for key in [k for k in self.nodes if k.startswith(parent.rstrip("/") + "/")]:
                    if key not in written and not any(w.startswith(key + "/") for w in written):
                        del self.nodes[key]
            else:
                path = parent.rstrip("/") + "/" + name
                if path not in written:
                    for key in [k for k in self.nodes if k == path or k.startswith(path + "/")]:
                        if key not in written and not any(w.startswith(key + "/") for w in written):
                            del self.nodes[key]

    def listing(self, exclude: Iterable[str] = ()) -> list[str]:
        """Lines ``path|kind|mode|uid|gid|content|links`` (links: hard link count of
        non-directories, "-" for directories)."""
        skip = set(exclude)
        counts: dict[int, int] = {}
        for node in self.nodes.values():
            if node.kind != "directory":
                counts[id(node)] = counts.get(id(node), 0) + 1
        out = []
        for path in sorted(self.nodes):
            if path in skip or any(path.startswith(s + "/") for s in skip):
                continue
            n = self.nodes[path]
            links = "-" if n.kind == "directory" else str(counts[id(n)])
            out.append(f"{path}|{n.kind}|{n.mode:o}|{n.uid}|{n.gid}|{n.content}|{links}")
        return sorted(out)


def parse_guest_listing(stat_txt: str, sums_txt: str, exclude: Iterable[str]) -> list[str]:
    skip = set(exclude)
    sums = {}
    for line in sums_txt.splitlines():
        digest, _, path = line.partition("  ")
        sums[path] = digest
    out = []
    for line in stat_txt.splitlines():
        path, ftype, mode, uid, gid, links, quoted = line.split("|", 6)
        if path in skip or any(path.startswith(s + "/") for s in skip):
            continue
        kind = {"regular": "regular", "directory": "directory", "symbolic": "symlink",
                "character": "character", "block": "block", "fifo": "fifo"}[
                    ftype.split()[0]]  # fmt: skip
        content = ""
        if kind == "regular":
            content = sums[path]
        elif kind == "symlink":
            target = quoted.split(" -> ", 1)[1]
            if len(target) >= 2 and target[0] == target[-1] == "'":
                target = target[1:-1]
            content = target
        n_links = "-" if kind == "directory" else links
        out.append(f"{path}|{kind}|{int(mode, 8):o}|{uid}|{gid}|{content}|{n_links}")
    return sorted(out)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def host_listing(root: Path, exclude: Iterable[str] = ()) -> list[str]:
    """TreeModel.listing's lines for a directory on this host (as if it were ``/``)."""
    skip = set(exclude)
    kinds = {stat.S_IFREG: "regular", stat.S_IFDIR: "directory", stat.S_IFLNK: "symlink",
             stat.S_IFCHR: "character", stat.S_IFBLK: "block", stat.S_IFIFO: "fifo"}  # fmt: skip
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames, *([""] if Path(dirpath) == root else [])]:
            full = Path(dirpath) / name if name else root
            rel = "/" + str(full.relative_to(root)) if full != root else "/"
            rel = rel.replace("/.", "/") if rel == "/." else rel
            if rel in skip or any(rel.startswith(s + "/") for s in skip):
                continue
            st = os.lstat(full)
            kind = kinds[stat.S_IFMT(st.st_mode)]
            content = ""
            if kind == "regular":
                content = hashlib.sha256(full.read_bytes()).hexdigest()
            elif kind == "symlink":
                content = os.readlink(full)
            links = "-" if kind == "directory" else str(st.st_nlink)
            out.append(f"{rel}|{kind}|{stat.S_IMODE(st.st_mode):o}|{st.st_uid}|{st.st_gid}|"
                       f"{content}|{links}")  # fmt: skip
    return sorted(out)
