"""File watch and tar transfers of whole directories through the REST API, against the
real guest agent (tests/vm/test_ladder.py repeats the essentials in a VM: booted,
restored and forked)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import tarfile
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def sid(api: httpx.AsyncClient) -> str:
    r = await api.post("/v1/sandboxes", json={})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def sh(api: httpx.AsyncClient, sid: str, cmd: str) -> str:
    r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd})
    body = r.json()
    assert body["exit_code"] == 0, body
    return str(body["stdout"])


class Watch:
    """An open watch stream; ``until`` collects events until a predicate holds."""

    def __init__(self, lines: AsyncIterator[str]) -> None:
        self.lines = lines
        self.events: list[dict[str, Any]] = []

    async def until(self, done: Any) -> list[dict[str, Any]]:
        async with asyncio.timeout(10):
            while not done(self.events):
                line = await anext(self.lines)
                if line:
                    self.events.append(json.loads(line))
        return self.events


@pytest.fixture
async def watch(api: httpx.AsyncClient, sid: str) -> AsyncIterator[Any]:
    streams: list[Any] = []

    async def start(path: str, recursive: bool = True) -> Watch:
        await sh(api, sid, f"mkdir -p {path}")
        cm = api.stream(
            "GET",
            f"/v1/sandboxes/{sid}/files/watch",
            params={"path": path, "recursive": str(recursive).lower()},
        )
        r = await cm.__aenter__()
        streams.append(cm)
        assert r.status_code == 200
        w = Watch(r.aiter_lines())
        first = await w.until(lambda ev: ev)
        assert first[0]["type"] == "watching" and first[0]["path"] == path
        w.events.clear()
        return w

    yield start
    for cm in streams:
        await cm.__aexit__(None, None, None)


def kinds(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["type"], e["path"]) for e in events]


async def test_watch_create_modify_rename_delete(
    api: httpx.AsyncClient, sid: str, watch: Any
) -> None:
    w = await watch("/root/w")
    await sh(api, sid, "cd /root/w && echo a > f && for i in 1 2 3 4 5; do echo $i >> f; done")
    events = await w.until(lambda ev: ("modified", "/root/w/f") in kinds(ev))
    assert kinds(events)[0] == ("created", "/root/w/f")
    await asyncio.sleep(0.3)  # coalesced: the burst of appends is one or two events
    assert kinds(w.events).count(("modified", "/root/w/f")) <= 2
    assert all(isinstance(e["time"], float) and e["is_dir"] is False for e in events)

    w.events.clear()
    await sh(api, sid, "mv /root/w/f /root/w/g && rm /root/w/g")
    events = await w.until(lambda ev: ("deleted", "/root/w/g") in kinds(ev))
    renamed = [e for e in events if e["type"] == "renamed"]
    assert renamed and renamed[0]["from"] == "/root/w/f" and renamed[0]["to"] == "/root/w/g"

    # Recursive: a new subdirectory is watched too, and what appeared in it before its
    # watch existed is reported as created.
    w.events.clear()
    await sh(api, sid, "mkdir -p /root/w/a/b && touch /root/w/a/b/deep")
    await w.until(lambda ev: ("created", "/root/w/a/b/deep") in kinds(ev))
    w.events.clear()
    await sh(api, sid, "echo x > /root/w/a/b/deep")
    await w.until(lambda ev: ("modified", "/root/w/a/b/deep") in kinds(ev))

    # A directory moved out of the tree is deleted; its watches are gone.
    w.events.clear()
    await sh(api, sid, "mv /root/w/a /root/outside")
    await w.until(lambda ev: ("deleted", "/root/w/a") in kinds(ev))


async def test_watch_non_recursive_and_end(api: httpx.AsyncClient, sid: str, watch: Any) -> None:
    w = await watch("/root/flat", recursive=False)
    await sh(api, sid, "mkdir /root/flat/sub && touch /root/flat/sub/x /root/flat/top")
    events = await w.until(lambda ev: ("created", "/root/flat/top") in kinds(ev))
    assert ("created", "/root/flat/sub/x") not in kinds(events)
    await sh(api, sid, "rm -r /root/flat")
    events = await w.until(lambda ev: ev and ev[-1]["type"] == "end")
    assert events[-1]["reason"] == "deleted"


async def test_watch_timeout(api: httpx.AsyncClient, sid: str) -> None:
    await sh(api, sid, "mkdir -p /root/quiet")
    start = asyncio.get_running_loop().time()
    r = await api.get(
        f"/v1/sandboxes/{sid}/files/watch", params={"path": "/root/quiet", "timeout_s": "0.5"}
    )
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert [x["type"] for x in lines] == ["watching", "end"] and lines[1]["reason"] == "timeout"
    assert asyncio.get_running_loop().time() - start < 10


async def test_watch_errors(api: httpx.AsyncClient, sid: str) -> None:
    r = await api.get(f"/v1/sandboxes/{sid}/files/watch", params={"path": "/root/missing"})
    assert r.status_code == 404
    await sh(api, sid, "touch /root/file")
    r = await api.get(f"/v1/sandboxes/{sid}/files/watch", params={"path": "/root/file"})
    assert r.status_code == 400 and "directory" in r.json()["error"]["message"]
    r = await api.get(f"/v1/sandboxes/{sid}/files/watch", params={"path": "/proc"})
    assert r.status_code == 400


def make_tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def file_info(name: str, data: bytes, mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    return info, data


async def test_archive_round_trip(api: httpx.AsyncClient, sid: str) -> None:
    await sh(
        api,
        sid,
        "mkdir -p /root/src/a/b /root/src/empty && cd /root/src && "
        "head -c 300000 /dev/urandom > a/b/big && echo hi > top && chmod 755 top && "
        "ln -s a/b/big link",
    )
    expect = await sh(api, sid, "cd /root/src && find . -type f | sort | xargs sha256sum")
    r = await api.get(f"/v1/sandboxes/{sid}/files/archive", params={"path": "/root/src"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
    data = r.content
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = {m.name: m for m in tar.getmembers()}
    assert {"a", "a/b", "a/b/big", "empty", "top", "link"} <= set(names)
    assert names["link"].issym() and names["link"].linkname == "a/b/big"
    assert names["top"].mode & 0o777 == 0o755

    r = await api.put(
        f"/v1/sandboxes/{sid}/files/archive", params={"path": "/root/dst"}, content=data
    )
    assert r.status_code == 200, r.text
    assert r.json()["entries"] == len(names) and r.json()["path"] == "/root/dst"
    got = await sh(api, sid, "cd /root/dst && find . -type f | sort | xargs sha256sum")
    assert got == expect
    assert (await sh(api, sid, "readlink /root/dst/link; stat -c %a /root/dst/top")).split() == [
        "a/b/big",
        "755",
    ]
    assert await sh(api, sid, "ls -A /root/dst | grep hutch-untar || true") == ""

    # Merge into an existing directory: files replaced, others kept.
    await sh(api, sid, "echo old > /root/dst/top && echo mine > /root/dst/keep")
    r = await api.put(
        f"/v1/sandboxes/{sid}/files/archive", params={"path": "/root/dst"}, content=data
    )
    assert r.status_code == 200
    assert await sh(api, sid, "cat /root/dst/top /root/dst/keep") == "hi\nmine\n"

    # Streamed upload, gzip.
    gz = io.BytesIO()
    with tarfile.open(fileobj=gz, mode="w:gz") as tar:
        info, payload = file_info("z/hello.txt", b"zipped\n")
        tar.addfile(info, io.BytesIO(payload))

    async def body() -> AsyncIterator[bytes]:
        raw = gz.getvalue()
        for i in range(0, len(raw), 7):
            yield raw[i : i + 7]

    r = await api.put(
        f"/v1/sandboxes/{sid}/files/archive", params={"path": "/root/gz"}, content=body()
    )
    assert r.status_code == 200, r.text
    assert await sh(api, sid, "cat /root/gz/z/hello.txt") == "zipped\n"
    assert hashlib.sha256(data).hexdigest()  # the download itself is a valid tar


@pytest.mark.parametrize(
    ("member", "why"),
    [
        ("abs", "absolute"),
        ("dotdot", ".."),
        ("symlink_out", "outside"),
        ("symlink_abs", "absolute"),
        ("device", "device"),
        ("hardlink_out", "outside"),
    ],
)
async def test_archive_refuses_unsafe_members(
    api: httpx.AsyncClient, sid: str, member: str, why: str
) -> None:
    good = file_info("fine.txt", b"ok")
    bad: tarfile.TarInfo
    if member == "abs":
        bad = file_info("/etc/evil", b"x")[0]
    elif member == "dotdot":
        bad = file_info("a/../../evil", b"x")[0]
    elif member in ("symlink_out", "symlink_abs", "hardlink_out"):
        bad = tarfile.TarInfo("lnk")
        bad.type = tarfile.LNKTYPE if member == "hardlink_out" else tarfile.SYMTYPE
        bad.linkname = "/etc/passwd" if member == "symlink_abs" else "../../etc/passwd"
    else:
        bad = tarfile.TarInfo("dev")
        bad.type, bad.devmajor, bad.devminor = tarfile.CHRTYPE, 1, 3
    data = make_tar([good, (bad, b"x" if bad.isreg() else None)])
    r = await api.put(
        f"/v1/sandboxes/{sid}/files/archive", params={"path": "/root/safe"}, content=data
    )
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert repr(bad.name) in message and why in message
    # All or nothing: the good member before the bad one was not written either.
    assert await sh(api, sid, "ls -A /root/safe") == ""


async def test_archive_errors(api: httpx.AsyncClient, sid: str) -> None:
    r = await api.get(f"/v1/sandboxes/{sid}/files/archive", params={"path": "/root/nope"})
    assert r.status_code == 404
    r = await api.put(
        f"/v1/sandboxes/{sid}/files/archive", params={"path": "/root/t"}, content=b"not a tar" * 100
    )
    assert r.status_code == 400 and "tar" in r.json()["error"]["message"]
    await sh(api, sid, "touch /root/afile")
    r = await api.put(
        f"/v1/sandboxes/{sid}/files/archive", params={"path": "/root/afile"}, content=make_tar([])
    )
    assert r.status_code == 400


async def test_sdk_watch_and_dirs(api: httpx.AsyncClient, sid: str, tmp_path: Any) -> None:
    from hutch.sdk import AsyncSandbox, Sandbox
    from tests.component.conftest import API_KEY

    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "data.bin").write_bytes(bytes(range(256)) * 2000)
    (src / "top.txt").write_text("top\n")
    (src / "link").symlink_to("top.txt")

    sb = await AsyncSandbox.connect(sid, base_url=str(api.base_url), api_key=API_KEY)
    try:
        await sb.files.mkdir("/root/sdkw")
        watcher = await sb.files.watch("/root/sdkw")
        async with watcher:
            await sb.exec("touch /root/sdkw/new")
            async with asyncio.timeout(10):
                event = await anext(watcher)
            assert (event.type, event.path, event.is_dir) == ("created", "/root/sdkw/new", False)

        written = await sb.files.upload_dir(src, "/root/up")
        assert written.entries == 5 and written.path == "/root/up"
        got = await sb.exec("cd /root/up && sha256sum a/b/data.bin && readlink link")
        want = hashlib.sha256((src / "a" / "b" / "data.bin").read_bytes()).hexdigest()
        assert got.stdout.split()[0] == want and got.stdout.split()[-1] == "top.txt"

        back = await sb.files.download_dir("/root/up", tmp_path / "back")
        assert back.entries == 5
        assert (tmp_path / "back" / "a" / "b" / "data.bin").read_bytes() == (
            src / "a" / "b" / "data.bin"
        ).read_bytes()
        assert os.readlink(tmp_path / "back" / "link") == "top.txt"
    finally:
        await sb.close()

    def blocking() -> None:
        sbs = Sandbox.connect(sid, base_url=str(api.base_url), api_key=API_KEY)
        try:
            with sbs.files.watch("/root/up", recursive=True) as w:
                sbs.exec("echo more >> /root/up/a/b/data.bin")
                event = next(w)
                assert (event.type, event.path) == ("modified", "/root/up/a/b/data.bin")
            assert sbs.files.upload_dir(src, "/root/up2").entries == 5
            assert sbs.files.download_dir("/root/up2", tmp_path / "back2").entries == 5
            assert (tmp_path / "back2" / "top.txt").read_text() == "top\n"
        finally:
            sbs.close()

    await asyncio.to_thread(blocking)


async def test_cli_cp_recursive_and_watch(api: httpx.AsyncClient, sid: str, tmp_path: Any) -> None:
    from click.testing import CliRunner

    from hutch.cli._env import CliEnv
    from hutch.cli.main import cli
    from tests.component.conftest import API_KEY

    env = CliEnv(url=str(api.base_url), api_key=API_KEY)

    def invoke(*argv: str) -> Any:
        return CliRunner().invoke(cli, list(argv), obj=env)

    src = tmp_path / "proj"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("x = 1\n")
    (src / "README").write_text("hello\n")

    result = await asyncio.to_thread(invoke, "cp", str(src), f"{sid}:/root/in")
    assert result.exit_code == 1 and "-r" in result.stderr
    result = await asyncio.to_thread(invoke, "cp", "-r", str(src), f"{sid}:/root/in")
    assert result.exit_code == 0, result.output
    assert await sh(api, sid, "cat /root/in/pkg/mod.py") == "x = 1\n"
    # Onto an existing directory: copied inside it, like cp -r.
    result = await asyncio.to_thread(invoke, "cp", "-r", str(src), f"{sid}:/root/in")
    assert result.exit_code == 0
    assert await sh(api, sid, "cat /root/in/proj/README") == "hello\n"

    result = await asyncio.to_thread(invoke, "cp", "-r", f"{sid}:/root/in", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "proj" / "pkg" / "mod.py").read_text() == "x = 1\n"
    result = await asyncio.to_thread(invoke, "cp", f"{sid}:/root/in", str(tmp_path / "f"))
    assert result.exit_code == 1 and "-r" in result.stderr

    # hutch watch ends by itself when the directory is deleted.
    await sh(api, sid, "mkdir -p /root/cw")
    task = asyncio.create_task(asyncio.to_thread(invoke, "watch", sid, "/root/cw", "--json"))
    await asyncio.sleep(2.0)  # the CLI's watch is in place well before this
    await sh(api, sid, "touch /root/cw/a && rm -r /root/cw")
    result = await asyncio.wait_for(task, 20)
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in result.stdout.splitlines()]
    assert ("created", "/root/cw/a") in [(e["type"], e["path"]) for e in lines]
