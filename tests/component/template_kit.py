"""Templates without a VM, for the blob store tests: a host is a state directory with a
real ``QemuBackend`` (nothing started: its templates' key, find, install and seal are
real), an image is a few MiB of files in an images directory the hosts share, and a
template is made the way ``QemuTemplates.build`` leaves one, with only the boot and the
freeze replaced: a qcow2 disk on the image with data of its own, a sparse ``memory.ram``
(pages of data, pages written with zeros, holes), a state-only stream, the manifest of
this host's VM config and QEMU build, ``vm.json``, ``template.json``, published and
sealed by the same functions."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path

from hutch.config import Settings
from hutch.config.cluster import ClusterSettings
from hutch.images import identity
from hutch.images.build import ImageArtifacts
from hutch.models import Shape
from hutch.runtime.qemu.backend import QemuBackend
from hutch.runtime.qemu.host import SandboxPaths
from hutch.runtime.qemu.template_key import write_key_file
from hutch.runtime.qemu.templates import finish_template, publish_template
from hutch.storage.overlay import create_overlay
from hutch.vm.host_facts import qemu_build
from hutch.vm.snapshot_manifest import (
    MANIFEST_FORMAT,
    MEMORY_FILE,
    FileStamp,
    SnapshotManifest,
    compat_fields,
    describe_cmdline,
    fd_digest,
    file_sha256,
    write_atomic,
)
from hutch.vm.snapshot_seal import seal_memory
from tests.component.frozen_kit import qemu_tool

__all__ = ["SHAPE", "host", "make_image", "make_template"]

MiB = 1 << 20
SHAPE = Shape(vcpus=1, memory_mib=128, disk_gib=1)
#: Where make_template puts data into memory.ram (MiB offsets): random, zero, random.
RANDOM_AT = (1, 17)
ZEROS_AT = 9


def host(root: Path, images: Path, name: str, **settings: object) -> QemuBackend:
    """Host ``name``: its state in ``root/name``, the images directory ``images``."""
    config = Settings(
        state_dir=root / name,
        images_dir_override=images,
        accel="tcg",
        cgroups="off",
        cluster=ClusterSettings(host_id=name),
    )
    return QemuBackend(dataclasses.replace(config, **settings))  # type: ignore[arg-type]


def make_image(images: Path, fill: bytes = b"rootfs A", name: str = "base") -> ImageArtifacts:
    """A built-in-like image ``images/<name>/0123456789abcdef/`` (kernel, initrd, a
    sparse 32 MiB rootfs with ``fill`` at its head), identities recorded as a build
    records them; files already there are kept."""
    d = images / name / "0123456789abcdef"
    d.mkdir(parents=True, exist_ok=True)
    for f, data in (("vmlinux", b"kernel " * 1000), ("initrd.img", b"initrd " * 500)):
        if not (d / f).exists():
            (d / f).write_bytes(data)
    rootfs = d / "rootfs.ext4"
    if not rootfs.exists():
        with rootfs.open("wb") as out:
            out.write(fill * (MiB // len(fill)))
            out.truncate(32 * MiB)
        os.chmod(rootfs, 0o444)
        identity.record(rootfs)
    return ImageArtifacts(
        name=name,
        digest="0123456789abcdef",
        kernel=d / "vmlinux",
        initrd=d / "initrd.img",
        rootfs=rootfs,
        kernel_release="6.1.0-kit",
        cmdline="console=ttyS0",
        size_bytes=32 * MiB,
    )


def make_template(backend: QemuBackend, image: ImageArtifacts, shape: Shape = SHAPE) -> Path:
    """The template of (image, shape) on ``backend``'s host, as a build leaves it."""
    templates = backend.templates
    info = templates.describe(image, shape)
    final = info.path
    work = SandboxPaths(state=final.parent / (final.name + ".build"), run=final.parent / "run")
    work.state.mkdir(parents=True)
    create_overlay(image.rootfs, work.disk, shape.disk_gib, image.rootfs_format)
    qemu_tool("qemu-io", "-f", "qcow2", "-c", "write -P 0xab 2M 64k", str(work.disk))
    cfg = templates.vm_config(work, image, shape)
    snap = work.state / "snapshot"
    snap.mkdir()
    memory = snap / MEMORY_FILE
    with memory.open("wb") as out:
        out.truncate(shape.memory_mib * MiB)
        for at in RANDOM_AT:
            out.seek(at * MiB)
            out.write(os.urandom(256 << 10))
        out.seek(ZEROS_AT * MiB)
        out.write(bytes(512 << 10))  # data, all zero: not sent
    state = snap / "state.mig"
    state.write_bytes(os.urandom(70_000))
    with state.open("rb") as f:
        digest, size = fd_digest(f.fileno())
    manifest = SnapshotManifest(
        format=MANIFEST_FORMAT,
        name="template",
        created_ns=time.time_ns(),
        qemu_version=qemu_build(),
        compat=compat_fields(cfg),
        cmdline=describe_cmdline(cfg),
        initrd_sha256=file_sha256(image.initrd),
        state_size=size,
        state_digest=digest,
        ram_in_file=True,
        memory=FileStamp.of(memory),
        disk=FileStamp.of(work.disk.resolve()),
    )
    write_atomic(snap / "manifest.json", manifest.to_json(), fsync=False)
    finish_template(snap, cfg)
    write_key_file(snap, info)
    publish_template(snap, final)
    seal_memory(final)
    shutil.rmtree(work.state)
    return final
