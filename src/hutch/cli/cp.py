"""``hutch cp``: copy a file (or with ``-r`` a directory) between this host and a
sandbox, streamed both ways."""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import click
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TransferSpeedColumn,
)

from hutch.cli._env import get_env, stderr_console
from hutch.cli.cp_dir import download_dir, upload_dir
from hutch.errors import InvalidArgument, NotFound
from hutch.sdk import Client

__all__ = ["RemotePath", "cp", "parse_location"]

#: Files at least this big get a progress bar (on a terminal).
PROGRESS_MIN_BYTES = 8 << 20
CHUNK = 1 << 20

# "ID:/path": an id or name, a colon, then the path. A local path containing ':' can be
# given as ./a:b (a leading '.' or '/' makes it local).
_REMOTE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_-]*):(.*)$")


@dataclass(frozen=True)
class RemotePath:
    sandbox_id: str
    path: str


def parse_location(text: str) -> RemotePath | str:
    match = _REMOTE.match(text)
    if match is None:
        return text
    if not match.group(2):
        raise click.BadParameter(f"{text!r}: give a path after the colon (ID:/path)")
    return RemotePath(match.group(1), match.group(2))


@contextlib.contextmanager
def _progress(label: str, total: int | None) -> Iterator[Progress | None]:
    console = stderr_console()
    if not console.is_terminal or total is None or total < PROGRESS_MIN_BYTES:
        yield None
        return
    columns = (TextColumn(label), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        yield progress


def _counted(
    chunks: Iterable[bytes], progress: Progress | None, total: int | None
) -> Iterator[bytes]:
    task = progress.add_task("", total=total) if progress is not None else None
    for chunk in chunks:
        yield chunk
        if progress is not None and task is not None:
            progress.advance(task, len(chunk))


def _read_chunks(stream: BinaryIO) -> Iterator[bytes]:
    while chunk := stream.read(CHUNK):
        yield chunk


def _upload(client: Client, src: str, dst: RemotePath) -> None:
    target = dst.path
    if src == "-":
        if target.endswith("/"):
            raise InvalidArgument(f"{dst.sandbox_id}:{target}: give a file name to copy stdin to")
        client.write_file(dst.sandbox_id, target, _read_chunks(sys.stdin.buffer))
        return
    local = Path(src)
    if local.is_dir():
        raise InvalidArgument(f"{src} is a directory; pass -r to copy a directory")
    if not local.exists():
        raise NotFound(f"{src}: no such file on this host")
    if target.endswith("/"):
        target = target + local.name
    else:
        # Like cp(1): copying onto an existing directory puts the file inside it.
        with contextlib.suppress(NotFound):
            if client.stat_file(dst.sandbox_id, target).is_dir:
                target = posixpath.join(target, local.name)
    stat = local.stat()
    with local.open("rb") as f, _progress(f"{local.name} →", stat.st_size) as progress:
        client.write_file(
            dst.sandbox_id,
            target,
            _counted(_read_chunks(f), progress, stat.st_size),
            mode=stat.st_mode & 0o777,
        )


def _download(client: Client, src: RemotePath, dst: str) -> None:
    entry = client.stat_file(src.sandbox_id, src.path)
    if entry.is_dir:
        raise InvalidArgument(
            f"{src.sandbox_id}:{src.path} is a directory; pass -r to copy a directory"
        )
    chunks = client.read_file_stream(src.sandbox_id, src.path)
    if dst == "-":
        out = sys.stdout.buffer
        with chunks:
            for chunk in chunks:
                out.write(chunk)
        out.flush()
        return
    target = Path(dst)
    if target.is_dir() or dst.endswith(os.sep):
        target = target / posixpath.basename(entry.path.rstrip("/"))
    # Write beside the target and rename at the end: an interrupted copy never leaves a
    # half-written file under the final name.
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with (
            os.fdopen(fd, "wb") as out,
            chunks,
            _progress(f"→ {target.name}", entry.size) as progress,
        ):
            for chunk in _counted(chunks, progress, entry.size):
                out.write(chunk)
        os.chmod(tmp_name, entry.mode & 0o777)
        os.replace(tmp_name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise


@click.command()
@click.option("-r", "--recursive", is_flag=True, help="Copy a whole directory (as tar).")
@click.argument("src")
@click.argument("dst")
def cp(src: str, dst: str, recursive: bool) -> None:
    """Copy a file: hutch cp LOCAL ID:/path, or hutch cp ID:/path LOCAL.

    `-` as LOCAL means stdin/stdout. Copying onto a directory keeps the file's name.
    With -r, copy a directory tree (into DST/NAME when DST is an existing directory).
    """
    source, dest = parse_location(src), parse_location(dst)
    client = get_env().client()
    if isinstance(source, str) and isinstance(dest, RemotePath):
        if recursive:
            upload_dir(client, source, dest.sandbox_id, dest.path)
            return
        _upload(client, source, dest)
    elif isinstance(source, RemotePath) and isinstance(dest, str):
        if not Path(dest).parent.exists() and dest != "-":
            raise NotFound(f"{Path(dest).parent}: no such directory on this host")
        if recursive:
            download_dir(client, source.sandbox_id, source.path, dest)
            return
        _download(client, source, dest)
    else:
        raise click.UsageError(
            "exactly one of SRC and DST must be in the sandbox, written ID:/path "
            "(for a local path containing ':', prefix it with ./)"
        )
