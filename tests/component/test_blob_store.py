"""The blob store seam on both stores: a local directory and a real S3-compatible server
(SeaweedFS from tests/s3server.py), one contract suite; then what only S3 has: multipart
uploads resumed after the server restarts or the uploader crashes, orphaned uploads,
refused credentials."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hutch.errors import BlobError
from hutch.storage.blobs import BlobInfo, BlobStore, LocalBlobStore, S3BlobStore
from tests.s3server import BUCKET, S3Server, s3_server

__all__ = ["s3_server"]

MiB = 1 << 20


def _file(path: Path, size: int, seed: int = 0) -> Path:
    """A file of ``size`` pseudo-random bytes (written in chunks, never whole)."""
    with path.open("wb") as f:
        block = hashlib.sha256(str(seed).encode()).digest() * (MiB // 32)
        left = size
        n = 0
        while left > 0:
            chunk = bytes([n % 251]) + block[1 : min(len(block), left)]
            f.write(chunk)
            left -= len(chunk)
            n += 1
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlobStore]:
    if request.param == "local":
        yield LocalBlobStore(tmp_path / "blobs")
    else:
        server: S3Server = request.getfixturevalue("s3_server")
        yield server.blob_store(tmp_path / "journal", prefix=f"c-{tmp_path.name}")


# -- the contract, on both stores ----------------------------------------------------


def test_put_get_roundtrip_small_and_multipart(store: BlobStore, tmp_path: Path) -> None:
    store.check()
    for name, size in (("empty", 0), ("small", 1234), ("big", 12 * MiB + 17)):
        src = _file(tmp_path / name, size, seed=size)
        info = store.put(f"snapshots/x/{name}", src)
        assert info == BlobInfo(f"snapshots/x/{name}", size, _sha(src))
        stat = store.stat(f"snapshots/x/{name}")
        assert stat is not None and stat.size == size
        out = tmp_path / "out" / name
        assert store.get(f"snapshots/x/{name}", out, expect=info) == info
        assert _sha(out) == info.sha256
    keys = [b.key for b in store.list_prefix("snapshots/x/")]
    assert keys == ["snapshots/x/big", "snapshots/x/empty", "snapshots/x/small"]
    assert store.list_prefix("snapshots/y/") == []


def test_missing_blob_is_none_and_get_names_it(store: BlobStore, tmp_path: Path) -> None:
    assert store.stat("nope/a") is None
    with pytest.raises(BlobError, match="blob nope/a is missing"):
        store.get("nope/a", tmp_path / "o", expect=BlobInfo("nope/a", 1, "0" * 64))
    assert not (tmp_path / "o").exists()


def test_delete_is_idempotent(store: BlobStore, tmp_path: Path) -> None:
    src = _file(tmp_path / "f", 100)
    store.put("d/f", src)
    store.delete("d/f")
    store.delete("d/f")
    assert store.stat("d/f") is None
    assert store.list_prefix("d/") == []


def test_get_refuses_a_blob_that_differs_from_the_record(store: BlobStore, tmp_path: Path) -> None:
    """A wrong sha256 or size (what corruption or truncation in the store looks like)
    is refused and nothing is left at the destination."""
    src = _file(tmp_path / "f", 3 * MiB)
    info = store.put("k/f", src)
    dest = tmp_path / "dest"
    with pytest.raises(BlobError, match=r"blob k/f .* is corrupt"):
        store.get("k/f", dest, expect=BlobInfo("k/f", info.size, "f" * 64))
    with pytest.raises(BlobError, match=r"blob k/f .* is too long"):
        store.get("k/f", dest, expect=BlobInfo("k/f", info.size - 1, info.sha256))
    with pytest.raises(BlobError, match=r"blob k/f .* is truncated"):
        store.get("k/f", dest, expect=BlobInfo("k/f", info.size + 1, info.sha256))
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".dest")] == []


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", ".hidden", "a/./b", "sp ace"])
def test_bad_keys_are_refused(store: BlobStore, tmp_path: Path, key: str) -> None:
    with pytest.raises(BlobError, match="is not valid; accepted"):
        store.stat(key)


# -- corruption in the bucket itself --------------------------------------------------


def test_object_corrupted_in_the_bucket_is_never_restored(
    s3_server: S3Server, tmp_path: Path
) -> None:
    store = s3_server.blob_store(tmp_path / "j", prefix="corrupt")
    src = _file(tmp_path / "f", 11 * MiB)
    info = store.put("snap/state.mig", src)
    client = s3_server.client()
    # Same length, one byte flipped; then a truncated copy: both written behind hutch's back.
    data = bytearray(src.read_bytes())
    data[5 * MiB + 3] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key="corrupt/snap/state.mig", Body=bytes(data))
    dest = tmp_path / "restored"
    with pytest.raises(BlobError, match=r"blob snap/state.mig .* is corrupt"):
        store.get("snap/state.mig", dest, expect=info)
    client.put_object(Bucket=BUCKET, Key="corrupt/snap/state.mig", Body=bytes(data[: 4 * MiB]))
    with pytest.raises(BlobError, match=r"blob snap/state.mig .* is truncated"):
        store.get("snap/state.mig", dest, expect=info)
    assert not dest.exists()


# -- resumable multipart uploads -----------------------------------------------------


def test_upload_survives_a_server_restart_mid_upload(s3_server: S3Server, tmp_path: Path) -> None:
    """The server goes away after the second part (SIGKILL, as a crash) and comes back:
    the same put call goes on, the parts already stored are not sent again, and the
    object is whole."""
    store = s3_server.blob_store(tmp_path / "j", prefix="restart", retry_s=90)
    src = _file(tmp_path / "f", 26 * MiB, seed=7)
    sent: list[int] = []
    restarted: list[bool] = []

    def progress(done: int) -> None:
        sent.append(done)
        if len(sent) == 2 and not restarted:
            restarted.append(True)
            s3_server.kill()
            s3_server.start()

    uploads: list[int] = []
    real = store._client.upload_part

    def counting(**kw: object) -> object:
        uploads.append(int(kw["PartNumber"]))  # type: ignore[call-overload]
        return real(**kw)

    store._client.upload_part = counting
    info = store.put("big/state.mig", src, progress=progress)
    assert restarted
    assert info.sha256 == _sha(src) and info.size == src.stat().st_size
    assert sorted(set(uploads)) == [1, 2, 3, 4, 5, 6]
    out = tmp_path / "out"
    store.get("big/state.mig", out, expect=info)
    assert _sha(out) == info.sha256
    assert store.pending_uploads() == []


def test_a_large_download_goes_in_ranges_and_survives_a_server_restart(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """A blob larger than a range comes down in ranged GETs side by side; the server
    SIGKILLed after the second range and started again: the same get goes on and the
    file is whole and verified."""
    store = s3_server.blob_store(tmp_path / "j", prefix="ranges", range_size=4 * MiB, retry_s=90)
    src = _file(tmp_path / "f", 30 * MiB + 5, seed=11)
    info = store.put("big/memory", src)
    ranges: list[str] = []
    lock = threading.Lock()
    real = store._client.get_object
    # The first GET waits for a second one to start: only ranges side by side let it go
    # on (one at a time, it waits out the 30 s and says so).
    second = threading.Event()
    side_by_side: list[bool] = []

    def counting(**kw: object) -> object:
        with lock:
            ranges.append(str(kw.get("Range")))
            first = len(ranges) == 1
        if first:
            side_by_side.append(second.wait(30))
        else:
            second.set()
        return real(**kw)

    store._client.get_object = counting
    got: list[int] = []

    def progress(done: int) -> None:
        got.append(done)
        if len(got) == 2:
            s3_server.kill()
            s3_server.start()

    out = tmp_path / "out"
    assert store.get("big/memory", out, expect=info, progress=progress) == info
    assert _sha(out) == info.sha256 and got[-1] == info.size
    assert "bytes=0-4194303" in ranges and f"bytes=29360128-{info.size - 1}" in ranges
    assert len(set(ranges)) == 8 and side_by_side == [True]  # eight ranges, side by side
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "j", "out"]


def test_a_large_blob_replaced_in_the_bucket_is_refused(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """Someone with write access to the bucket puts other bytes under a recorded key:
    shorter, longer or as long; none is ever written to the destination."""
    store = s3_server.blob_store(tmp_path / "j", prefix="swap", range_size=4 * MiB)
    src = _file(tmp_path / "f", 12 * MiB, seed=3)
    info = store.put("snap/memory", src)
    client = s3_server.client()
    dest = tmp_path / "out"
    for size, words in (
        (9 * MiB, "is truncated: the server states 9437184 bytes, 12582912 recorded"),
        (13 * MiB, "is too long"),
        (12 * MiB, "is corrupt"),
    ):
        other = _file(tmp_path / "other", size, seed=size)
        client.put_object(Bucket=BUCKET, Key="swap/snap/memory", Body=other.read_bytes())
        with pytest.raises(BlobError, match=words):
            store.get("snap/memory", dest, expect=info)
        assert not dest.exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "j", "other"]


class _Crash(Exception):
    pass


def test_upload_cut_by_a_crash_continues_from_its_journal(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """The uploading process dies once part 3 of 5 is journaled (the parts sent side
    by side beside it may have reached the server too): a new store (a restarted
    daemon) finds the journal, lists the parts the server holds and sends only the
    others."""
    journal = tmp_path / "j"
    src = _file(tmp_path / "f", 24 * MiB + 5, seed=3)
    first = s3_server.blob_store(journal, prefix="crash")

    def crash(done: int) -> None:
        if done >= 15 * MiB:
            raise _Crash

    with pytest.raises(_Crash):
        first.put("snap/disk.qcow2", src, progress=crash)
    [pending] = first.pending_uploads()
    assert sorted(pending.parts) == [1, 2, 3]
    assert first.stat("snap/disk.qcow2") is None  # nothing visible under the key yet
    on_server = set(first._list_parts(first._key("snap/disk.qcow2"), pending.upload_id, "t"))
    assert {1, 2, 3} <= on_server

    second = s3_server.blob_store(journal, prefix="crash")
    uploads: list[int] = []
    real = second._client.upload_part

    def counting(**kw: object) -> object:
        uploads.append(int(kw["PartNumber"]))  # type: ignore[call-overload]
        return real(**kw)

    second._client.upload_part = counting
    info = second.put("snap/disk.qcow2", src)
    assert sorted(uploads) == sorted({1, 2, 3, 4, 5} - on_server)
    assert info.sha256 == _sha(src)
    out = tmp_path / "out"
    second.get("snap/disk.qcow2", out, expect=info)
    assert _sha(out) == _sha(src)
    assert second.pending_uploads() == []


def test_the_parts_of_an_upload_go_up_side_by_side(s3_server: S3Server, tmp_path: Path) -> None:
    """Two parts are on the wire at once (each waits here until the other has begun),
    and the object is whole and in order."""
    src = _file(tmp_path / "f", 24 * MiB + 5, seed=7)
    store = s3_server.blob_store(tmp_path / "j", prefix="parallel")
    both = threading.Barrier(2, timeout=20)
    real = store._client.upload_part

    def meeting(**kw: object) -> object:
        if int(kw["PartNumber"]) in (1, 2):  # type: ignore[call-overload]
            both.wait()  # BrokenBarrierError if the parts went one after the other
        return real(**kw)

    store._client.upload_part = meeting
    info = store.put("snap/disk.qcow2", src)
    assert info.sha256 == _sha(src)
    out = tmp_path / "out"
    store.get("snap/disk.qcow2", out, expect=info)
    assert _sha(out) == _sha(src)


def test_a_changed_file_starts_its_upload_again(s3_server: S3Server, tmp_path: Path) -> None:
    journal = tmp_path / "j"
    src = _file(tmp_path / "f", 12 * MiB, seed=1)
    store = s3_server.blob_store(journal, prefix="changed")

    def crash(done: int) -> None:
        raise _Crash

    with pytest.raises(_Crash):
        store.put("k", src, progress=crash)
    _file(src, 12 * MiB, seed=2)  # rewritten: the stored parts are not its bytes
    os.utime(src, ns=(1, 1))
    info = store.put("k", src)
    out = tmp_path / "out"
    store.get("k", out, expect=info)
    assert _sha(out) == _sha(src)
    uploads = s3_server.client().list_multipart_uploads(Bucket=BUCKET, Prefix="changed/")
    assert uploads.get("Uploads", []) == []  # the stale upload was aborted


def test_orphaned_uploads_are_aborted(s3_server: S3Server, tmp_path: Path) -> None:
    """An upload whose file is gone is aborted with its journal; one begun elsewhere is
    aborted only once older than the age given (another host may be uploading it)."""
    journal = tmp_path / "j"
    src = _file(tmp_path / "f", 11 * MiB)
    store = s3_server.blob_store(journal, prefix="orphans")

    def crash(done: int) -> None:
        raise _Crash

    with pytest.raises(_Crash):
        store.put("mine", src, progress=crash)
    client = s3_server.client()
    client.create_multipart_upload(Bucket=BUCKET, Key="orphans/elsewhere")
    src.unlink()
    assert store.abort_uploads(older_than_s=3600) == ["orphans/mine"]
    assert store.pending_uploads() == []
    left = client.list_multipart_uploads(Bucket=BUCKET, Prefix="orphans/").get("Uploads", [])
    assert [u["Key"] for u in left] == ["orphans/elsewhere"]
    assert store.abort_uploads(older_than_s=0) == ["orphans/elsewhere"]
    left = client.list_multipart_uploads(Bucket=BUCKET, Prefix="orphans/").get("Uploads", [])
    assert left == []


# -- bad configuration: clear errors --------------------------------------------------


def test_refused_credentials_name_what_to_set(s3_server: S3Server, tmp_path: Path) -> None:
    store = s3_server.blob_store(tmp_path / "j", secret_key="wrong-secret")
    with pytest.raises(BlobError, match=r"refused the credentials.*AWS_SECRET_ACCESS_KEY"):
        store.check()
    with pytest.raises(BlobError, match="refused the credentials"):
        store.put("k", _file(tmp_path / "f", 10))


def test_missing_bucket_and_unreachable_endpoint(s3_server: S3Server, tmp_path: Path) -> None:
    missing = S3BlobStore(
        "no-such-bucket-here", "", tmp_path / "j", s3_server.blob_store(tmp_path).options
    )
    with pytest.raises(BlobError, match="no-such-bucket-here"):
        missing.check()
    from dataclasses import replace

    gone = S3BlobStore(
        BUCKET,
        "",
        tmp_path / "j",
        replace(s3_server.blob_store(tmp_path).options, endpoint="http://127.0.0.1:9", retry_s=0),
    )
    with pytest.raises(BlobError, match=r"cannot reach .*HUTCH_S3_ENDPOINT"):
        gone.check()


def test_a_local_store_whose_root_is_a_file_is_a_blob_error_naming_it(tmp_path: Path) -> None:
    """Every call of the local backend, not a raw ``NotADirectoryError``; and a store
    (and what it holds) next to it is unchanged."""
    root = tmp_path / "not-a-dir"
    root.write_bytes(b"a file, where HUTCH_BLOB_URL points")
    store = LocalBlobStore(root)
    src = _file(tmp_path / "src", 10)
    named = f"{root} is not a directory"
    calls: list[Callable[[], object]] = [
        store.check,
        lambda: store.stat("images/oci/x/index.json"),
        lambda: store.put("a/b", src),
        lambda: store.get("a/b", tmp_path / "out", expect=BlobInfo("a/b", 10)),
        lambda: store.delete("a/b"),
        lambda: store.list_prefix("images/"),
        lambda: store.abort_uploads(0),
    ]
    for call in calls:
        with pytest.raises(BlobError, match=named):
            call()
    assert root.read_bytes() == b"a file, where HUTCH_BLOB_URL points"
    assert not (tmp_path / "out").exists()


def test_a_local_key_under_a_blob_is_no_such_blob(tmp_path: Path) -> None:
    """``a`` is a blob, so ``a/b`` cannot be one (a directory cannot be there): stat
    says none and delete has nothing to do, as S3 would answer for a missing key."""
    store = LocalBlobStore(tmp_path / "blobs")
    store.put("a", _file(tmp_path / "src", 5))
    assert store.stat("a/b") is None
    store.delete("a/b")
    assert store.stat("a") == BlobInfo("a", 5)


def test_an_unreadable_local_blob_is_a_blob_error(tmp_path: Path) -> None:
    """A permission refusal (as root: a directory where the blob is) names the blob."""
    store = LocalBlobStore(tmp_path / "blobs")
    (tmp_path / "blobs" / "d").mkdir(parents=True)
    with pytest.raises(BlobError, match=r"reading blob d at file://.* failed: .*directory"):
        store.get("d", tmp_path / "out", expect=BlobInfo("d", 1))
    with pytest.raises(BlobError, match=r"deleting blob d at file://.* failed"):
        store.delete("d")
