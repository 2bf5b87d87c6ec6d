"""``template_blobs``: a host that lacks the template of an (image, shape) fetches it from
the blob store (``services/template_blobs.py``) instead of building it by a cold boot;
both ways of getting it, in one run.

Two hosts in this process (state directories ``a<i>`` and ``b<i>`` under the run's work
directory, the run's pinned images, one SQLite file as their database, SeaweedFS from
``tests/s3server.py`` on loopback as the bucket), the real ``QemuBackend`` of each. Each
round:

* build: host a's ``QemuTemplates.build`` (cold boot, settle, freeze with RAM in
  ``memory.ram``, seal): what every new host paid per (image, shape) before;
* upload (untimed for the ratio, reported): ``TemplateBlobs.upload`` from a;
* fetch: host b's ``TemplateBlobs.fetch`` (the record read, the index checked against
  it, every blob downloaded and verified, ``memory.ram`` recreated from its non-zero
  extents, the stream, key, QEMU build and VM config checked, vm.json rehomed, the
  memory re-sealed, renamed into place): what a new host pays now;
* the same template's directory sent whole (``upload_dir`` without ``sparse``: every
  byte of ``memory.ram``, holes read as zeros) and fetched back with ``fetch_dir`` into a
  scratch directory, against the sparse fetch's ``fetch_dir``: what leaving the holes
  and zero pages behind saves.

The bucket's blobs and record are removed between rounds, so each round uploads again.
"""

from __future__ import annotations

import asyncio
import shutil

from tests.s3server import S3Server

from bench.cases.common import SANDBOX_MEMORY_MIB, SANDBOX_VCPUS, BenchContext, now
from bench.model import BenchResult, Metric, SampleSet
from hutch.config import Settings
from hutch.images.build import find_image
from hutch.models import Shape
from hutch.runtime.qemu.backend import QemuBackend
from hutch.services.blob_dirs import fetch_dir, upload_dir
from hutch.services.template_blobs import TemplateBlobs, template_prefix
from hutch.storage.blobs import BlobStore
from hutch.store import Store
from hutch.store.image_uploads import ImageUploadStore
from hutch.vm.snapshot_manifest import MEMORY_FILE

__all__ = ["run_template_blobs"]

MIB = 1 << 20


def _empty(store: BlobStore, records: ImageUploadStore, prefix: str) -> None:
    for blob in store.list_prefix(prefix):
        store.delete(blob.key)
    records.delete(prefix)


def run_template_blobs(ctx: BenchContext) -> BenchResult:
    rounds = 1 if ctx.quick else 3
    shape = Shape(vcpus=SANDBOX_VCPUS, memory_mib=SANDBOX_MEMORY_MIB)
    result = BenchResult(
        "template_blobs",
        "template: fetch from S3 (SeaweedFS on loopback) vs build by a cold boot",
        ctx.quick,
        {"rounds": rounds, **ctx.sandbox_params(), "disk_gib": shape.disk_gib},
    )
    root = ctx.work_dir / "tplblobs"
    root.mkdir(parents=True, exist_ok=True)
    image = find_image(ctx.image, ctx.daemon.images_dir)
    if image is None:
        raise RuntimeError(f"image {ctx.image} is not in {ctx.daemon.images_dir}")
    server = S3Server(root / "s3")
    server.start()
    store = server.blob_store(root / "journal", prefix="bench-tpl", part_size=16 * MIB)
    records = ImageUploadStore(Store(root / "hutch.db"))
    build: list[float] = []
    fetch: list[float] = []
    upload: list[float] = []
    sparse_fetch: list[float] = []
    whole_fetch: list[float] = []
    sent_bytes: list[float] = []
    file_bytes: list[float] = []

    def host(name: str) -> QemuBackend:
        settings = Settings(
            state_dir=root / name,
            images_dir_override=ctx.daemon.images_dir,
            accel=ctx.daemon.accel or "auto",
        )
        return QemuBackend(settings)

    try:
        for i in range(rounds):
            a, b = host(f"a{i}"), host(f"b{i}")
            try:
                blobs_a = TemplateBlobs(a.templates, store, records, a.settings)
                blobs_b = TemplateBlobs(b.templates, store, records, b.settings)
                t0 = now()
                made = asyncio.run(a.templates.build(image, shape))
                build.append(now() - t0)
                info = a.templates.describe(image, shape)
                assert info.content is not None
                prefix = template_prefix(info.content, info.key)
                t0 = now()
                sent = blobs_a.upload(info)
                upload.append(now() - t0)
                t0 = now()
                got = asyncio.run(blobs_b.fetch(image, shape))
                fetch.append(now() - t0)
                if got is None or b.templates.find(image, shape) != got:
                    raise RuntimeError("host b did not fetch the template (see the log)")
                if (got / MEMORY_FILE).read_bytes() != (made / MEMORY_FILE).read_bytes():
                    raise RuntimeError("the fetched memory.ram differs from the built one")
                files = [f for f in made.iterdir() if f.is_file()]
                sent_bytes.append(float(sent or 0))
                file_bytes.append(float(sum(f.stat().st_size for f in files)))
                # The same directory through fetch_dir, packed (as above) and whole.
                for label, sparse, samples in (
                    ("sparse", {MEMORY_FILE}, sparse_fetch),
                    ("whole", set(), whole_fetch),
                ):
                    key = f"bench-{label}-{i}/"
                    upload_dir(store, key, made, owner=info.key, scratch=root, sparse=sparse)
                    staging = root / f"staging-{label}"
                    staging.mkdir()
                    t0 = now()
                    fetch_dir(store, key, staging, root / "final", owner=info.key,
                              images_dir=ctx.daemon.images_dir)  # fmt: skip
                    samples.append(now() - t0)
                    shutil.rmtree(staging)
                    _empty(store, records, key)
                ctx.log(
                    f"  round {i + 1}/{rounds}: build {build[-1]:.2f} s, upload {upload[-1]:.2f} s "
                    f"({sent_bytes[-1] / MIB:.0f} of {file_bytes[-1] / MIB:.0f} MiB), fetch "
                    f"{fetch[-1]:.2f} s; fetch_dir sparse {sparse_fetch[-1]:.2f} s, whole "
                    f"{whole_fetch[-1]:.2f} s"
                )
                _empty(store, records, prefix)
            finally:
                a.close()
                b.close()
                shutil.rmtree(root / f"a{i}", ignore_errors=True)
                shutil.rmtree(root / f"b{i}", ignore_errors=True)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    label = f"{SANDBOX_VCPUS} vCPU, {SANDBOX_MEMORY_MIB} MiB"
    result.metrics = [
        Metric(
            "template_fetch_vs_build",
            "s",
            "lower",
            "TemplateBlobs.fetch on a host without the template (download, checks, "
            "memory recreated and re-sealed, renamed in) ÷ QemuTemplates.build (cold boot, "
            "settle, freeze, seal) of the same template, same rounds",
            SampleSet(f"fetch of the {label} template from SeaweedFS", fetch),
            SampleSet(f"build of the {label} template by a cold boot", build),
        ),
        Metric(
            "template_upload_vs_build",
            "s",
            "lower",
            "TemplateBlobs.upload (memory packed, every blob streamed with its sha256, "
            "record, index) ÷ the build it follows (both off the create's path)",
            SampleSet("upload of the template", upload),
            SampleSet("build of the template", build),
        ),
        Metric(
            "template_bytes_sent_vs_files",
            "bytes",
            "lower",
            "bytes an upload sends (memory.ram as its non-zero extents) ÷ the bytes of the "
            "template's files (memory.ram at its full size)",
            SampleSet("bytes sent", sent_bytes),
            SampleSet("bytes of the template's files", file_bytes),
        ),
        Metric(
            "template_fetch_sparse_vs_whole",
            "s",
            "lower",
            "fetch_dir of the template with memory.ram packed (download + recreate) ÷ the "
            "same directory uploaded with memory.ram whole",
            SampleSet("fetch_dir, memory.ram packed", sparse_fetch),
            SampleSet("fetch_dir, memory.ram whole", whole_fetch),
        ),
    ]
    result.notes.append(
        "the S3 server runs on this host (loopback, one disk): a real network makes the "
        "fetch slower and the packed memory matter more; the build is CPU (TCG here)"
    )
    return result
