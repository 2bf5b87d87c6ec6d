"""HUTCH_BLOB_URL, HUTCH_S3_ENDPOINT, HUTCH_S3_CONNECT_TIMEOUT_S and
HUTCH_BLOB_CACHE_BYTES: what is accepted, what
is refused (with the accepted forms named), and which store each URL opens."""

from __future__ import annotations

from pathlib import Path

import pytest

from hutch.config import load_settings
from hutch.errors import BlobError, InvalidArgument
from hutch.storage.blobs import (
    LocalBlobStore,
    S3BlobStore,
    blob_store_from_settings,
    open_blob_store,
)


def test_defaults_keep_blobs_on_this_host(tmp_path: Path) -> None:
    s = load_settings({"HUTCH_STATE_DIR": str(tmp_path)})
    assert (s.blob_url, s.s3_endpoint, s.blob_cache_bytes) == (None, None, 0)
    assert s.s3_connect_timeout_s == 5.0
    assert s.blob_builtin_images  # with a store, built-in images converge by default
    store = open_blob_store(s.blob_url, state_dir=s.state_dir)
    assert isinstance(store, LocalBlobStore) and store.root == s.state_dir / "blobs"
    # The daemon's services: no store at all (nothing mirrored on the same disk).
    assert blob_store_from_settings(s) is None


def test_file_and_s3_urls_open_their_stores(tmp_path: Path) -> None:
    s = load_settings(
        {
            "HUTCH_STATE_DIR": str(tmp_path),
            "HUTCH_BLOB_URL": "s3://my-bucket/hutch/prod",
            "HUTCH_S3_ENDPOINT": "http://127.0.0.1:9000",
            "HUTCH_BLOB_CACHE_BYTES": str(10 << 30),
            "HUTCH_S3_CONNECT_TIMEOUT_S": "2.5",
            "HUTCH_BLOB_BUILTIN_IMAGES": "0",
        }
    )
    assert s.blob_cache_bytes == 10 << 30
    assert not s.blob_builtin_images
    store = open_blob_store(
        s.blob_url,
        state_dir=s.state_dir,
        s3_endpoint=s.s3_endpoint,
        connect_timeout_s=s.s3_connect_timeout_s,
    )
    assert isinstance(store, S3BlobStore)
    assert store.options.connect_timeout_s == 2.5
    assert (store.bucket, store.prefix) == ("my-bucket", "hutch/prod")
    assert store.journal_dir == s.state_dir / "blob-uploads"
    assert store.url == "s3://my-bucket/hutch/prod at http://127.0.0.1:9000"
    # The daemon's one store: the same, from the settings alone.
    shared = blob_store_from_settings(s)
    assert isinstance(shared, S3BlobStore) and shared.url == store.url
    assert shared.options == store.options and shared.journal_dir == store.journal_dir
    local = open_blob_store(f"file://{tmp_path}/shared", state_dir=s.state_dir)
    assert isinstance(local, LocalBlobStore) and local.root == tmp_path / "shared"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"HUTCH_BLOB_URL": "gs://bucket"}, "is not supported; accepted: unset"),
        ({"HUTCH_BLOB_URL": "file://relative/dir"}, "names an absolute path"),
        ({"HUTCH_BLOB_URL": "s3:///prefix-only"}, r"s3://bucket\[/prefix\]"),
        ({"HUTCH_BLOB_URL": "s3://bucket/p?endpoint=x"}, "HUTCH_S3_ENDPOINT"),
        ({"HUTCH_BLOB_URL": "s3://My_Bucket/p"}, "bucket name 'My_Bucket' is not valid"),
        ({"HUTCH_S3_ENDPOINT": "127.0.0.1:9000"}, "an http:// or https:// URL"),
        ({"HUTCH_BLOB_CACHE_BYTES": "-1"}, "0 \\(no limit\\) or more"),
        ({"HUTCH_BLOB_CACHE_BYTES": "lots"}, "is not a number"),
        ({"HUTCH_S3_CONNECT_TIMEOUT_S": "0"}, r"HUTCH_S3_CONNECT_TIMEOUT_S='0'.*0.5 to 300"),
        ({"HUTCH_S3_CONNECT_TIMEOUT_S": "soon"}, "HUTCH_S3_CONNECT_TIMEOUT_S='soon' is not valid"),
        ({"HUTCH_S3_CONNECT_TIMEOUT_S": "nan"}, "0.5 to 300 seconds"),
        ({"HUTCH_S3_CONNECT_TIMEOUT_S": "9999"}, "0.5 to 300 seconds"),
        ({"HUTCH_BLOB_BUILTIN_IMAGES": "maybe"}, "blob_builtin_images=.maybe.; accepted: 1/0"),
    ],
)
def test_bad_settings_name_what_is_accepted(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        load_settings({"HUTCH_STATE_DIR": str(tmp_path), **env})


def test_bad_bucket_name_is_refused_before_any_request(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="bucket name 'Bad_Bucket' is not valid; accepted"):
        open_blob_store("s3://Bad_Bucket/x", state_dir=tmp_path)
    with pytest.raises(BlobError, match="bucket name 'a' is not valid; accepted"):
        S3BlobStore("a", "", tmp_path)
