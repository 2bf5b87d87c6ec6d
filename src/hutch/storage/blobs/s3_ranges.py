"""Downloads of large S3 objects in byte ranges side by side (``S3BlobStore.get``).

One GET is one TCP stream, and one stream is what a single download could use: a
memory pause or an image of gigabytes then waits on one connection's window while the
server and the link could serve several. boto3's transfer manager and s5cmd fetch
large objects in concurrent ranged GETs; so does this, keeping what ``get`` promises
(verified before it is renamed in, nothing left behind on failure):

```
  expect.size <= range_size ─► one GET, streamed (verified_write), as before
  else ─► temp file beside dest, its size set at once (ftruncate)
       ─► ranges [a, a + range_size) ─► up to `parallel` GETs in flight (threads), each
          `Range: bytes=a-b`; its Content-Range total must be the recorded size (else
          the stored object is not the one recorded: refused, naming the sizes) and its
          body exactly b - a + 1 bytes; written at its offset (pwrite); a range whose
          stream breaks off is fetched again alone (for up to retry_s)
       ─► the caller's thread hashes the ranges in order as they complete (at most
          parallel + 1 ranges held in memory) and reports progress in order
       ─► sha256 as recorded? ─► fsync ─► rename to dest; any failure: temp removed,
          a BlobError naming the key
```
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from hutch.errors import BlobError
from hutch.storage.blobs.base import BlobInfo, Progress, check_digest, part_path

__all__ = ["DEFAULT_RANGE_SIZE", "FetchRange", "byte_ranges", "content_range_total", "ranged_get"]

#: Bytes per ranged GET (each held in memory while in flight or waiting to be hashed).
DEFAULT_RANGE_SIZE = 8 << 20

#: ``fetch(first, last)``: the bytes ``first..last`` (inclusive) of the object and the
#: object's whole size as the server's Content-Range states it.
FetchRange = Callable[[int, int], tuple[bytes, int | None]]


def byte_ranges(size: int, range_size: int) -> list[tuple[int, int]]:
    """``(first, last)`` inclusive ranges covering ``size`` bytes, ``range_size`` each
    (the last one shorter)."""
    if range_size <= 0:
        raise ValueError(f"range size {range_size} must be positive")
    return [(a, min(a + range_size, size) - 1) for a in range(0, size, range_size)]


def content_range_total(header: str | None) -> int | None:
    """The whole size in a ``Content-Range: bytes a-b/TOTAL`` answer; None when absent
    or unknown (``*``)."""
    if not header:
        return None
    _, _, total = header.rpartition("/")
    return int(total) if total.strip().isdigit() else None


def ranged_get(
    fetch: FetchRange,
    dest: Path,
    *,
    key: str,
    where: str,
    expect: BlobInfo,
    range_size: int,
    parallel: int,
    progress: Progress | None = None,
) -> BlobInfo:
    """Write the ``expect.size`` bytes ``fetch`` returns to ``dest``, ``parallel``
    ranges at a time (see the module docstring). Raises ``BlobError`` naming ``key``
    (a size or sha256 other than ``expect``'s, a range the server answered wrongly,
    whatever ``fetch`` raised); ``dest`` is then untouched and no temp file is left."""
    size = expect.size
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = part_path(dest)
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as f:
            fd = f.fileno()
            os.ftruncate(fd, size)

            def one(first: int, last: int) -> bytes:
                data, total = fetch(first, last)
                if total != size:
                    if total is None:
                        why = "not the one recorded: the server states no size"
                    else:
                        why = f"{'truncated' if total < size else 'too long'}: the server "
                        why += f"states {total} bytes"
                    raise BlobError(
                        f"blob {key} at {where} is {why}, {size} recorded; it is not used"
                    )
                if len(data) != last - first + 1:
                    raise BlobError(
                        f"blob {key} at {where}: bytes {first}-{last} came back as "
                        f"{len(data)} bytes; it is not used"
                    )
                os.pwrite(fd, data, first)
                return data

            done = 0
            ranges = iter(byte_ranges(size, range_size))
            with ThreadPoolExecutor(max(1, parallel), thread_name_prefix="hutch-s3-get") as pool:
                pending: deque[Future[bytes]] = deque()
                try:
                    for first, last in ranges:
                        pending.append(pool.submit(one, first, last))
                        if len(pending) > parallel:
                            break
                    while pending:
                        data = pending.popleft().result()
                        digest.update(data)
                        done += len(data)
                        if progress is not None:
                            progress(done)
                        following = next(ranges, None)
                        if following is not None:
                            pending.append(pool.submit(one, *following))
                except BaseException:
                    for future in pending:
                        future.cancel()
                    raise
            f.flush()
            os.fsync(fd)
        got = digest.hexdigest()
        check_digest(got, key=key, where=where, expect=expect)
        os.rename(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return BlobInfo(key, size, got)
