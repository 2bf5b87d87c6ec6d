"""Templates: per (image, shape), a guest booted once and frozen, that creates restore
instead of cold booting; and the chores shared with every frozen snapshot (finishing a
freeze, checking one is complete).

Each template is keyed (``hutch.runtime.qemu.template_key``): its directory's name ends
in the key's first 16 hex digits and ``template.json`` beside its files keeps the whole
key and what it covers, so a template whose inputs changed (a QEMU upgrade, other image
bytes) is simply not found, and is never replaced in place under the clones that map
it. A template fetched from another host (``services/template_blobs.py``) is installed
by :func:`hutch.runtime.qemu.template_install.install` and is an ordinary one here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

from hutch.crashpoints import crash_point
from hutch.errors import HutchError, NotFound, Timeout
from hutch.guest.client import AgentClient
from hutch.images.build import ImageArtifacts
from hutch.models import Shape
from hutch.runtime.backend import TemplateInfo
from hutch.runtime.qemu.boot import Booter
from hutch.runtime.qemu.host import HostLayout, SandboxPaths, write_config
from hutch.runtime.qemu.template_install import install
from hutch.runtime.qemu.template_key import (
    HostFacts,
    key_inputs,
    keyed_complete,
    read_key_file,
    template_key,
    write_key_file,
)
from hutch.storage.overlay import create_overlay
from hutch.vm.argv import VmConfig
from hutch.vm.host_facts import cpu_model, qemu_build
from hutch.vm.process import kill_verified
from hutch.vm.snapshot import MANIFEST_FILE, MEMORY_FILE, move_disk, save_snapshot
from hutch.vm.snapshot_dir import load_manifest
from hutch.vm.snapshot_seal import seal_memory

__all__ = [
    "RUNTIME_BOOT_DONE",
    "QemuTemplates",
    "finish_template",
    "publish_template",
    "template_complete",
]

log = logging.getLogger(__name__)

#: Written by the agent on an imported image once boot-time work is done.
RUNTIME_BOOT_DONE = "/run/.hutch/boot-done"
#: A fetch being installed (``staging``): removed at start unless renamed into place.
FETCH_PREFIX = ".fetch-"


class QemuTemplates:
    def __init__(self, layout: HostLayout, booter: Booter) -> None:
        self.layout = layout
        self.booter = booter
        # Keys by (image files, shape), valid while the files' stat is unchanged.
        self._keys: dict[tuple[Any, ...], TemplateInfo] = {}

    def host_facts(self) -> HostFacts:
        """This host's part of every template key. Blocking the first time (QEMU's
        ``--version``)."""
        return HostFacts(
            qemu_build=qemu_build(),
            accel=self.booter.accel,
            cpu_model=cpu_model(),
            tsc_khz=self.booter.tsc_khz,
            ram_in_file=self.layout.settings.template_ram_in_file,
        )

    def describe(self, image: ImageArtifacts, shape: Shape) -> TemplateInfo:
        files = [image.kernel, image.initrd, image.rootfs, image.runtime_disk]
        memo = (
            *(_stat_key(f) for f in files),
            image.name,
            image.digest,
            image.cmdline,
            image.rootfs_format,
            shape,
        )
        found = self._keys.get(memo)
        if found is not None:
            return found
        inputs = key_inputs(image, shape, self.host_facts())
        key = template_key(inputs)
        label = f"{shape.vcpus}c-{shape.memory_mib}m-{shape.disk_gib}g"
        name = f"{image.name}-{image.digest}-{label}-{key[:16]}"
        images = self.layout.settings.images_dir.resolve()
        home = image.rootfs.parent.resolve()
        content = home.relative_to(images).as_posix() if home.is_relative_to(images) else None
        info = TemplateInfo(
            key=key,
            content=content,
            path=self.layout.templates_root / name,
            inputs=inputs,
            image=image.name,
            shape=label,
        )
        self._keys[memo] = info
        return info

    def dir_of(self, image: ImageArtifacts, shape: Shape) -> Path:
        return self.describe(image, shape).path

    def find(self, image: ImageArtifacts, shape: Shape) -> Path | None:
        try:
            info = self.describe(image, shape)
        except OSError:
            return None  # the image's files are gone (deleted, evicted): no template
        return info.path if keyed_complete(info.path, info.key) else None

    def local(self) -> list[TemplateInfo]:
        root = self.layout.templates_root
        found = []
        for d in sorted(root.iterdir()) if root.is_dir() else ():
            kept = read_key_file(d)
            if kept is not None and keyed_complete(d, kept.key):
                found.append(dataclasses.replace(kept, path=d))
        return found

    def staging(self, image: ImageArtifacts, shape: Shape) -> Path:
        info = self.describe(image, shape)
        d = self.layout.templates_root / f"{FETCH_PREFIX}{info.path.name}-{secrets.token_hex(4)}"
        d.mkdir(parents=True, mode=0o700)
        return d

    def install(self, image: ImageArtifacts, shape: Shape, staging: Path) -> Path:
        info = self.describe(image, shape)
        cfg = self.vm_config(SandboxPaths(state=info.path, run=info.path), image, shape)
        return install(staging, info, cfg, image.rootfs)

    def vm_config(self, work: SandboxPaths, image: ImageArtifacts, shape: Shape) -> VmConfig:
        """The VM a template of (image, shape) is booted as, with its files in ``work``."""
        cfg = self.booter.vm_config(work, "template", shape, image, "hutch")
        if self.layout.settings.template_ram_in_file:
            # Guest RAM is a file on the state directory's file system, mapped shared: the
            # freeze then leaves it where it is (state-only stream, milliseconds) and
            # every clone maps it copy-on-write (ARCHITECTURE.md, "Copy-on-write memory").
            cfg = dataclasses.replace(cfg, memory_file=work.state / MEMORY_FILE, memory_shared=True)
        return cfg

    async def build(self, image: ImageArtifacts, shape: Shape) -> Path:
        """Boot ``image`` once at ``shape``, let it settle, and freeze it as the template
        every later create at that shape restores from (no cold boot on the hot path)."""
        info = await asyncio.to_thread(self.describe, image, shape)
        final = info.path
        if await asyncio.to_thread(self.find, image, shape):
            return final
        work = SandboxPaths(
            state=final.parent / (final.name + ".build"),
            run=self.layout.settings.run_dir / ("tpl-" + secrets.token_hex(4)),
        )
        await asyncio.to_thread(discard_template_build, work.state)
        work.state.mkdir(parents=True, mode=0o700)
        work.run.mkdir(parents=True, mode=0o700)
        try:
            await asyncio.to_thread(
                create_overlay, image.rootfs, work.disk, shape.disk_gib, image.rootfs_format
            )
            in_file = self.layout.settings.template_ram_in_file
            cfg = self.vm_config(work, image, shape)
            write_config(work.vm_json, cfg)
            vm, agent = await self.booter.boot(cfg, work, "hutch")
            try:
                # Let boot-time work finish so that no clone inherits it half-done.
                await _settle(agent, image)
                await agent.close()
                snap = work.state / "snapshot"
                await save_snapshot(vm, snap, ram_in_file=in_file, fsync=in_file)
            except BaseException:
                await vm.kill()
                raise
            await asyncio.to_thread(finish_template, snap, cfg)
            await asyncio.to_thread(write_key_file, snap, info)
            await asyncio.to_thread(publish_template, snap, final)
            # After the move (a rename changes the file's ctime, which the seal records).
            await asyncio.to_thread(seal_memory, final)
        finally:
            await asyncio.to_thread(shutil.rmtree, work.run, True)
            await asyncio.to_thread(discard_template_build, work.state)
        return final

    def remove(self, image_name: str) -> list[str]:
        """Remove every template of image ``image_name`` (an imported image being
        deleted); return their directory names."""
        removed = []
        for name in self.of_image(image_name):
            if not name.endswith(".build"):
                shutil.rmtree(self.layout.templates_root / name, ignore_errors=True)
                removed.append(name)
        return removed

    def of_image(self, image_name: str) -> list[str]:
        """The template directories of image ``image_name`` here, builds under way too
        (``.build``): the blob cache keeps the image's content while any is there."""
        root = self.layout.templates_root
        pattern = re.compile(rf"^{re.escape(image_name)}-[0-9a-f]{{16}}-\d+c-")
        return sorted(
            d.name for d in (root.iterdir() if root.is_dir() else ()) if pattern.match(d.name)
        )

    def retire(self, image_name: str, digest: str) -> list[str]:
        """Rename every finished template of ``image_name`` at ``digest`` aside
        (``.<key>.retired``: no create finds it from then on), then remove it; a crash
        between the two leaves the aside, which :meth:`discard_unfinished` removes."""
        root = self.layout.templates_root
        retired = []
        for name in self.of_image(image_name):
            if name.startswith(f"{image_name}-{digest}-") and not name.endswith(".build"):
                aside = root / f".{name}.retired"
                os.rename(root / name, aside)
                shutil.rmtree(aside, ignore_errors=True)
                retired.append(name)
        return retired

    def discard_unfinished(self) -> None:
        """At start: remove template builds and fetches a stop cut short (and templates a
        retire cut short), and seal a published template whose seal the stop cut short
        (between the move and ``seal_memory``)."""
        root = self.layout.templates_root
        if root.is_dir():
            for d in root.glob("*.build"):
                discard_template_build(d)
            for d in [*root.glob(".*.retired"), *root.glob(f"{FETCH_PREFIX}*")]:
                shutil.rmtree(d, ignore_errors=True)
            for vm_json in root.glob("*/vm.json"):
                try:
                    seal_memory(vm_json.parent)
                except (OSError, HutchError) as exc:
                    log.warning("template %s cannot be sealed: %s", vm_json.parent.name, exc)
        run_root = self.layout.settings.run_dir
        if run_root.is_dir():
            for d in run_root.glob("tpl-*"):
                shutil.rmtree(d, ignore_errors=True)
        self.booter.cgroups.reclaim(lambda name: name.startswith("tpl-"))


def _stat_key(path: Path | None) -> tuple[int, int, int, int] | None:
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def finish_template(snapshot_dir: Path, cfg: VmConfig) -> None:
    """Make a saved snapshot a template: record its VM config, then take its disk in.

    Idempotent, in an order a crash can resume from: ``vm.json`` first (``cfg`` is the
    sandbox's own, which stays in its directory until the disk has moved), then the disk
    (``move_disk`` finishes a move cut short). A ``vm.json`` already there is kept.
    """
    if not (snapshot_dir / "vm.json").is_file():
        write_config(snapshot_dir / "vm.json", cfg)
        crash_point("freeze.config")
    manifest = load_manifest(snapshot_dir)
    if Path(manifest.disk.path) != (snapshot_dir / "disk.qcow2").resolve():
        move_disk(snapshot_dir, snapshot_dir / "disk.qcow2")


def template_complete(snapshot_dir: Path) -> bool:
    """A frozen fork, named snapshot or template with everything a clone needs:
    manifest, vm.json and its disk inside, unchanged since the save."""
    try:
        manifest = load_manifest(snapshot_dir)
    except HutchError:
        return False
    disk = snapshot_dir / "disk.qcow2"
    return (
        (snapshot_dir / "vm.json").is_file()
        and Path(manifest.disk.path) == disk.resolve()
        and manifest.disk.changed(disk) is None
    )


def publish_template(snapshot_dir: Path, final: Path) -> None:
    """Move a finished template into place. Paths inside its manifest are absolute, so
    the disk is moved (and recorded) first, then the directory is renamed over."""
    final.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(snapshot_dir):
        if name not in ("disk.qcow2", MANIFEST_FILE, "vm.json"):
            os.rename(snapshot_dir / name, final / name)
    move_disk(snapshot_dir, final / "disk.qcow2")
    os.rename(snapshot_dir / MANIFEST_FILE, final / MANIFEST_FILE)
    # vm.json last: its presence marks the template complete.
    os.rename(snapshot_dir / "vm.json", final / "vm.json")


def discard_template_build(state: Path) -> None:
    kill_verified(state / "qemu.pid", "tpl-")
    shutil.rmtree(state, ignore_errors=True)


async def _settle(agent: AgentClient, image: ImageArtifacts) -> None:
    """Wait for the guest's boot-time work (growing the root filesystem) to end. An
    imported image may have no shell or pgrep: there the agent itself does that work
    and marks it done (``hutch_agent.runtime.BOOT_DONE``)."""
    if image.runtime_disk is None:
        await agent.run(
            ["sh", "-c", "while pgrep -x resize2fs >/dev/null; do sleep 0.1; done; sync"],
            timeout_s=120,
        )
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 120
    while True:
        try:
            await agent.stat(RUNTIME_BOOT_DONE)
            return
        except NotFound:
            if loop.time() > deadline:
                raise Timeout("the guest did not finish growing its root filesystem") from None
            await asyncio.sleep(0.1)
