"""The E2B face driven by the real E2B SDKs (``e2b``, ``e2b-code-interpreter``), sync and
async, against the real service with the real guest agent (in bubblewrap instead of a
VM). tests/e2e/test_e2b.py proves the same with real VMs and a real daemon; this tier
runs in seconds and covers the protocol in depth.

The servers run in the test's event loop, so the sync SDK runs in a worker thread
(``in_thread``).
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import io
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from e2b import (
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    FileNotFoundException,
    FilesystemEventType,
    PtySize,
    RateLimitException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxQuery,
    SandboxState,
    Template,
)
from e2b.sandbox.commands.command_handle import CommandResult
from e2b_code_interpreter import AsyncSandbox as AsyncCodeSandbox
from e2b_code_interpreter import Sandbox as CodeSandbox

from hutch.config import Settings
from hutch.daemon import build_services
from hutch.images.build import ImageArtifacts
from hutch.services.images import ImageDefaults, ImageView
from hutch.store import Store
from tests.component.conftest import API_KEY, FakeImages, started_services, until
from tests.component.e2b_face import Face, serve_face
from tests.component.fake_backend import FakeBackend

pytestmark = pytest.mark.timeout(180)
T = TypeVar("T")

# The fake backend runs the kernel with the host's system Python.
HAS_MATPLOTLIB = (
    importlib.util.find_spec("matplotlib") is not None
    or Path("/usr/lib/python3/dist-packages/matplotlib").is_dir()
)


class E2bImages(FakeImages):
    """``base`` and ``devbox`` both built (``code-interpreter-v1`` maps to devbox)."""

    def find(self, name: str, project: str = "default") -> ImageArtifacts | None:
        if name not in ("base", "devbox"):
            return None
        return ImageArtifacts(**{**self.base.__dict__, "name": name})

    def defaults(self, name: str, project: str = "default") -> ImageDefaults:
        return ImageDefaults()

    def list(self, project: str | None = None) -> list[ImageView]:
        return [
            ImageView(n, "fake", True, self.base.digest, 1 << 30, "6.1.0-fake")
            for n in ("base", "devbox")
        ]


@pytest.fixture
async def face(settings: Settings, tmp_path: Path) -> AsyncIterator[Face]:
    async with (
        started_services(settings, tmp_path, E2bImages(tmp_path)) as svc,
        serve_face(svc, API_KEY) as f,
    ):
        yield f


async def in_thread(fn: Callable[[], T]) -> T:
    return await asyncio.to_thread(fn)


@pytest.fixture
async def sb(face: Face) -> AsyncIterator[AsyncSandbox]:
    sandbox = await AsyncSandbox.create(metadata={"suite": "e2b"}, **face.opts)
    yield sandbox
    await sandbox.kill()


# -- keys, lifecycle, listing --------------------------------------------------------------


async def test_keys_in_either_form_and_a_wrong_one_is_refused(face: Face) -> None:
    with pytest.raises(AuthenticationException):
        await AsyncSandbox.create(**{**face.opts, "api_key": "e2b_" + "ab" * 20})
    with pytest.raises(AuthenticationException):
        await AsyncSandbox.create(**{**face.opts, "api_key": "e2b_not-hex"})
    raw = await AsyncSandbox.create(**{**face.opts, "api_key": API_KEY})
    assert await raw.is_running()
    await raw.kill()


async def test_lifecycle_info_timeout_and_kill(face: Face) -> None:
    sandbox = await AsyncSandbox.create("base", timeout=120, envs={"A": "1"}, **face.opts)
    info = await sandbox.get_info()
    assert (info.sandbox_id, info.template_id, info.state.value) == (
        sandbox.sandbox_id,
        "base",
        "running",
    )
    assert 110 <= (info.end_at - info.started_at).total_seconds() <= 121
    await sandbox.set_timeout(600)
    info = await sandbox.get_info()
    assert (info.end_at - info.started_at).total_seconds() > 590
    assert (await sandbox.commands.run("echo $A")).stdout == "1\n"
    assert await sandbox.kill() is True
    assert await sandbox.is_running() is False
    assert await AsyncSandbox.kill(sandbox.sandbox_id, **face.opts) is False
    with pytest.raises(SandboxNotFoundException):
        await AsyncSandbox.get_info(sandbox.sandbox_id, **face.opts)


async def test_list_pages_with_next_token_and_filters(face: Face) -> None:
    made = [
        await AsyncSandbox.create(metadata={"batch": "p", "n": str(i)}, **face.opts)
        for i in range(3)
    ]
    other = await AsyncSandbox.create(metadata={"batch": "q"}, **face.opts)
    try:
        paginator = AsyncSandbox.list(
            query=SandboxQuery(metadata={"batch": "p"}), limit=2, **face.opts
        )
        pages = []
        while paginator.has_next:
            pages.append([s.sandbox_id for s in await paginator.next_items()])
        assert [len(p) for p in pages] == [2, 1]
        assert sorted(i for page in pages for i in page) == sorted(s.sandbox_id for s in made)

        def sync_list() -> list[str]:
            found = Sandbox.list(query=SandboxQuery(metadata={"n": "1"}), **face.opts)
            return [s.sandbox_id for s in found.next_items()]

        assert await in_thread(sync_list) == [made[1].sandbox_id]
        await other.pause()
        running = AsyncSandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING]), **face.opts)
        ids = {s.sandbox_id for s in await running.next_items()}
        assert other.sandbox_id not in ids and made[0].sandbox_id in ids
        paused = AsyncSandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED]), **face.opts)
        assert [s.sandbox_id for s in await paused.next_items()] == [other.sandbox_id]
    finally:
        for s in [*made, other]:
            await s.kill()


# -- commands --------------------------------------------------------------------------


async def test_commands_foreground_exit_codes_env_cwd(sb: AsyncSandbox) -> None:
    result = await sb.commands.run("echo out; echo err >&2; pwd", cwd="/tmp", envs={"X": "y"})
    assert (result.stdout, result.stderr, result.exit_code) == ("out\n/tmp\n", "err\n", 0)
    with pytest.raises(CommandExitException) as failed:
        await sb.commands.run("echo partial; exit 3")
    assert (failed.value.exit_code, failed.value.stdout) == (3, "partial\n")
    chunks: list[str] = []
    await sb.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=chunks.append)
    assert "".join(chunks) == "1\n2\n3\n"


async def test_background_stdin_kill_list_and_connect(sb: AsyncSandbox) -> None:
    cat = await sb.commands.run("cat", background=True, stdin=True)
    await sb.commands.send_stdin(cat.pid, "line one\n")
    await sb.commands.close_stdin(cat.pid)
    assert (await cat.wait()).stdout == "line one\n"

    sleeper = await sb.commands.run("echo started; sleep 600", background=True)
    listed = {p.pid: p for p in await sb.commands.list()}
    assert sleeper.pid in listed
    assert listed[sleeper.pid].args[-1] == "echo started; sleep 600"
    assert await sb.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException) as killed:
        await sleeper.wait()
    assert killed.value.exit_code == -1 and "killed" in (
        killed.value.error or killed.value.stderr or "signal: killed"
    )
    assert await sb.commands.kill(sleeper.pid) is False

    ticker = await sb.commands.run("sleep 0.5; echo later; sleep 0.5", background=True)
    await ticker.disconnect()
    again = await sb.commands.connect(ticker.pid)
    assert (await again.wait()).stdout == "later\n"


async def test_sync_commands_and_stream_input(face: Face, sb: AsyncSandbox) -> None:
    def sync_part() -> tuple[CommandResult, str]:
        s = Sandbox.connect(sb.sandbox_id, **face.opts)
        handle = s.commands.run("cat", background=True, stdin=True)
        s.commands.stream_input(handle.pid, [b"a", "b", b"c\n"])
        s.commands.close_stdin(handle.pid)
        done = handle.wait()
        with pytest.raises(CommandExitException):
            s.commands.run("false")
        return done, s.commands.run("echo sync").stdout

    done, out = await in_thread(sync_part)
    assert done.stdout == "abc\n" and out == "sync\n"


async def test_pty_input_resize_and_kill(sb: AsyncSandbox) -> None:
    seen = bytearray()
    terminal = await sb.pty.create(PtySize(rows=24, cols=80), on_data=seen.extend)
    await sb.pty.send_stdin(terminal.pid, b"stty size; echo pty-$((6*7))\n")
    await until(lambda: b"pty-42" in seen, "the terminal echoed pty-42")
    assert b"24 80" in seen
    await sb.pty.resize(terminal.pid, PtySize(rows=30, cols=100))
    await sb.pty.send_stdin(terminal.pid, b"stty size\n")
    await until(lambda: b"30 100" in seen, "the terminal saw its new size")
    assert terminal.pid in {p.pid for p in await sb.commands.list()}
    assert await sb.pty.kill(terminal.pid) is True
    with pytest.raises(CommandExitException):
        await terminal.wait()


# -- files -----------------------------------------------------------------------------


async def test_files_text_bytes_many_list_and_ops(sb: AsyncSandbox) -> None:
    info = await sb.files.write("/root/e2b/hello.txt", "hello ✓")
    assert (info.path, info.name) == ("/root/e2b/hello.txt", "hello.txt")
    assert await sb.files.read("/root/e2b/hello.txt") == "hello ✓"
    blob = bytes(range(256)) * 1000
    await sb.files.write("data.bin", blob)  # relative: the home directory
    assert bytes(await sb.files.read("/root/data.bin", format="bytes")) == blob
    written = await sb.files.write_files(
        [{"path": f"/root/many/f{i}.txt", "data": f"n{i}"} for i in range(20)]
    )
    assert len(written) == 20
    names = sorted(e.name for e in await sb.files.list("/root/many"))
    assert names == sorted(f"f{i}.txt" for i in range(20))
    deep = {e.path for e in await sb.files.list("/root", depth=2)}
    assert "/root/many/f3.txt" in deep and "/root/e2b/hello.txt" in deep
    assert await sb.files.exists("/root/many") is True
    assert await sb.files.exists("/root/nope") is False
    assert await sb.files.make_dir("/root/new/dir") is True
    assert await sb.files.make_dir("/root/new/dir") is False
    moved = await sb.files.rename("/root/e2b/hello.txt", "/root/new/dir/moved.txt")
    assert moved.path == "/root/new/dir/moved.txt"
    entry = await sb.files.get_info("/root/new/dir/moved.txt")
    assert entry.size == len("hello ✓".encode()) and entry.permissions == "-rw-r--r--"
    await sb.files.remove("/root/new")
    assert await sb.files.exists("/root/new") is False
    with pytest.raises(FileNotFoundException):
        await sb.files.read("/root/missing.txt")
    streamed = await sb.files.write("/root/streamed.bin", io.BytesIO(b"x" * 100_000))
    assert streamed.path == "/root/streamed.bin"
    assert len(await sb.files.read("/root/streamed.bin", format="bytes")) == 100_000


async def test_gzip_upload_and_signed_urls(face: Face, sb: AsyncSandbox) -> None:
    await sb.files.write("/root/gz.txt", "zipped " * 100, gzip=True)
    assert await sb.files.read("/root/gz.txt") == "zipped " * 100
    up = sb.upload_url("/root/via-url.txt")
    down = sb.download_url("/root/via-url.txt", use_signature_expiration=60)
    assert "signature=" in up and "signature=" in down
    async with httpx.AsyncClient() as client:
        r = await client.post(up, files={"file": ("via-url.txt", b"signed upload")})
        assert r.status_code == 200, r.text
        r = await client.get(down)
        assert (r.status_code, r.content) == (200, b"signed upload")
        forged = down.replace("signature=v1_", "signature=v1_A")
        r = await client.get(forged)
        assert r.status_code == 401 and "signature" in r.json()["message"]
        # A data-plane call without the sandbox's token is refused.
        r = await client.get(
            f"{face.url}/files",
            params={"path": "/root/via-url.txt"},
            headers={"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "49983"},
        )
        assert r.status_code == 401


async def test_watch_both_styles(face: Face, sb: AsyncSandbox) -> None:
    await sb.files.make_dir("/root/w")
    events: list[Any] = []
    handle = await sb.files.watch_dir("/root/w", on_event=events.append, recursive=True)
    await sb.files.write("/root/w/a.txt", "1")
    await until(lambda: any(e.name == "a.txt" for e in events), "a.txt was watched")
    await handle.stop()  # type: ignore[no-untyped-call]
    assert {e.type for e in events if e.name == "a.txt"} & {
        FilesystemEventType.CREATE,
        FilesystemEventType.WRITE,
    }

    def polling() -> list[Any]:
        s = Sandbox.connect(sb.sandbox_id, **face.opts)
        watcher = s.files.watch_dir("/root/w")
        s.files.write("/root/w/b.txt", "2")
        s.files.remove("/root/w/a.txt")
        got: list[Any] = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not any(
            e.type is FilesystemEventType.REMOVE for e in got
        ):
            got += watcher.get_new_events()
            time.sleep(0.1)
        watcher.stop()
        return got

    got = await in_thread(polling)
    assert ("b.txt", FilesystemEventType.CREATE) in {(e.name, e.type) for e in got}
    assert ("a.txt", FilesystemEventType.REMOVE) in {(e.name, e.type) for e in got}


# -- code interpreter --------------------------------------------------------------------


async def test_code_interpreter_state_results_errors_env(face: Face) -> None:
    sandbox = await AsyncCodeSandbox.create(**face.opts)
    try:
        first = await sandbox.run_code("x = 20\nprint('hi')\nx + 1")
        assert (first.text, first.logs.stdout, first.error) == ("21", ["hi\n"], None)
        second = await sandbox.run_code("x * 2")
        assert second.text == "40"  # the default context kept x
        failed = await sandbox.run_code("1 / 0")
        assert failed.error is not None and failed.error.name == "ZeroDivisionError"
        env = await sandbox.run_code(
            "import os; os.environ.get('RUN_ONLY')", envs={"RUN_ONLY": "yes"}
        )
        assert env.text == "'yes'"
        assert (await sandbox.run_code("os.environ.get('RUN_ONLY')")).text is None
        ctx = await sandbox.create_code_context(cwd="/tmp")
        assert (await sandbox.run_code("import os; os.getcwd()", context=ctx)).text == "'/tmp'"
        assert ctx.id in {c.id for c in await sandbox.list_code_contexts()}
        await sandbox.restart_code_context(ctx)
        await sandbox.remove_code_context(ctx)
        assert ctx.id not in {c.id for c in await sandbox.list_code_contexts()}
        with pytest.raises(SandboxException, match="python"):
            await sandbox.run_code("console.log(1)", language="javascript")
    finally:
        await sandbox.kill()


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="the fake kernel uses the host's Python")
async def test_code_interpreter_matplotlib_png_sync(face: Face) -> None:
    def sync_part() -> Any:
        with CodeSandbox.create(**face.opts) as sandbox:
            return sandbox.run_code(
                "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()"
            )

    execution = await in_thread(sync_part)
    pngs = [r.png for r in execution.results if r.png]
    assert pngs and base64.b64decode(pngs[0]).startswith(b"\x89PNG")


# -- what hutch does not offer -----------------------------------------------------------


async def test_unsupported_calls_answer_e2b_errors_naming_hutchs_way(face: Face) -> None:
    async with httpx.AsyncClient(base_url=face.url, headers={"X-API-KEY": face.api_key}) as c:
        for method, path, word in [
            ("POST", "/v3/templates", "hutch image"),
            ("GET", "/teams", "API keys"),
            ("POST", "/volumes", "hutch cp"),
            ("GET", "/sandboxes/sb-0123456789ab/logs", "console"),
        ]:
            r = await c.request(method, path, json={})
            body = r.json()
            assert r.status_code == 400 and body["code"] == 400, (path, body)
            assert word in body["message"] and body["error_code"] == "not_supported_by_hutch"
    with pytest.raises(Exception, match="hutch image"):
        await in_thread(
            lambda: Template.build(Template().from_image("python:3"), "mine", **face.opts)
        )
    with pytest.raises(SandboxException, match="hutch"):
        await AsyncSandbox.create(network={"deny_out": ["10.0.0.0/8"]}, **face.opts)
    with pytest.raises(SandboxException, match="serves these templates") as unknown:
        await AsyncSandbox.create("no-such-template", **face.opts)
    assert unknown.value.status_code == 404


async def test_the_hosts_sandbox_quota_holds_through_the_face(
    settings: Settings, tmp_path: Path
) -> None:
    """HUTCH_MAX_SANDBOXES is the service's check, so the face cannot go around it: the
    SDK gets E2B's 429 (RateLimitException) naming the limit, and a slot freed by a kill
    is usable again."""
    one = replace(settings, limits=replace(settings.limits, max_sandboxes=1))
    backend = FakeBackend(tmp_path / "run")
    svc = build_services(one, Store(one.database), backend, E2bImages(tmp_path))
    await svc.start()
    try:
        async with serve_face(svc, API_KEY) as f:
            first = await AsyncSandbox.create(**f.opts)
            with pytest.raises(RateLimitException, match="HUTCH_MAX_SANDBOXES"):
                await AsyncSandbox.create(**f.opts)
            await first.kill()
            second = await AsyncSandbox.create(**f.opts)
            await second.kill()
    finally:
        await svc.close()
    assert backend.leftover_ids() == set()
