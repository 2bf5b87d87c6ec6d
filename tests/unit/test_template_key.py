"""The template key (hutch.runtime.qemu.template_key): every input a template restores
only into changes it, nothing else does; and the QEMU build it names is read the way a
snapshot manifest records it (hutch.vm.host_facts)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from hutch.images.build import ImageArtifacts
from hutch.models import Shape
from hutch.runtime.qemu import template_key
from hutch.runtime.qemu.template_key import HostFacts, key_inputs
from hutch.vm.host_facts import cpu_model, parse_qemu_version

SHAPE = Shape(vcpus=1, memory_mib=256, disk_gib=2)
TCG = HostFacts("7.2.22 Debian 1:7.2+dfsg-7+deb12u18+b3", "tcg", "Xeon A", 2_100_000, True)
KVM = dataclasses.replace(TCG, accel="kvm", tsc_khz=None)


def _image(d: Path, runtime: bool = False, **files: bytes) -> ImageArtifacts:
    d.mkdir(parents=True, exist_ok=True)
    content = {"vmlinux": b"kernel", "initrd.img": b"initrd", "rootfs.ext4": b"rootfs"}
    if runtime:
        content["runtime.ext4"] = b"runtime"
    content.update(files)
    for name, data in content.items():
        (d / name).write_bytes(data)
    return ImageArtifacts(
        name="base",
        digest="0123456789abcdef",
        kernel=d / "vmlinux",
        initrd=d / "initrd.img",
        rootfs=d / "rootfs.ext4",
        kernel_release="6.1",
        cmdline="console=ttyS0",
        size_bytes=6,
        runtime_disk=d / "runtime.ext4" if runtime else None,
    )


def _key(image: ImageArtifacts, shape: Shape = SHAPE, host: HostFacts = TCG) -> str:
    return template_key.template_key(key_inputs(image, shape, host))


def test_the_same_inputs_give_the_same_key_wherever_the_files_are(tmp_path: Path) -> None:
    a = _image(tmp_path / "a")
    b = dataclasses.replace(_image(tmp_path / "b"), name="other-name", digest="f" * 16)
    assert _key(a) == _key(b)  # name, digest and paths are not inputs: the bytes are
    assert len(_key(a)) == 64 and all(c in "0123456789abcdef" for c in _key(a))


@pytest.mark.parametrize(
    "change",
    [
        {"vmlinux": b"kernel 2"},
        {"initrd.img": b"initrd 2"},
        {"rootfs.ext4": b"rootfs 2"},
        {"runtime.ext4": b"runtime 2"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_other_bytes_of_any_image_file_are_another_key(
    tmp_path: Path, change: dict[str, bytes]
) -> None:
    base = _image(tmp_path / "a", runtime=True)
    other = _image(tmp_path / "b", runtime=True, **change)
    assert _key(base) != _key(other)


def test_a_runtime_disk_and_the_command_line_are_inputs(tmp_path: Path) -> None:
    plain = _image(tmp_path / "a")
    assert _key(plain) != _key(_image(tmp_path / "b", runtime=True))
    assert _key(plain) != _key(dataclasses.replace(plain, cmdline="console=ttyS0 quiet"))
    assert _key(plain) != _key(dataclasses.replace(plain, rootfs_format="qcow2"))


@pytest.mark.parametrize(
    "shape",
    [Shape(vcpus=2, memory_mib=256, disk_gib=2), Shape(1, 512, 2), Shape(1, 256, 3)],
    ids=["vcpus", "memory", "disk"],
)
def test_the_shape_is_an_input(tmp_path: Path, shape: Shape) -> None:
    image = _image(tmp_path)
    assert _key(image, shape) != _key(image)


@pytest.mark.parametrize(
    "host",
    [
        dataclasses.replace(TCG, qemu_build="7.2.22 Debian 1:7.2+dfsg-7+deb12u19"),
        dataclasses.replace(TCG, qemu_build="8.0.0"),
        dataclasses.replace(TCG, tsc_khz=2_500_000),
        dataclasses.replace(TCG, ram_in_file=False),
        KVM,
    ],
    ids=["qemu-package", "qemu-version", "tsc", "ram-in-stream", "accel"],
)
def test_every_host_fact_a_restore_depends_on_is_an_input(tmp_path: Path, host: HostFacts) -> None:
    image = _image(tmp_path)
    assert _key(image, host=host) != _key(image)


def test_the_host_cpu_counts_under_kvm_only(tmp_path: Path) -> None:
    """A KVM guest saw the host CPU's CPUID; a TCG guest sees the emulated model."""
    image = _image(tmp_path)
    assert _key(image, host=dataclasses.replace(TCG, cpu_model="EPYC B")) == _key(image)
    assert _key(image, host=dataclasses.replace(KVM, cpu_model="EPYC B")) != _key(image, host=KVM)
    # Under KVM the TSC rate is not told to the guest (None whatever was read).
    assert _key(image, host=dataclasses.replace(KVM, tsc_khz=1)) == _key(image, host=KVM)


def test_the_template_format_is_an_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    image = _image(tmp_path)
    before = _key(image)
    monkeypatch.setattr(template_key, "TEMPLATE_FORMAT", template_key.TEMPLATE_FORMAT + 1)
    assert _key(image) != before


def test_file_identities_are_recorded_once(tmp_path: Path) -> None:
    """Keys cost a stat per file after the first: each identity is kept beside it."""
    image = _image(tmp_path)
    inputs: dict[str, Any] = key_inputs(image, SHAPE, TCG)
    for f in (image.kernel, image.initrd, image.rootfs):
        assert (f.parent / f".{f.name}.sha256").is_file()
    # Rewritten in place (same size, new mtime): the stale record is not trusted.
    image.rootfs.write_bytes(b"ROOTFS")
    assert key_inputs(image, SHAPE, TCG)["rootfs"] != inputs["rootfs"]


@pytest.mark.parametrize(
    ("text", "version", "build"),
    [
        (
            "QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)\nCopyright (c) 2003",
            "7.2.22",
            "7.2.22 Debian 1:7.2+dfsg-7+deb12u18+b3",
        ),
        ("QEMU emulator version 8.2.0\nCopyright", "8.2.0", "8.2.0"),
        ("no version here", "unknown", "unknown"),
    ],
)
def test_the_qemu_build_reads_as_a_manifest_records_it(text: str, version: str, build: str) -> None:
    assert parse_qemu_version(text) == (version, build)


def test_the_cpu_model_is_the_model_name(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) X\nflags\t: fpu\n")
    assert cpu_model(cpuinfo) == "Intel(R) Xeon(R) X"
    assert cpu_model(tmp_path / "missing") == "unknown"
