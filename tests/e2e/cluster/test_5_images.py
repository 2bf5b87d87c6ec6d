"""Images in the blob store (``services/image_blobs.py``): an image imported through
one worker is uploaded by digest; a create pinned to a worker without its content
fetches it from SeaweedFS, verified (a corrupted blob, or one swapped with its index,
is refused against the uploader's record in the database and never booted),
and boots and execs; deleting the image removes its blobs."""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import shutil
from pathlib import Path

import pytest

from hutch import errors
from tests.e2e.cluster_lab import MEMORY_MIB, Worker, owners
from tests.e2e.conftest import wait_for
from tests.ocikit import E, Image, Layer, layer_tar, write_docker_archive
from tests.s3server import S3Server

pytestmark = [pytest.mark.e2e, pytest.mark.vm]


def _rootfs_key(w: Worker, s3: S3Server, rel: str) -> tuple[str, str]:
    """(bucket, full key) of the image's rootfs blob in the workers' bucket."""
    bucket, _, prefix = w.daemon_env["HUTCH_BLOB_URL"].removeprefix("s3://").partition("/")
    return bucket, f"{prefix}/images/{rel}/rootfs.ext4"


def test_an_image_imported_on_one_worker_boots_on_a_worker_without_its_content(
    cluster: list[Worker], s3_server: S3Server, tmp_path: Path
) -> None:
    w1 = cluster[0]
    tag = f"xhost-{secrets.token_hex(4)}"  # its own content: a digest no other test has
    busybox = Path(shutil.which("busybox") or "/bin/busybox").read_bytes()
    tools = [E("bin", "dir"), E("bin/busybox", data=busybox, mode=0o755)]
    tools += [E(f"bin/{a}", "symlink", target="busybox") for a in ("cat", "sh")]
    own = [E("etc", "dir"), E("etc/tag", data=tag.encode())]
    img = Image(layers=[Layer(layer_tar(tools)), Layer(layer_tar(own))], env=["PATH=/bin"])
    archive = tmp_path / "img.tar"
    write_docker_archive(img, archive, tag=f"e2e/{tag}:1")
    with w1.client(timeout=600.0) as c:
        info = c.import_image(tag, archive)
    digest = info.digest  # the manifest hutch made of the docker archive
    assert digest is not None and info.built
    local = w1.images_dir / "oci" / digest.replace(":", "-")
    try:
        _fetched_and_booted(cluster, s3_server, tag, digest, local)
    finally:
        # The workers share the suite's images directory: nothing of this test stays.
        with w1.client() as c, contextlib.suppress(errors.NotFound):
            c.delete_image(tag)
        shutil.rmtree(local, ignore_errors=True)
        local.with_name(local.name + ".lock").unlink(missing_ok=True)


def _fetched_and_booted(
    cluster: list[Worker], s3_server: S3Server, tag: str, digest: str, local: Path
) -> None:
    w1, w2, _w3 = cluster
    rel = "oci/" + digest.replace(":", "-")
    index = f"images/{rel}/index.json"
    assert wait_for(lambda: index in w1.blob_keys(s3_server, "images/"), 300)
    # w2 lacks the content: the workers of this cluster share one images directory, so
    # it goes from there (as on a host that never had it).
    shutil.rmtree(local)
    # A corrupted blob in the bucket is refused: nothing is booted, nothing is kept.
    client = s3_server.client()
    bucket, key = _rootfs_key(w1, s3_server, rel)
    good = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(bad))
    with w1.client(timeout=600.0) as c:
        with pytest.raises(errors.BlobError, match=rf"image '{tag}'.*rootfs\.ext4.*corrupt"):
            c.create_sandbox(image=tag, memory_mib=MEMORY_MIB, placement={"host": "w2"})
        assert not local.exists()
        assert not [s for s in c.list_sandboxes() if s.image == tag]
        # The same blob with an index that agrees with it (all a bucket writer can do):
        # refused against w1's record of its upload in the database, naming the file.
        index_key = key.removesuffix("rootfs.ext4") + "index.json"
        good_index = client.get_object(Bucket=bucket, Key=index_key)["Body"].read()
        forged = json.loads(good_index)
        forged["files"]["rootfs.ext4"]["sha256"] = hashlib.sha256(bad).hexdigest()
        client.put_object(Bucket=bucket, Key=index_key, Body=json.dumps(forged).encode())
        with pytest.raises(
            errors.BlobError, match=rf"image '{tag}'.*rootfs\.ext4.*the index says.*recorded"
        ):
            c.create_sandbox(image=tag, memory_mib=MEMORY_MIB, placement={"host": "w2"})
        assert not local.exists()
        # The blob and index as uploaded: the create fetches it, checks it and boots it.
        client.put_object(Bucket=bucket, Key=index_key, Body=good_index)
        client.put_object(Bucket=bucket, Key=key, Body=good)
        sb = c.create_sandbox(image=tag, memory_mib=MEMORY_MIB, placement={"host": "w2"})
        assert owners(cluster)[sb.id] == "w2"
        assert c.exec(sb.id, ["cat", "/etc/tag"]).stdout == tag
        assert c.read_file(sb.id, "/etc/tag") == tag.encode()
        assert f"image '{tag}' ({digest}) fetched from" in w2.log_path.read_text()
        assert (local / "rootfs.ext4").stat().st_mode & 0o222 == 0  # read-only
        c.delete_sandbox(sb.id)
        assert wait_for(lambda: sb.id not in owners(cluster), 20)
        # Deleting the image (no other names its content) removes its blobs and the
        # fetched copy.
        c.delete_image(tag)
    assert not any(k.startswith(f"images/{rel}/") for k in w1.blob_keys(s3_server, "images/"))
    assert not local.exists()
