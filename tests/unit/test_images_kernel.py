"""Kernel layer pure parts: apt output parsing, module order, cache key."""

from __future__ import annotations

import pytest

from hutch.errors import ImageBuildError
from hutch.images.kernel import (
    VIRTIO_MODULES,
    KernelPackage,
    _depends_kernel,
    kernel_key,
    parse_apt_show,
    resolve_module_order,
)

# Excerpt of depmod's output for Debian's 6.1 cloud kernel.
MODULES_DEP = "\n".join(
    [
        "kernel/fs/fuse/virtiofs.ko: "
        + " ".join(
            [
                "kernel/drivers/virtio/virtio.ko",
                "kernel/drivers/virtio/virtio_ring.ko",
                "kernel/fs/fuse/fuse.ko",
            ]
        ),
        "kernel/drivers/virtio/virtio.ko: "
        + " ".join(
            [
                "kernel/drivers/virtio/virtio_ring.ko",
            ]
        ),
        "kernel/drivers/virtio/virtio_ring.ko:",
        "kernel/drivers/virtio/virtio_mmio.ko: "
        + " ".join(
            [
                "kernel/drivers/virtio/virtio.ko",
                "kernel/drivers/virtio/virtio_ring.ko",
            ]
        ),
        "kernel/drivers/char/hw_random/virtio-rng.ko: "
        + " ".join(
            [
                "kernel/drivers/virtio/virtio.ko",
                "kernel/drivers/virtio/virtio_ring.ko",
            ]
        ),
        "kernel/drivers/char/virtio_console.ko: "
        + " ".join(
            [
                "kernel/drivers/virtio/virtio.ko",
                "kernel/drivers/virtio/virtio_ring.ko",
            ]
        ),
        "kernel/drivers/block/virtio_blk.ko: "
        + " ".join(
            [
                "kernel/drivers/virtio/virtio.ko",
                "kernel/drivers/virtio/virtio_ring.ko",
            ]
        ),
        "kernel/drivers/net/virtio_net.ko: "
        + " ".join(
            [
                "kernel/drivers/net/net_failover.ko",
                "kernel/net/core/failover.ko",
                "kernel/drivers/virtio/virtio.ko",
                "kernel/drivers/virtio/virtio_ring.ko",
            ]
        ),
        "kernel/drivers/net/net_failover.ko: "
        + " ".join(
            [
                "kernel/net/core/failover.ko",
            ]
        ),
        "kernel/net/core/failover.ko:",
        "kernel/fs/fuse/fuse.ko:",
        "kernel/fs/ext4/ext4.ko.xz: "
        + " ".join(
            [
                "kernel/fs/jbd2/jbd2.ko.xz",
                "kernel/fs/mbcache.ko.xz",
                "kernel/lib/crc16.ko.xz",
            ]
        ),
        "kernel/fs/jbd2/jbd2.ko.xz:",
        "kernel/fs/mbcache.ko.xz:",
        "kernel/lib/crc16.ko.xz:",
    ]
)


def names(paths: list[str]) -> list[str]:
    return [p.rsplit("/", 1)[1] for p in paths]


def test_virtio_order_matches_the_design() -> None:
    order = resolve_module_order(MODULES_DEP, VIRTIO_MODULES)
    assert names(order) == [
        "virtio_ring.ko",
        "virtio.ko",
        "virtio_mmio.ko",
        "virtio_blk.ko",
        "failover.ko",
        "net_failover.ko",
        "virtio_net.ko",
        "virtio_console.ko",
        "virtio-rng.ko",
        "fuse.ko",  # shared volumes (guest_agent ops_sharefs)
    ]


def test_dependencies_come_first_and_once() -> None:
    order = names(resolve_module_order(MODULES_DEP, ["virtio_net", "ext4", "virtio_blk"]))
    assert (
        order.index("failover.ko") < order.index("net_failover.ko") < order.index("virtio_net.ko")
    )
    assert order.index("virtio_ring.ko") < order.index("virtio.ko")
    assert {"ext4.ko.xz", "jbd2.ko.xz", "mbcache.ko.xz", "crc16.ko.xz"} <= set(order)
    assert order.index("jbd2.ko.xz") < order.index("ext4.ko.xz")
    assert len(order) == len(set(order))


def test_unknown_module_is_an_error() -> None:
    with pytest.raises(ImageBuildError, match=r"virtio_gpu is not in modules\.dep"):
        resolve_module_order(MODULES_DEP, ["virtio_gpu"])


def test_cycle_is_an_error() -> None:
    with pytest.raises(ImageBuildError, match="cycle"):
        resolve_module_order("a.ko: b.ko\nb.ko: a.ko\n", ["a"])


APT_SHOW = """\
Package: linux-image-cloud-amd64
Source: linux-signed-amd64 (6.1.192+3)
Version: 6.1.192-3
Depends: linux-image-6.1.0-57-cloud-amd64 (= 6.1.192-3)
Description: Linux for x86-64 cloud (meta-package)
 This package depends on the latest Linux kernel.
SHA256: 00ff

Package: linux-image-cloud-amd64
Version: 6.1.176-1
"""


def test_parse_apt_show_takes_first_stanza() -> None:
    fields = parse_apt_show(APT_SHOW)
    assert fields["Version"] == "6.1.192-3"
    assert fields["SHA256"] == "00ff"
    assert fields["Description"].endswith("latest Linux kernel.")
    assert _depends_kernel(fields["Depends"]) == KernelPackage(
        "linux-image-6.1.0-57-cloud-amd64", "6.1.192-3"
    )


def test_depends_without_real_kernel_is_an_error() -> None:
    with pytest.raises(ImageBuildError, match="no linux-image-<version>"):
        _depends_kernel("linux-base, initramfs-tools | linux-initramfs-tool")
    with pytest.raises(ImageBuildError, match="no linux-image-<version>"):
        _depends_kernel("linux-image-6.1.0-57-cloud-amd64")  # unversioned


def test_kernel_key_changes_with_every_input() -> None:
    pkg = KernelPackage("linux-image-6.1.0-57-cloud-amd64", "6.1.192-3")
    key = kernel_key(pkg)
    assert key == kernel_key(KernelPackage(pkg.name, pkg.version))
    assert len(key) == 16
    assert key != kernel_key(KernelPackage(pkg.name, "6.1.192-4"))
    assert key != kernel_key(KernelPackage("linux-image-6.1.0-58-cloud-amd64", pkg.version))
    assert key != kernel_key(pkg, (*VIRTIO_MODULES, "ext4"))
