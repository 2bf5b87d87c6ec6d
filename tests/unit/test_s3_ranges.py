"""Ranged downloads (hutch.storage.blobs.s3_ranges) over an in-memory object: the file
is whole and verified, progress comes in order, at most parallel + 1 ranges are held,
and every wrong answer is refused with nothing left behind. The same path against a
real S3 server: tests/component/test_blob_store.py."""

from __future__ import annotations

import hashlib
import random
import threading
import time
from pathlib import Path

import pytest

from hutch.errors import BlobError
from hutch.storage.blobs import BlobInfo
from hutch.storage.blobs.s3_ranges import byte_ranges, content_range_total, ranged_get

KiB = 1 << 10


def _object(size: int) -> bytes:
    return random.Random(size).randbytes(size)


def _info(data: bytes) -> BlobInfo:
    return BlobInfo("k", len(data), hashlib.sha256(data).hexdigest())


def test_ranges_cover_the_object_exactly() -> None:
    assert byte_ranges(10, 4) == [(0, 3), (4, 7), (8, 9)]
    assert byte_ranges(8, 4) == [(0, 3), (4, 7)]
    assert byte_ranges(0, 4) == []
    with pytest.raises(ValueError, match="positive"):
        byte_ranges(10, 0)
    assert content_range_total("bytes 0-99/1000") == 1000
    assert content_range_total("bytes 0-99/*") is None
    assert content_range_total(None) is None


def test_a_ranged_download_is_whole_in_order_and_bounded(tmp_path: Path) -> None:
    data = _object(1000 * KiB + 7)
    held = 0
    most = 0
    lock = threading.Lock()
    jitter = random.Random(1)

    def fetch(first: int, last: int) -> tuple[bytes, int]:
        nonlocal held, most
        time.sleep(jitter.random() / 200)  # out-of-order completions
        with lock:
            held += 1
            most = max(most, held)
        return data[first : last + 1], len(data)

    seen: list[int] = []

    def progress(done: int) -> None:
        nonlocal held
        with lock:
            held -= 1
        seen.append(done)

    dest = tmp_path / "out"
    got = ranged_get(fetch, dest, key="k", where="mem", expect=_info(data), range_size=64 * KiB,
                     parallel=4, progress=progress)  # fmt: skip
    assert got == _info(data) and dest.read_bytes() == data
    assert seen == sorted(seen) and seen[-1] == len(data) and len(seen) == 16
    assert most <= 5  # parallel + 1 ranges fetched and not yet hashed
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize(
    ("wrong", "words"),
    [
        ("total", "is truncated: the server states 999 bytes, 307200 recorded"),
        ("short", "came back as"),
        ("corrupt", "is corrupt"),
        ("raises", "server away"),
    ],
)
def test_a_wrong_answer_is_refused_and_nothing_is_left(
    tmp_path: Path, wrong: str, words: str
) -> None:
    data = _object(300 * KiB)

    def fetch(first: int, last: int) -> tuple[bytes, int]:
        part = data[first : last + 1]
        if first == 128 * KiB:
            if wrong == "total":
                return part, 999
            if wrong == "short":
                return part[:-1], len(data)
            if wrong == "corrupt":
                return bytes(len(part)), len(data)
            raise BlobError("server away")
        return part, len(data)

    dest = tmp_path / "out"
    dest.write_bytes(b"before")
    with pytest.raises(BlobError, match=words):
        ranged_get(fetch, dest, key="k", where="mem", expect=_info(data), range_size=64 * KiB,
                   parallel=3)  # fmt: skip
    assert dest.read_bytes() == b"before"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
