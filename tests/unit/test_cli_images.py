"""`hutch image import|pull|rm` and the SDK calls under them, against a mock daemon that
answers like routes/images.py (NDJSON progress, then the image or an error line)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result

from hutch.cli._env import CliEnv
from hutch.cli.main import cli
from hutch.errors import Conflict, InvalidImage
from hutch.sdk import Client, ImageProgress

IMAGE = {
    "name": "app",
    "description": "imported from oci-archive app.tar",
    "built": True,
    "digest": "sha256:" + "ab" * 32,
    "size_bytes": 80 << 20,
    "kernel_release": "6.1.0",
    "source": {"type": "archive", "format": "oci-archive", "filename": "app.tar"},
    "config": {"env": {"A": "1"}, "working_dir": "/srv", "user": "app", "entrypoint": [],
               "cmd": ["serve"], "exposed_ports": ["8080/tcp"]},
    "start": True,
    "created_at": "2025-01-01T00:00:00+00:00",
}  # fmt: skip


class Daemon:
    def __init__(self, fail: dict[str, Any] | None = None) -> None:
        self.fail = fail
        self.requests: list[httpx.Request] = []
        self.bodies: list[bytes] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        self.bodies.append(request.read())
        if request.method == "DELETE":
            if request.url.path.endswith("/busy"):
                message = "image 'busy' is in use by sandboxes sb-1"
                return httpx.Response(409, json={"error": {"code": "conflict", "message": message}})
            return httpx.Response(204)
        lines = [
            {"type": "progress", "stage": "resolving", "message": "reading"},
            {
                "type": "progress",
                "stage": "layer",
                "message": "layer 1/2",
                "done": 5,
                "total": 10,
                "layer": 1,
                "layers": 2,
            },
        ]
        lines.append(self.fail or {"type": "image", "image": IMAGE})
        body = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
        return httpx.Response(201, content=body, headers={"Content-Type": "application/x-ndjson"})


def run(daemon: Daemon, *args: str, input: str | None = None) -> Result:
    transport = httpx.MockTransport(daemon.handler)
    return CliRunner().invoke(
        cli, ["--api-key", "k", *args], obj=CliEnv(transport=transport), input=input
    )


def test_import_a_file_sends_it_with_name_and_flags(tmp_path: Path) -> None:
    archive = tmp_path / "app.tar"
    archive.write_bytes(b"tar bytes")
    d = Daemon()
    result = run(d, "image", "import", "app", str(archive), "--start", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["digest"] == IMAGE["digest"]
    req = d.requests[0]
    assert (req.method, req.url.path) == ("POST", "/v1/images")
    assert dict(req.url.params) == {"name": "app", "start": "true", "progress": "true"}
    assert req.headers["Content-Type"] == "application/x-tar"
    assert req.headers["X-Hutch-Filename"] == "app.tar"
    assert d.bodies[0] == b"tar bytes"
    assert "app: layer 1/2" in result.stderr


def test_import_a_layout_directory_sends_an_oci_archive(tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    (layout / "blobs/sha256").mkdir(parents=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout / "index.json").write_text("{}")
    (layout / "blobs/sha256" / ("0" * 64)).write_bytes(b"blob" * 100_000)
    d = Daemon()
    assert run(d, "image", "import", "app", str(layout)).exit_code == 0
    sent = tmp_path / "sent.tar"
    sent.write_bytes(d.bodies[0])
    with tarfile.open(sent) as tar:
        names = sorted(tar.getnames())
        blob = tar.extractfile("blobs/sha256/" + "0" * 64)
        assert blob is not None and blob.read() == b"blob" * 100_000
    assert names == ["blobs/sha256/" + "0" * 64, "index.json", "oci-layout"]
    not_layout = tmp_path / "plain"
    not_layout.mkdir()
    bad = run(Daemon(), "image", "import", "app", str(not_layout))
    assert bad.exit_code != 0 and "not an OCI image layout" in bad.stderr


def test_pull_reads_the_password_from_stdin() -> None:
    d = Daemon()
    result = run(
        d, "image", "pull", "app", "127.0.0.1:5000/t/app:1", "-u", "bob", "--password-stdin",
        input="s3cret\n",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(d.bodies[0]) == {
        "name": "app", "ref": "127.0.0.1:5000/t/app:1", "start": False,
        "username": "bob", "password": "s3cret",
    }  # fmt: skip
    assert "s3cret" not in result.output
    usage = run(Daemon(), "image", "pull", "app", "x", "-u", "bob")
    assert usage.exit_code == 2 and "--password-stdin" in usage.stderr


def test_errors_come_back_as_their_classes(tmp_path: Path) -> None:
    archive = tmp_path / "bad.tar"
    archive.write_bytes(b"x")
    fail = {"type": "error", "status": 400, "error": {"code": "invalid_image",
            "message": "layer 1/2: digest mismatch"}}  # fmt: skip
    result = run(Daemon(fail), "image", "import", "bad", str(archive))
    assert result.exit_code == 1 and "digest mismatch" in result.stderr
    client = Client(
        base_url="http://h", api_key="k", transport=httpx.MockTransport(Daemon(fail).handler)
    )
    with pytest.raises(InvalidImage, match="digest mismatch"):
        client.import_image("bad", b"x")
    busy = run(Daemon(), "image", "rm", "busy")
    assert busy.exit_code == 1 and "in use by sandboxes sb-1" in busy.stderr
    with pytest.raises(Conflict):
        client.delete_image("busy")


def test_sdk_reports_progress_and_returns_the_image() -> None:
    seen: list[ImageProgress] = []
    client = Client(
        base_url="http://h", api_key="k", transport=httpx.MockTransport(Daemon().handler)
    )
    info = client.pull_image("app", "t/app", on_progress=seen.append)
    assert info.config == IMAGE["config"] and info.start is True
    assert info.source["format"] == "oci-archive"
    assert [(p.stage, p.layer, p.done, p.total) for p in seen] == [
        ("resolving", None, 0, None), ("layer", 1, 5, 10)
    ]  # fmt: skip


def test_images_table_shows_the_source(tmp_path: Path) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"images": [IMAGE]})

    result = CliRunner().invoke(
        cli, ["--api-key", "k", "images"], obj=CliEnv(transport=httpx.MockTransport(handler))
    )
    row = result.stdout.splitlines()[1].split()
    assert row[:4] == ["app", "yes", "80.0", "MiB"] or row[0] == "app"
    assert "oci-archive:app.tar" in result.stdout


async def test_async_client_streams_a_file_and_reports_progress(tmp_path: Path) -> None:
    from hutch.sdk import AsyncClient

    archive = tmp_path / "app.tar"
    archive.write_bytes(b"z" * (3 << 20))
    d = Daemon()
    seen: list[ImageProgress] = []
    async with AsyncClient(
        base_url="http://h", api_key="k", transport=httpx.MockTransport(d.handler)
    ) as client:
        info = await client.import_image("app", archive, on_progress=seen.append)
        await client.delete_image("app")
    assert info.name == "app" and len(seen) == 2
    assert d.bodies[0] == b"z" * (3 << 20)
    assert d.requests[1].method == "DELETE"


# -- hutch image build NAME -f Dockerfile [CONTEXT] -------------------------------------

BUILD_LINES = [
    {"type": "status", "message": "resolving the base image base"},
    {"type": "step", "message": "Step 1/3 : FROM base", "step": 1, "steps": 3, "line": 1,
     "instruction": "FROM base", "state": "done", "seconds": 0.0},
    {"type": "step", "message": "Step 2/3 : COPY . /app", "step": 2, "steps": 3, "line": 2,
     "instruction": "COPY . /app", "state": "cached", "seconds": 0.01},
    {"type": "step", "message": "Step 3/3 : RUN make", "step": 3, "steps": 3, "line": 3,
     "instruction": "RUN make", "state": "running", "seconds": 0.0},
    {"type": "output", "step": 3, "stream": "stdout", "data": "compiling\n"},
    {"type": "step", "message": "Step 3/3 : RUN make", "step": 3, "steps": 3, "line": 3,
     "instruction": "RUN make", "state": "done", "seconds": 2.5},
]  # fmt: skip


def build_daemon(last: dict[str, Any]) -> Daemon:
    d = Daemon()

    def handler(request: httpx.Request) -> httpx.Response:
        d.requests.append(request)
        d.bodies.append(request.read())
        body = b"".join(json.dumps(x).encode() + b"\n" for x in [*BUILD_LINES, last])
        return httpx.Response(201, content=body, headers={"Content-Type": "application/x-ndjson"})

    d.handler = handler  # type: ignore[method-assign]
    return d


def make_context(tmp_path: Path) -> Path:
    ctx = tmp_path / "ctx"
    (ctx / "src").mkdir(parents=True)
    (ctx / "src/main.py").write_text("print(1)\n")
    (ctx / "node_modules/x").mkdir(parents=True)
    (ctx / "node_modules/x/big.js").write_text("x" * 1000)
    (ctx / "secret.env").write_text("TOKEN=1\n")
    (ctx / "keep.env").write_text("A=1\n")
    (ctx / ".dockerignore").write_text("node_modules\n*.env\n!keep.env\nDockerfile\n")
    (ctx / "Dockerfile").write_text("FROM base\nCOPY . /app\nRUN make\n")
    (ctx / "link").symlink_to("/etc/passwd")
    return ctx


def sent_names(body: bytes, tmp_path: Path) -> dict[str, tarfile.TarInfo]:
    sent = tmp_path / "sent.tar"
    sent.write_bytes(body)
    with tarfile.open(sent) as tar:
        return {m.name: m for m in tar.getmembers()}


def test_build_sends_the_context_without_ignored_files(tmp_path: Path) -> None:
    ctx = make_context(tmp_path)
    d = build_daemon({"type": "image", "image": IMAGE})
    result = run(
        d, "image", "build", "app", str(ctx), "--build-arg", "V=1.2", "--egress", "pypi.org",
        "--egress", "*.pythonhosted.org", "--no-cache", "--vcpus", "2", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["name"] == "app"
    req = d.requests[0]
    assert req.headers["Content-Type"] == "application/x-tar"
    assert req.url.params.get_list("egress") == ["pypi.org", "*.pythonhosted.org"]
    assert req.url.params.get_list("build_arg") == ["V=1.2"]
    assert {k: req.url.params[k] for k in ("name", "dockerfile", "no_cache", "vcpus")} == {
        "name": "app", "dockerfile": "Dockerfile", "no_cache": "true", "vcpus": "2"
    }  # fmt: skip
    names = sent_names(d.bodies[0], tmp_path)
    # .dockerignore'd files stay home; the Dockerfile and .dockerignore always go.
    assert set(names) == {".dockerignore", "Dockerfile", "keep.env", "link", "src", "src/main.py"}
    assert names["link"].issym() and names["link"].linkname == "/etc/passwd"
    log = result.stderr
    assert "Step 1/3 : FROM base" in log and "Step 2/3 : COPY . /app\n ---> cached" in log
    assert "Step 3/3 : RUN make\ncompiling\n ---> done in 2.5s" in log


def test_build_with_a_dockerfile_outside_the_context(tmp_path: Path) -> None:
    ctx = make_context(tmp_path)
    other = tmp_path / "build.Dockerfile"
    other.write_text("FROM base\n")
    d = build_daemon({"type": "image", "image": IMAGE})
    result = run(d, "image", "build", "app", "-f", str(other), str(ctx), "-q")
    assert result.exit_code == 0, result.output
    assert d.requests[0].url.params["dockerfile"] == ".hutch/Dockerfile"
    names = sent_names(d.bodies[0], tmp_path)
    assert ".hutch/Dockerfile" in names and "compiling" not in result.stderr


def test_build_forms_are_unambiguous(tmp_path: Path) -> None:
    unknown = run(Daemon(), "image", "build", "myapp")
    assert unknown.exit_code == 2
    assert "not a built-in image" in unknown.stderr and "-f Dockerfile" in unknown.stderr
    flags = run(Daemon(), "image", "build", "base", "--no-cache")
    assert flags.exit_code == 2 and "--no-cache apply to Dockerfile builds" in flags.stderr
    ctx = make_context(tmp_path)
    force = run(Daemon(), "image", "build", "app", str(ctx), "--force")
    assert force.exit_code == 2 and "--no-cache" in force.stderr
    bad_arg = run(Daemon(), "image", "build", "app", str(ctx), "--build-arg", "novalue")
    assert bad_arg.exit_code == 2 and "NAME=VALUE" in bad_arg.stderr


def test_a_failed_build_is_its_error(tmp_path: Path) -> None:
    from hutch.errors import BuildFailed

    message = "Dockerfile line 3: RUN make: failed with exit code 2; the end of its output:\nboom"
    fail = {"type": "error", "status": 422, "error": {"code": "build_failed", "message": message}}
    ctx = make_context(tmp_path)
    result = run(build_daemon(fail), "image", "build", "app", str(ctx))
    assert result.exit_code == 1 and "exit code 2" in result.stderr and "boom" in result.stderr
    client = Client(
        base_url="http://h", api_key="k", transport=httpx.MockTransport(build_daemon(fail).handler)
    )
    seen: list[object] = []
    with pytest.raises(BuildFailed, match="line 3: RUN make"):
        client.build_image("app", ctx, on_progress=seen.append)
    assert [getattr(e, "state", None) for e in seen][1:4] == ["done", "cached", "running"]
