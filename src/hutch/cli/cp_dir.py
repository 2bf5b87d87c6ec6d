"""``hutch cp -r``: whole directories, as one tar stream each way (see ``cp.py``)."""

from __future__ import annotations

import contextlib
import posixpath
from pathlib import Path

import click

from hutch.cli._env import spinner
from hutch.errors import InvalidArgument, NotFound
from hutch.sdk import Client, Files

__all__ = ["download_dir", "upload_dir"]


def upload_dir(client: Client, src: str, sandbox_id: str, path: str) -> None:
    """Like ``cp -r SRC DST``: into DST/basename(SRC) when DST is an existing directory,
    else DST becomes the copy."""
    local = Path(src)
    if not local.is_dir():
        if not local.exists():
            raise NotFound(f"{src}: no such directory on this host")
        raise InvalidArgument(f"{src} is not a directory; drop -r to copy a file")
    target = path
    with contextlib.suppress(NotFound):
        if client.stat_file(sandbox_id, path).is_dir:
            target = posixpath.join(path, local.resolve().name)
    with spinner(f"copying {src} → {sandbox_id}:{target}"):
        done = Files(client, sandbox_id).upload_dir(local, target)
    click.echo(f"{done.entries} entries ({done.bytes} bytes) → {sandbox_id}:{done.path}", err=True)


def download_dir(client: Client, sandbox_id: str, path: str, dst: str) -> None:
    entry = client.stat_file(sandbox_id, path)
    if not entry.is_dir:
        raise InvalidArgument(f"{sandbox_id}:{path} is not a directory; drop -r to copy a file")
    target = Path(dst)
    if target.is_dir():
        target = target / (posixpath.basename(entry.path.rstrip("/")) or "root")
    elif target.exists():
        raise InvalidArgument(f"{dst} exists and is not a directory")
    with spinner(f"copying {sandbox_id}:{entry.path} → {target}"):
        done = Files(client, sandbox_id).download_dir(entry.path, target)
    click.echo(f"{done.entries} entries ({done.bytes} bytes) → {target}", err=True)
