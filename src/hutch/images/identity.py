"""The content identity of an image's backing files: the sha256 of the bytes a sandbox
disk is a qcow2 overlay on (an image's ``rootfs.ext4``) or that a guest reads besides
it (an imported image's agent runtime disk, ``runtime.ext4``).

Why it is needed: images are built or imported on each host on its own and those builds
are not byte-reproducible (mmdebstrap, mkfs), so two hosts can hold different bytes
under the same image name or OCI digest. A frozen VM (a pause, a named snapshot, a
fork's parent) opened over other bytes than it was taken on reads a disk that is not
its own: silent corruption. The blob store's indexes record each backing file's
identity (``services/blob_dirs.py``) and a fetch compares it with this host's.

Kept beside the file so that it is hashed once, when the file is made (a build, an
import, a fetch: where the bytes pass anyway), never on the hot path of a create::

    <dir>/.<name>.sha256     {"size": n, "mtime_ns": t, "sha256": h}

A record whose size or mtime no longer match the file is stale and recomputed (and
rewritten) on the next :func:`identity`. A directory that cannot be written (a
read-only images directory) just gets no record: the hash is returned all the same.
Imported content also carries it in its ``image.json`` (``rootfs_sha256``), which
travels with it through the blob store.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

from hutch.images.cache import atomic_write_text

__all__ = ["compute", "identity", "known", "record", "record_path", "short"]

_CHUNK = 1 << 20


def record_path(path: Path) -> Path:
    """Where the identity of ``path`` is kept (a dot file beside it: never uploaded,
    never listed as content)."""
    return path.parent / f".{path.name}.sha256"


def compute(path: Path) -> str:
    """The sha256 (hex) of ``path``'s bytes, streamed 1 MiB at a time. ``OSError``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def known(path: Path) -> str | None:
    """The recorded identity of ``path`` if the record is still true of the file (the
    same size and mtime), else None. Never reads the file's bytes."""
    try:
        st = path.stat()
        data = json.loads(record_path(path).read_text())
        if int(data["size"]) == st.st_size and int(data["mtime_ns"]) == st.st_mtime_ns:
            sha = str(data["sha256"])
            if len(sha) == 64 and all(c in "0123456789abcdef" for c in sha):
                return sha
    except (OSError, ValueError, TypeError, KeyError):
        pass
    return None


def record(path: Path, sha256: str | None = None) -> str:
    """Record the identity of ``path`` beside it and return it: ``sha256`` when the
    caller knows it already (it just sent or fetched the bytes through a hash), else
    computed. A directory that cannot be written keeps no record. ``OSError`` only when
    ``path`` cannot be read."""
    st = path.stat()
    sha = sha256 if sha256 is not None else compute(path)
    doc = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
    with contextlib.suppress(OSError):
        atomic_write_text(record_path(path), json.dumps(doc) + "\n")
    return sha


def identity(path: Path) -> str:
    """The identity of ``path``: its record if still true, else computed once and
    recorded. ``OSError`` when ``path`` cannot be read."""
    found = known(path)
    return found if found is not None else record(path)


def short(sha256: str | None) -> str:
    """The prefix of an identity that messages show."""
    return (sha256 or "none")[:12]
