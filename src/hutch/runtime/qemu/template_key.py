"""The key of a template: one sha256 over everything a template restores only into.

A template is a frozen guest (``hutch.runtime.qemu.templates``): its migration stream
loads only into the QEMU build that wrote it, on the same machine type, accelerator and
guest CPU (under KVM the host's: the guest saw its CPUID), at the same TSC rate (TCG:
the guest's clocksource was calibrated to it), RAM size and backend, vCPUs; its guest
runs the kernel and initramfs it booted and has the image's root filesystem (and an
imported image's runtime disk) in its page cache and under its qcow2 disk of the
shape's size. Two hosts whose inputs hash to the same key can use each other's
template; any difference is another key, so a host never restores a template whose
key differs from what it would build (``QemuTemplates.find`` compares the key kept
beside each template; the blob store files templates by key).

File bytes are identified by :mod:`hutch.images.identity` (the sha256 recorded beside
the file when it was built, imported or fetched; hashed once otherwise), so computing
a key costs a few ``stat`` calls once those records exist.

Under TCG the host's CPU model is not an input: the guest sees the emulated CPU
(``hutch.vm.argv.TCG_CPU``), whatever runs it. Placement's check for snapshots compares
the host model always (``services/placement.py``), which is stricter than needed there.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hutch.images import identity
from hutch.images.build import ImageArtifacts
from hutch.models import Shape
from hutch.runtime.backend import TemplateInfo
from hutch.vm.argv import MACHINE, TCG_CPU
from hutch.vm.snapshot_manifest import MANIFEST_FILE

__all__ = [
    "KEY_FILE",
    "TEMPLATE_FORMAT",
    "HostFacts",
    "key_inputs",
    "keyed_complete",
    "read_key_file",
    "template_key",
    "write_key_file",
]

#: How a template is made; raised whenever that changes what a template holds (the
#: freeze, the settling before it, the devices it is booted with), so that templates
#: of the old way are neither found nor fetched. 1: a NIC on a hub port (clones plug
#: it into their own taps), settled (resize2fs done or the runtime's boot-done mark).
TEMPLATE_FORMAT = 1
#: Beside a template's files: its key and what the key covers (written before publish).
KEY_FILE = "template.json"


@dataclass(frozen=True)
class HostFacts:
    """What of this host a template depends on (``hutch.vm.host_facts``, the booter)."""

    qemu_build: str  # "7.2.22 Debian 1:7.2+dfsg-7+deb12u18+b3"
    accel: str  # "kvm" | "tcg"
    cpu_model: str  # the host's (/proc/cpuinfo)
    tsc_khz: int | None  # what a TCG guest is told (None under KVM)
    ram_in_file: bool  # guest RAM in memory.ram (HUTCH_TEMPLATE_RAM_IN_FILE)


def key_inputs(image: ImageArtifacts, shape: Shape, host: HostFacts) -> dict[str, Any]:
    """Everything the key covers, as plain values (kept beside the template and in
    its upload's record, so that a differing key can be explained). Blocking: the
    image files' identities (recorded: a ``stat`` each; else hashed once)."""
    kvm = host.accel == "kvm"
    runtime = image.runtime_disk
    return {
        "format": TEMPLATE_FORMAT,
        "qemu": host.qemu_build,
        "machine": MACHINE,
        "accel": host.accel,
        "cpu": "host" if kvm else TCG_CPU,
        "host_cpu": host.cpu_model if kvm else None,
        "tsc_khz": None if kvm else host.tsc_khz,
        "ram_in_file": host.ram_in_file,
        "vcpus": shape.vcpus,
        "memory_mib": shape.memory_mib,
        "disk_gib": shape.disk_gib,
        "kernel": _identity(image.kernel),
        "initrd": _identity(image.initrd),
        "cmdline": image.cmdline,
        "rootfs": _identity(image.rootfs),
        "rootfs_format": image.rootfs_format,
        "runtime": _identity(runtime) if runtime is not None else None,
    }


def template_key(inputs: Mapping[str, Any]) -> str:
    """The key (sha256 hex) of ``inputs`` (:func:`key_inputs`): canonical JSON."""
    text = json.dumps(dict(inputs), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _identity(path: Path) -> str:
    return identity.identity(path)


def write_key_file(d: Path, info: TemplateInfo) -> None:
    """Record ``info``'s key and inputs in ``d`` (a template being made)."""
    doc = {
        "key": info.key,
        "content": info.content,
        "inputs": dict(info.inputs),
        "image": info.image,
        "shape": info.shape,
    }
    tmp = d / (KEY_FILE + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    os.rename(tmp, d / KEY_FILE)


def read_key_file(d: Path) -> TemplateInfo | None:
    """The key recorded in template directory ``d`` (None: none, or unreadable)."""
    try:
        doc = json.loads((d / KEY_FILE).read_text())
        key, content = str(doc["key"]), doc.get("content")
        if not re.fullmatch(r"[0-9a-f]{64}", key):
            return None
        return TemplateInfo(
            key=key,
            content=str(content) if content is not None else None,
            path=d,
            inputs=dict(doc.get("inputs") or {}),
            image=str(doc.get("image", "")),
            shape=str(doc.get("shape", "")),
        )
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def keyed_complete(d: Path, key: str) -> bool:
    """``d`` is a published template (vm.json is moved in last) keyed ``key``."""
    if not ((d / "vm.json").is_file() and (d / MANIFEST_FILE).is_file()):
        return False
    kept = read_key_file(d)
    return kept is not None and kept.key == key
