"""Decompressing layer streams: gzip (stdlib), zstd (the ``zstd`` tool through pipes:
Python 3.11 has no zstd module) or none, told apart by their leading bytes."""

from __future__ import annotations

import contextlib
import gzip
import shutil
import subprocess
import threading
from collections.abc import Iterator
from typing import IO, cast

from hutch.errors import ImageBuildError, InvalidImage
from hutch.images.oci.digest import Readable

__all__ = ["decompressed", "sniff"]

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_CHUNK = 1 << 20


class _Peeked:
    """``raw`` with its first bytes already read into ``head``."""

    def __init__(self, raw: Readable, head: bytes) -> None:
        self.raw = raw
        self.head = head

    def read(self, n: int = -1) -> bytes:
        if self.head:
            if n < 0:
                data, self.head = self.head + self.raw.read(), b""
                return data
            data, self.head = self.head[:n], self.head[n:]
            if len(data) < n:
                data += self.raw.read(n - len(data))
            return data
        return self.raw.read(n)

    def readable(self) -> bool:
        return True


def sniff(head: bytes) -> str:
    if head.startswith(GZIP_MAGIC):
        return "gzip"
    if head.startswith(ZSTD_MAGIC):
        return "zstd"
    return "none"


def _read_head(raw: Readable) -> bytes:
    head = b""
    while len(head) < 4:
        chunk = raw.read(4 - len(head))
        if not chunk:
            break
        head += chunk
    return head


@contextlib.contextmanager
def decompressed(raw: Readable, what: str) -> Iterator[Readable]:
    """The uncompressed bytes of ``raw``. Errors raised while reading ``raw`` (a digest
    check at its end, say) come out of the ``with`` block even when a helper thread hit
    them; bad compressed data raises ``InvalidImage`` naming ``what``."""
    head = _read_head(raw)
    src = _Peeked(raw, head)
    kind = sniff(head)
    if kind == "none":
        yield src
        return
    if kind == "gzip":
        try:
            with gzip.GzipFile(fileobj=cast(IO[bytes], src), mode="rb") as gz:
                yield gz
        except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
            raise InvalidImage(f"{what} is not valid gzip data (truncated?): {exc}") from exc
        return
    with _zstd(src, what) as out:
        yield out


@contextlib.contextmanager
def _zstd(src: _Peeked, what: str) -> Iterator[IO[bytes]]:
    tool = shutil.which("zstd")
    if tool is None:
        raise ImageBuildError(f"{what} is zstd-compressed; install zstd (apt-get install zstd)")
    proc = subprocess.Popen(
        [tool, "-d", "-c", "-q"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    failure: list[BaseException] = []

    def feed() -> None:
        assert proc.stdin is not None
        try:
            while chunk := src.read(_CHUNK):
                proc.stdin.write(chunk)
        except BrokenPipeError:
            pass  # zstd stopped reading: its exit status tells why
        except BaseException as exc:
            failure.append(exc)
        finally:
            with contextlib.suppress(OSError):
                proc.stdin.close()

    feeder = threading.Thread(target=feed, name="zstd-feed", daemon=True)
    feeder.start()
    ok = False
    try:
        yield proc.stdout
        ok = True
    finally:
        exited_alone = proc.poll() is not None
        if not ok and not exited_alone:
            proc.kill()
        with contextlib.suppress(OSError, ValueError):
            while proc.stdout.read(_CHUNK):
                pass
        feeder.join()
        stderr = proc.stderr.read().decode(errors="replace").strip()
        code = proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        # The most telling error wins: what the source said (a digest mismatch), then
        # zstd's own complaint, then (not raised here) what the tar reader saw.
        if failure:
            raise failure[0]
        if code != 0 and (ok or exited_alone):
            raise InvalidImage(f"{what} is not valid zstd data (truncated?): {stderr[-300:]}")
