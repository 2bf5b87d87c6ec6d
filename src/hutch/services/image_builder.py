"""Images from Dockerfiles (``POST /v1/images?dockerfile=...`` with the context tar).

::

    context tar (spooled) ─► BuildContext (checked, .dockerignore) ─► Dockerfile parsed,
    typed, build args checked ─► FROM resolved (a hutch image, scratch, or an OCI ref:
    manifest + config only) ─► plan (ARG/ENV expanded) ─► every COPY/ADD source resolved
    and hashed                 (any bad input is a 4xx here: nothing has run yet)
    ─► the base content (a pull downloads its layers now; FROM base: its package tree)
    ─► for each step: key = sha256(previous key, the step's expanded material, the
       digests of the files it copies)
         config step (ENV, USER, ...)  → only the key and the image config change
         cached layer for the key      → reused
         else a build sandbox: a real VM booted from the previous layer (kernel cmdline
         hutch.build=1), the build's shape and egress rules; RUN as the USER in the
         WORKDIR with ENV + ARGs / COPY through the runtime's Python / WORKDIR made
         ─► build_step.py finish (boot files put back, sync, freeze) ─► disk-mode pause
         ─► its overlay taken as the step's layer ─► the sandbox deleted
    ─► the top layer's chain flattened into a raw ext4 + OCI config ─► images row
       (source "dockerfile", digest = the build's key) ─► the cache pruned to size

A failing step (RUN exit status, a COPY the guest cannot lay out) raises
:class:`~hutch.errors.BuildFailed` with the output's tail; nothing is listed, the layers
of the steps before it stay cached. The build sandboxes are ordinary sandboxes (listed,
metered, capacity-checked, reconciled), tagged ``hutch.build``; a restarted daemon
deletes the ones a build it no longer runs left behind. The FROM image is resolved in
:mod:`hutch.services.build_base`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from hutch.config import Settings
from hutch.contract.auth import DEFAULT_PROJECT
from hutch.contract.limits import BUILD_OUTPUT_TAIL_BYTES, BUILD_TIMEOUT_S_RANGE
from hutch.errors import (
    BuildFailed,
    Conflict,
    HutchError,
    ImageBuildError,
    InvalidArgument,
    InvalidDockerfile,
    NotFound,
    Timeout,
)
from hutch.images.agent_runtime import BOOT_DONE, runtime_python_argv
from hutch.images.build import ImageArtifacts
from hutch.images.build_context import BuildContext, Source, copy_stream
from hutch.images.build_layers import Layer, LayerStore, flatten, oci_config
from hutch.images.dockerfile import (
    Plan,
    Step,
    base_reference,
    check_build_args,
    evaluate,
    parse,
    typed_all,
)
from hutch.images.oci.boot import BootSet
from hutch.images.oci.importer import OciContent
from hutch.models import NetworkMode, PauseMode, SandboxSpec, Shape
from hutch.net.rules import parse_policy
from hutch.services.build_base import Base, BuildProgress, Progress, resolve_base
from hutch.services.guest_ops import GuestOps
from hutch.services.image_import import ImageImporter, remove_spool
from hutch.services.image_import import plain_archive as plain_context
from hutch.services.images import EPHEMERAL_PREFIX, HostImages, ImageView
from hutch.services.lifecycle import LifecycleService
from hutch.services.reconcile import Reconciler
from hutch.services.sandboxes import SandboxService
from hutch.store.db import LIVE_STATES

__all__ = ["BUILD_TAG", "BuildOptions", "BuildProgress", "ImageBuilder", "root_key", "step_keys"]

log = logging.getLogger(__name__)

#: Metadata key naming the build a build sandbox belongs to.
BUILD_TAG = "hutch.build"
_FORMAT = "hutch-dockerfile-v1"
_SCRIPT = resources.files("hutch.images").joinpath("guest_files/build_step.py").read_text()
_SCRIPT_SHA = hashlib.sha256(_SCRIPT.encode()).hexdigest()
_BOOT_WAIT_S = 120.0


@dataclass(frozen=True)
class BuildOptions:
    """How to build: where the Dockerfile is in the context, its build args, and the build
    sandbox's egress rules (None: open, as a sandbox's default), network and shape."""

    dockerfile: str = "Dockerfile"
    build_args: dict[str, str] = field(default_factory=dict)
    egress: list[str] | None = None
    network: NetworkMode = NetworkMode.DEFAULT
    shape: Shape = field(default_factory=Shape)
    timeout_s: int = 3600
    no_cache: bool = False
    start: bool = False
    filename: str | None = None  # the uploaded context's name, for the record
    #: The project the image goes to (its build sandboxes run, are metered and counted
    #: against quotas there; FROM may name its images).
    project: str = DEFAULT_PROJECT


def _noop(_: BuildProgress) -> None:
    return None


def _key(parent: str, material: dict[str, Any]) -> str:
    doc = json.dumps(material, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{parent}\0{doc}".encode()).hexdigest()


def root_key(base_digest: str) -> str:
    """The key of the FROM step: the base image's content and the step script's version
    (a changed script makes every layer again)."""
    return hashlib.sha256(f"{_FORMAT}\0{base_digest}\0{_SCRIPT_SHA}".encode()).hexdigest()


def step_keys(
    root: str, plan: Plan, file_digests: Mapping[int, str], salt: str | None = None
) -> dict[int, str]:
    """Every step's cache key, by step number: a chain, each the sha256 of the key
    before it and the step's expanded material (plus, for COPY/ADD, the digest of the
    files it copies), so a change at one step gives it and every later step a new key
    and leaves the earlier ones alone. Config steps (ENV, USER, ...) have keys too: what
    they set reaches the steps after them. ``salt`` (a ``no_cache`` build's id) makes
    every key after FROM new."""
    keys: dict[int, str] = {}
    key = root
    for step in plan.steps:
        if step.kind != "from":
            material = dict(step.material)
            if step.number in file_digests:
                material["files"] = file_digests[step.number]
            key = _key(key, material)
            if salt is not None:
                key = _key(key, {"no_cache": salt})
        keys[step.number] = key
    return keys


class _Tail:
    """The last bytes of a step's output, for its error."""

    def __init__(self, limit: int = BUILD_OUTPUT_TAIL_BYTES) -> None:
        self.limit = limit
        self.data = bytearray()

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > 2 * self.limit:
            del self.data[: -self.limit]

    def text(self) -> str:
        return bytes(self.data[-self.limit :]).decode("utf-8", "replace")


async def _chunks(gen: Iterator[bytes]) -> AsyncIterator[bytes]:
    """A blocking generator (it reads the context tar) as an async one."""
    while True:
        chunk = await asyncio.to_thread(next, gen, None)
        if chunk is None:
            return
        yield chunk


class ImageBuilder:
    def __init__(
        self,
        settings: Settings,
        images: HostImages,
        importer: ImageImporter,
        *,
        sandboxes: SandboxService,
        lifecycle: LifecycleService,
        guest: GuestOps,
        reconciler: Reconciler,
    ) -> None:
        self.settings = settings
        self.images = images
        self.sandboxes = sandboxes
        self.lifecycle = lifecycle
        self.guest = guest
        self.reconciler = reconciler
        self.importer = importer
        self.layers = LayerStore(
            settings.build_cache_dir, images.images_dir, importer.ref_name("build-cache")
        )
        # Layer keys and base digests of builds running now (kept from pruning).
        self._in_use: dict[str, set[str]] = {}
        self._bases_in_use: dict[str, str] = {}
        self._cleanup: asyncio.Task[None] | None = None

    # -- daemon lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        """Remove half-committed steps now and, once the sandboxes are reconciled, the
        build sandboxes of builds a stopped daemon was running."""
        self.layers.start()
        self._cleanup = asyncio.get_running_loop().create_task(
            self._delete_orphans(), name="hutch-build-orphans"
        )

    async def _delete_orphans(self) -> None:
        # The service has a flag, not an event, for the end of its reconcile.
        while not self.reconciler.reconciled:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        for rec in self.sandboxes.core.store.list_sandboxes(states=LIVE_STATES):
            if BUILD_TAG in rec.metadata and rec.metadata[BUILD_TAG] not in self._in_use:
                log.info("deleting build sandbox %s of an interrupted build", rec.id)
                with contextlib.suppress(HutchError):
                    await self.sandboxes.delete(rec.id)

    async def close(self) -> None:
        if self._cleanup is not None:
            self._cleanup.cancel()
            await asyncio.gather(self._cleanup, return_exceptions=True)

    # -- the build ----------------------------------------------------------------------

    def check(self, options: BuildOptions) -> None:
        """Refuse bad options before anything is uploaded or run (``InvalidArgument``)."""
        lo, hi = BUILD_TIMEOUT_S_RANGE
        if not lo <= options.timeout_s <= hi:
            raise InvalidArgument(f"timeout_s={options.timeout_s}; accepted: {lo}-{hi}")
        parse_policy(options.egress or [])
        if options.network is NetworkMode.NONE and options.egress:
            raise InvalidArgument('network "none" has no egress rules; drop "egress"')

    async def build(
        self,
        name: str,
        context: Path,
        options: BuildOptions,
        progress: Progress | None = None,
    ) -> ImageView:
        """Build image ``name`` from the context tar at ``context`` (removed afterwards,
        whatever happens). Raises ``InvalidDockerfile``/``InvalidArgument`` for bad
        input (before anything runs), ``BuildFailed`` for a failing step, ``Timeout``
        past ``options.timeout_s``, ``Conflict`` for a name taken or being built."""
        try:
            self.check(options)
            with self.importer.reserve(name, options.project, "build"):
                try:
                    async with asyncio.timeout(options.timeout_s) as limit:
                        return await self._build(name, context, options, progress or _noop)
                except TimeoutError:
                    if limit.expired():
                        raise Timeout(
                            f"the build of {name} ran past its timeout_s={options.timeout_s}; "
                            "nothing was built (finished steps stay cached)"
                        ) from None
                    raise
        finally:
            await asyncio.to_thread(remove_spool, context)

    async def _build(
        self, name: str, context: Path, options: BuildOptions, report: Progress
    ) -> ImageView:
        report(BuildProgress("status", "reading the build context"))
        plain = await asyncio.to_thread(plain_context, context, self.settings.max_image_bytes)
        ctx = await asyncio.to_thread(BuildContext, plain)
        build_id = uuid.uuid4().hex[:12]
        self._in_use[build_id] = set()
        base: Base | None = None
        try:
            dockerfile = await asyncio.to_thread(ctx.dockerfile, options.dockerfile)
            df = parse(dockerfile)
            instructions = typed_all(df)
            check_build_args(instructions, options.build_args)
            ref, from_ins = base_reference(instructions, options.build_args, df.escape)
            report(BuildProgress("status", f"resolving the base image {ref}"))
            base = await resolve_base(ref, from_ins.raw.where(), self.images,
                                      self.settings.max_image_bytes, report,
                                      project=options.project)  # fmt: skip
            plan = evaluate(instructions, options.build_args, base.config, df.escape)
            sources = await asyncio.to_thread(self._sources, ctx, plan)
            content = await asyncio.to_thread(base.content)
            self._bases_in_use[build_id] = content.digest
            boot: BootSet = await asyncio.to_thread(self.images.boot.prepare)
            top, key = await self._steps(plan, ctx, sources, content, boot, options, build_id,
                                         report)  # fmt: skip
            return await self._finish(name, plan, top, key, content, options, build_id, report)
        finally:
            if base is not None:
                base.close()
            ctx.close()
            self._in_use.pop(build_id, None)
            self._bases_in_use.pop(build_id, None)
            if plain != context:
                await asyncio.to_thread(remove_spool, plain)

    def _sources(self, ctx: BuildContext, plan: Plan) -> dict[int, tuple[list[Source], str]]:
        """Every COPY/ADD's sources and their digest (a missing file is a 400 here)."""
        out: dict[int, tuple[list[Source], str]] = {}
        for step in plan.steps:
            if step.copy is None:
                continue
            where = f"line {step.line}"
            keyword = "ADD" if step.copy.add else "COPY"
            found: list[Source] = []
            for written in step.copy.sources:
                found.extend(ctx.sources(where, keyword, written, step.copy.add))
            if len(found) > 1 and not step.copy.dest_is_dir:
                raise InvalidDockerfile(
                    f"Dockerfile {where}: {keyword}: the sources match {len(found)} files; "
                    f"with more than one the destination must end with / "
                    f"({step.copy.dest}/)"
                )
            out[step.number] = (found, ctx.digest(found))
        return out

    # -- steps --------------------------------------------------------------------------

    async def _steps(
        self,
        plan: Plan,
        ctx: BuildContext,
        sources: dict[int, tuple[list[Source], str]],
        content: OciContent,
        boot: BootSet,
        options: BuildOptions,
        build_id: str,
        report: Progress,
    ) -> tuple[Layer, str]:
        key = root_key(content.digest)
        layer = await asyncio.to_thread(self.layers.base_layer, key, content)
        keys = step_keys(key, plan, {n: digest for n, (_, digest) in sources.items()},
                         build_id if options.no_cache else None)  # fmt: skip
        total = len(plan.steps)
        in_use = self._in_use[build_id]
        for step in plan.steps:
            started = time.monotonic()

            def said(status: str, step: Step = step, t0: float = started) -> None:
                report(BuildProgress("step", f"Step {step.number}/{total} : {step.text}",
                                     step.number, total, step.line, step.text, status,
                                     round(time.monotonic() - t0, 3)))  # fmt: skip

            if step.kind == "from":
                said("done")
                continue
            key = keys[step.number]
            if step.kind == "config":
                said("config")
                continue
            found = await asyncio.to_thread(self.layers.find, key, layer)
            if found is not None:
                layer = found
                in_use.add(key)
                said("cached")
                continue
            said("running")
            files = sources.get(step.number, ([], ""))[0]
            layer = await self._run_step(step, key, layer, ctx, files, boot, options, build_id,
                                         report, total)  # fmt: skip
            in_use.add(key)
            said("done")
        return layer, key

    def _ephemeral(self, layer: Layer, boot: BootSet, name: str) -> ImageArtifacts:
        return ImageArtifacts(
            name=name,
            digest=hashlib.sha256(f"{layer.key}\0{boot.key}".encode()).hexdigest()[:16],
            kernel=boot.kernel,
            initrd=boot.initrd,
            rootfs=layer.disk,
            kernel_release=boot.kernel_release,
            cmdline=f"{boot.cmdline} hutch.build=1",
            size_bytes=layer.virtual_size,
            runtime_disk=boot.runtime,
            rootfs_format=layer.format,
            ephemeral=True,
        )

    async def _run_step(
        self,
        step: Step,
        key: str,
        parent: Layer,
        ctx: BuildContext,
        files: list[Source],
        boot: BootSet,
        options: BuildOptions,
        build_id: str,
        report: Progress,
        total: int,
    ) -> Layer:
        image = self._ephemeral(parent, boot, f"{EPHEMERAL_PREFIX}{build_id}-{step.number}")
        self.images.add_ephemeral(image)
        work = await asyncio.to_thread(self.layers.work_dir)
        sandbox_id: str | None = None
        try:
            spec = SandboxSpec(
                image=image.name,
                shape=options.shape,
                metadata={BUILD_TAG: build_id, "hutch.build.step": f"{step.number}/{total}"},
                network=options.network,
                egress=options.egress,
                project=options.project,
                # The build's deadline cuts the step first; this one only bounds a VM
                # whose builder went away without deleting it.
                timeout_s=options.timeout_s + 600,
            )
            rec = await self.sandboxes.create(spec)
            sandbox_id = rec.id
            await self._booted(sandbox_id)
            if step.kind == "run":
                await self._run(sandbox_id, step, report, total)
            elif step.kind == "copy":
                await self._copy(sandbox_id, step, ctx, files)
            else:
                assert step.path is not None
                await self._mkdir(sandbox_id, step, step.path)
            await self._seal(sandbox_id, step)
            await self.lifecycle.pause(sandbox_id, PauseMode.DISK)
            disk = work / "disk.qcow2"
            await self.sandboxes.take_disk(sandbox_id, disk)
        except BaseException:
            await asyncio.to_thread(_rmtree, work)
            raise
        finally:
            if sandbox_id is not None:
                try:
                    await asyncio.shield(self.sandboxes.delete(sandbox_id))
                except HutchError as exc:
                    log.warning("could not delete build sandbox %s: %s", sandbox_id, exc)
            self.images.drop_ephemeral(image.name)
        return await asyncio.to_thread(self.layers.commit, key, parent, disk, step.text)

    async def _booted(self, sandbox_id: str) -> None:
        """Wait for the guest's boot-time work (growing /): it must not race the step."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _BOOT_WAIT_S
        while True:
            try:
                await self.guest.stat(sandbox_id, BOOT_DONE)
                return
            except NotFound:
                if loop.time() > deadline:
                    raise Timeout("the build sandbox did not finish booting") from None
                await asyncio.sleep(0.1)

    async def _mkdir(self, sandbox_id: str, step: Step, path: str) -> None:
        try:
            await self.guest.mkdir(sandbox_id, path)
        except (InvalidArgument, Conflict, NotFound) as exc:
            raise BuildFailed(
                f"Dockerfile line {step.line}: {step.text}: cannot make the working "
                f"directory {path}: {exc.message}",
                step=step.number,
            ) from exc

    async def _run(self, sandbox_id: str, step: Step, report: Progress, total: int) -> None:
        run = step.run
        assert run is not None
        await self._mkdir(sandbox_id, step, run.cwd)
        tail = _Tail()
        try:
            stream = await self.guest.exec(
                sandbox_id, list(run.argv), env=dict(run.env), cwd=run.cwd, user=run.user
            )
        except (InvalidArgument, NotFound) as exc:
            raise BuildFailed(
                f"Dockerfile line {step.line}: {step.text}: could not start: {exc.message}",
                step=step.number,
            ) from exc
        async for out in stream:
            tail.add(out.data)
            report(BuildProgress("output", step=step.number, steps=total, line=step.line,
                                 stream=out.stream,
                                 data=out.data.decode("utf-8", "replace")))  # fmt: skip
        done = await stream.wait()
        if done.exit_code != 0 or done.signal is not None or done.timed_out:
            how = (
                f"exit code {done.exit_code}"
                if done.signal is None
                else f"signal {done.signal}" + (" (timed out)" if done.timed_out else "")
            )
            raise BuildFailed(
                f"Dockerfile line {step.line}: {step.text}: failed with {how}; the end of its "
                f"output:\n{tail.text()}",
                step=step.number,
                exit_code=done.exit_code,
            )

    async def _copy(
        self, sandbox_id: str, step: Step, ctx: BuildContext, files: list[Source]
    ) -> None:
        plan = step.copy
        assert plan is not None
        await self._mkdir(sandbox_id, step, plan.cwd)
        spec = {
            "dest": plan.dest,
            "dest_is_dir": plan.dest_is_dir,
            "chown": plan.chown,
            "chmod": plan.chmod,
            "sources": [{"kind": s.kind, "name": s.name} for s in files],
        }
        argv = runtime_python_argv("-c", _SCRIPT, "copy", json.dumps(spec))
        stream = await self.guest.exec(
            sandbox_id, argv, cwd="/", user="root", stdin=_chunks(copy_stream(ctx, files))
        )
        result = await stream.collect()
        if result.exit_code != 0:
            raise BuildFailed(
                f"Dockerfile line {step.line}: {step.text}: "
                + (result.stderr.decode("utf-8", "replace").strip()[-BUILD_OUTPUT_TAIL_BYTES:]
                   or f"exit code {result.exit_code}"),
                step=step.number,
                exit_code=result.exit_code,
            )  # fmt: skip

    async def _seal(self, sandbox_id: str, step: Step) -> None:
        """Put back the boot-time files, sync and freeze the guest's filesystem."""
        argv = runtime_python_argv("-c", _SCRIPT, "finish")
        stream = await self.guest.exec(sandbox_id, argv, cwd="/", user="root")
        result = await stream.collect()
        if result.exit_code != 0:
            raise ImageBuildError(
                f"step {step.number} ({step.text}): could not seal the layer: "
                + result.stderr.decode("utf-8", "replace")[-2000:]
            )

    # -- the image ----------------------------------------------------------------------

    async def _finish(
        self,
        name: str,
        plan: Plan,
        top: Layer,
        key: str,
        base: OciContent,
        options: BuildOptions,
        build_id: str,
        report: Progress,
    ) -> ImageView:
        cfg = plan.config.oci()
        digest = "sha256:" + _key(key, {"config": cfg})
        history = [s.text for s in plan.steps]
        config_bytes = oci_config(cfg, time.time(), history)
        report(BuildProgress("status", "writing the image's filesystem"))
        meta = {"base": plan.base, "base_digest": base.digest, "steps": len(plan.steps),
                "dockerfile": options.dockerfile}  # fmt: skip
        content = await asyncio.to_thread(
            flatten, top, self.images.images_dir, digest, config_bytes, meta
        )
        source = {
            "type": "dockerfile",
            "dockerfile": options.dockerfile,
            "base": plan.base,
            "base_digest": base.digest,
            "steps": len(plan.steps),
        }
        if options.filename:
            source["filename"] = options.filename
        view = self.importer.record(name, content, source, options.start, options.project)
        report(BuildProgress("status", f"image {name} is {digest}"))
        if options.no_cache:
            keep_out = self._in_use.get(build_id, set())
            await asyncio.to_thread(self.layers.remove, keep_out)
        await asyncio.to_thread(self._prune)
        return view

    def _prune(self) -> None:
        keep = set().union(*self._in_use.values()) if self._in_use else set()
        removed = self.layers.prune(
            self.settings.build_cache_bytes, keep, set(self._bases_in_use.values())
        )
        if removed:
            log.info("build cache: removed %d least recently used layers", len(removed))


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
