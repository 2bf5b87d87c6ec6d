"""Images from Dockerfiles in real VMs, end to end: SDK + REST + ImageBuilder + QEMU.

Every RUN/COPY step runs in a build sandbox (a real microvm booted from the previous
step's layer); nothing of the build runs on the host. One several-step Dockerfile is
built FROM an OCI reference served by a real registry on loopback (Debian's
docker-registry; a busybox-only image made offline with tests/ocikit.py), then:

- rebuilt after changing one RUN step: the steps before it are cache hits (asserted from
  the build's own step events), only it and the steps after it run (their timings are
  logged, never asserted); the build sandbox that runs it gets the build's egress rules;
- rebuilt unchanged: every step is a cache hit and no VM boots;
- a sandbox created from the image sees its ENV, WORKDIR and USER and the copied files;
- a failing RUN (FROM the hutch image made by the pull, by name) reports its output and
  exit code, and leaves no image, no build sandbox and no half-made layer behind;
- FROM a built-in image (base: glibc, Python; its package tree without hutch's agent).

The build sandboxes' specs are recorded: they carry the build's shape, network and egress
rules, so the egress enforcement is every sandbox's own (tests/vm/network/); this
module's service runs without the host network layer.

VM boots: 3 (first build) + 1 (rebuild) + 1 (the sandbox) + 1 (failing RUN) + 1 (FROM
base) = 7.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from hutch.errors import BuildFailed
from hutch.models import SandboxSpec
from hutch.sdk import AsyncClient, AsyncSandbox, BuildEvent
from hutch.services.composed import Services
from tests.ocikit import E, Image, Layer, layer_tar, push
from tests.registry_server import Registry, running_registry
from tests.vm.services import image_service, served

pytestmark = [pytest.mark.vm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

log = logging.getLogger(__name__)
API_KEY = "hk_dockerfile-test"
#: The build sandbox's shape (also the image's disk size: sandboxes need at least it).
SHAPE: dict[str, Any] = {"vcpus": 1, "memory_mib": 256, "disk_gib": 1}
RULES = ["pypi.org", "*.pythonhosted.org"]


def busybox_image() -> Image:
    """Static busybox and nothing else (no libc, no Python: COPY must not need them)."""
    busybox = Path(shutil.which("busybox") or "/bin/busybox").read_bytes()
    entries = [
        E("bin", "dir"),
        E("bin/busybox", data=busybox, mode=0o755),
        *(E(f"bin/{a}", "symlink", target="busybox") for a in _APPLETS),
        E("etc", "dir"),
        E("etc/passwd", data=b"root:x:0:0:root:/root:/bin/sh\n"),
        E("etc/group", data=b"root:x:0:\napp:x:1000:\n"),
        E("srv", "dir"),
    ]
    return Image(layers=[Layer(layer_tar(entries), "gzip")], env=["PATH=/bin"])


_APPLETS = ("sh", "echo", "cat", "ls", "id", "pwd", "chown", "sleep", "env", "mkdir", "sync")

DOCKERFILE = """\
FROM {ref}
ARG GREETING=hello
ENV APP_HOME=/srv/app MODE=prod
WORKDIR $APP_HOME
COPY app/ ./
RUN echo "$GREETING from RUN" > built.txt \\
 && echo 'app:x:1000:1000::/srv/app:/bin/sh' >> /etc/passwd \\
 && chown -R 1000:1000 /srv/app
RUN echo {second} > second.txt
USER app
EXPOSE 8080
CMD ["sh", "-c", "echo started"]
"""


@dataclass
class Env:
    svc: Services
    client: AsyncClient
    registry: Registry
    work: Path
    specs: list[SandboxSpec]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Env]:
    work = tmp_path_factory.mktemp("dockerfile")
    svc = image_service(work / "state")
    # Record what the builder asks for (the build sandboxes' specs), then do it.
    specs: list[SandboxSpec] = []
    create = svc.sandboxes.create

    async def recording_create(spec: SandboxSpec, *args: object, **kw: object) -> object:
        specs.append(spec)
        return await create(spec, *args, **kw)

    svc.sandboxes.create = recording_create  # type: ignore[method-assign,assignment]
    async with served(svc, API_KEY) as client:
        with running_registry(work / "registry") as registry:
            await asyncio.to_thread(push, busybox_image(), registry.url, "test/busybox", "1")
            yield Env(svc, client, registry, work, specs)


def context(env: Env, second: str) -> Path:
    ctx = env.work / f"ctx-{second}"
    shutil.rmtree(ctx, ignore_errors=True)  # made again: new files, new times, same content
    (ctx / "app").mkdir(parents=True)
    (ctx / "app/main.sh").write_text("echo main\n")
    (ctx / "app/notes.tmp").write_text("left out by .dockerignore\n")
    (ctx / ".dockerignore").write_text("**/*.tmp\n")
    ref = f"{env.registry.host}/test/busybox:1"
    (ctx / "Dockerfile").write_text(DOCKERFILE.format(ref=ref, second=second))
    return ctx


async def build(env: Env, name: str, ctx: Path, **kw: object) -> tuple[dict[int, str], str]:
    """Build; (the final state of each step, the build's log)."""
    events: list[BuildEvent] = []
    started = time.monotonic()
    try:
        await env.client.build_image(name, ctx, on_progress=events.append, **{**SHAPE, **kw})
    finally:
        lines = []
        for e in events:
            if e.type == "step" and e.state != "running":
                took = e.seconds or 0.0
                lines.append(
                    f"  step {e.step}/{e.steps} {e.state:>6} {took:7.2f}s  {e.instruction}"
                )
            elif e.type == "output":
                lines.append(f"    | {(e.data or '').rstrip()}")
        text = "\n".join(lines)
        log.warning("build %s took %.1fs:\n%s", name, time.monotonic() - started, text)
    states = {e.step: e.state for e in events if e.type == "step" and e.step is not None}
    return states, text  # type: ignore[return-value]


async def test_build_rebuild_and_run(env: Env) -> None:
    first, _ = await build(env, "df-app", context(env, "v1"))
    # FROM, then config steps (ARG, ENV, WORKDIR: made by the COPY), COPY, RUN, RUN, ...
    assert first == {1: "done", 2: "config", 3: "config", 4: "config", 5: "done", 6: "done",
                     7: "done", 8: "config", 9: "config", 10: "config"}  # fmt: skip
    booted = len(env.specs)
    assert booted == 3  # one build sandbox per step that changes the filesystem

    # Change one step (the second RUN): the steps before it come from the cache. The
    # build sandbox that runs it gets the build's egress rules (not part of any key).
    second, _ = await build(env, "df-app2", context(env, "v2"), egress=RULES)
    assert {n: second[n] for n in (5, 6)} == {5: "cached", 6: "cached"}
    assert second[7] == "done" and len(env.specs) == booted + 1
    assert env.specs[-1].egress == RULES and env.specs[-1].metadata["hutch.build"]
    assert all(spec.egress is None for spec in env.specs[:booted])

    # Nothing changed: every step is a hit, no VM boots, and the image is the same.
    third, _ = await build(env, "df-app3", context(env, "v2"))
    assert {n: third[n] for n in (5, 6, 7)} == {5: "cached", 6: "cached", 7: "cached"}
    assert len(env.specs) == booted + 1
    listed = {i.name: i for i in await env.client.list_images()}
    assert listed["df-app3"].digest == listed["df-app2"].digest != listed["df-app"].digest
    source, config = listed["df-app2"].source, listed["df-app2"].config
    assert source is not None and config is not None
    assert source["type"] == "dockerfile"
    assert config["working_dir"] == "/srv/app"
    assert config["exposed_ports"] == ["8080/tcp"]

    # A sandbox of the built image: ENV, WORKDIR, USER and what the steps wrote.
    sb = await AsyncSandbox.create("df-app2", client=env.client, **SHAPE)
    try:
        seen = await sb.exec("echo $APP_HOME $MODE; pwd; id -un; cat built.txt second.txt; ls")
        assert seen.exit_code == 0, seen.stderr
        lines = seen.stdout.splitlines()
        assert lines[:5] == ["/srv/app prod", "/srv/app", "app", "hello from RUN", "v2"]
        assert sorted(lines[5:]) == ["built.txt", "main.sh", "second.txt"]  # no notes.tmp
        # The guest's boot-time files were put back before each layer was kept.
        etc = await sb.exec(["cat", "/etc/passwd"], user="root")
        assert "app:x:1000:1000" in etc.stdout
    finally:
        await sb.kill()
    # Every build sandbox is gone once its step is kept.
    assert [r.id for r in env.svc.sandboxes.list_sandboxes() if r.state.is_live] == []


async def test_failing_run_reports_output_and_exit_code(env: Env) -> None:
    # FROM a hutch image by name: the same busybox, pulled as one.
    ref = f"{env.registry.host}/test/busybox:1"
    await env.client.pull_image("df-busybox", ref)
    ctx = env.work / "ctx-fail"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(
        "FROM df-busybox\nENV WHO=builder\nRUN echo to-stdout $WHO; echo to-stderr >&2; exit 7\n"
    )
    before = len(env.specs)
    with pytest.raises(BuildFailed) as failed:
        await build(env, "df-broken", ctx, network="none", egress=None)
    message = failed.value.message
    log.warning("the failed build's error: %s", message)
    assert "line 3" in message and "exit code 7" in message
    assert "to-stdout builder" in message and "to-stderr" in message
    assert len(env.specs) == before + 1 and env.specs[-1].network.value == "none"
    # Nothing half-built: no image, no build sandbox, no work directory of a step.
    assert "df-broken" not in {i.name for i in await env.client.list_images()}
    assert [r.id for r in env.svc.sandboxes.list_sandboxes() if r.state.is_live] == []
    cache = env.svc.settings.build_cache_dir
    assert [p.name for p in cache.glob(".work-*")] == []


async def test_from_a_builtin_image(env: Env) -> None:
    # FROM base: its package tree (glibc, Python) as the first layer, without hutch's
    # agent or init; the build sandbox runs the image's own shell and Python.
    ctx = env.work / "ctx-base"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(
        "FROM base\n"
        "RUN python3 -c 'import sys; print(sys.version_info[0])' > /py.txt; cat /py.txt\n"
    )
    states, text = await build(env, "df-base", ctx, vcpus=1, memory_mib=512, disk_gib=2)
    assert states == {1: "done", 2: "done"}
    assert "| 3" in text  # the RUN's output: Python 3 ran in the build VM
    info = {i.name: i for i in await env.client.list_images()}["df-base"]
    assert info.source is not None and info.config is not None
    assert info.source["base"] == "base" and info.config["env"]["PATH"].startswith("/usr/local")
