"""The sync SDK against the in-memory fake of the REST contract (hutch.testing)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import httpx
import pytest

import hutch
from hutch import Sandbox
from hutch.errors import Conflict, InvalidArgument, NotFound, StateError, Timeout, UnknownImage
from hutch.sdk import (
    Client,
    ClientClosed,
    DaemonUnreachable,
    ExecExit,
    ExecOutput,
    ProtocolError,
    SandboxInfo,
)
from hutch.testing import FakeHutch, FakeRun


@pytest.fixture
def fake() -> FakeHutch:
    return FakeHutch()


@pytest.fixture
def client(fake: FakeHutch) -> Iterator[Client]:
    with Client(api_key=fake.api_key, transport=fake.transport) as c:
        yield c


@pytest.fixture
def sb(fake: FakeHutch) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(api_key=fake.api_key, transport=fake.transport)
    yield sandbox
    sandbox.kill()
    sandbox.close()


def _body(request: httpx.Request) -> object:
    return json.loads(request.content)


def test_create_sends_the_spec_and_returns_a_running_sandbox(fake: FakeHutch) -> None:
    sb = Sandbox.create(
        "base",
        vcpus=2,
        memory_mib=1024,
        disk_gib=8,
        env={"A": "1"},
        metadata={"team": "x"},
        name="web",
        timeout_s=60,
        api_key=fake.api_key,
        transport=fake.transport,
    )
    try:
        request = fake.requests[-1]
        assert (request.method, request.url.path) == ("POST", "/v1/sandboxes")
        assert request.headers["authorization"] == "Bearer test-key"
        assert _body(request) == {
            "image": "base",
            "vcpus": 2,
            "memory_mib": 1024,
            "disk_gib": 8,
            "env": {"A": "1"},
            "metadata": {"team": "x"},
            "name": "web",
            "timeout_s": 60,
        }
        assert sb.id.startswith("sb-")
        assert sb.info.state == "running"
        assert sb.info.metadata == {"team": "x"}
        assert sb.info.created_at is not None and sb.info.created_at.tzinfo is not None
        # create waits for a boot: its read timeout is the long `create` one, not `read`.
        assert request.extensions["timeout"]["read"] == 600.0
    finally:
        sb.kill()
        sb.close()


def test_context_manager_kills_on_exit_and_kill_is_idempotent(fake: FakeHutch) -> None:
    with Sandbox.create(api_key=fake.api_key, transport=fake.transport) as sb:
        sid = sb.id
    assert fake.sandboxes[sid].state == "destroyed"
    sb.kill()  # already killed: nothing to do
    with pytest.raises(ClientClosed, match=r"Sandbox\.connect"):
        sb.refresh()
    with Sandbox.connect(sid, api_key=fake.api_key, transport=fake.transport) as again:
        del fake.sandboxes[sid]  # the daemon forgot it entirely: 404 is still "killed"
        again.kill()


def test_connect_refresh_and_list(fake: FakeHutch, client: Client) -> None:
    fake.add_sandbox(metadata={"team": "a"})
    other = fake.add_sandbox(metadata={"team": "b"})
    sb = Sandbox.connect(other.id, client=client)
    assert sb.info.metadata == {"team": "b"}
    other.state = "stopping"
    assert sb.refresh().state == "stopping"
    listed = Sandbox.list(metadata={"team": "a"}, client=client)
    assert [s.metadata for s in listed] == [{"team": "a"}]
    assert fake.requests[-1].url.params.get_list("metadata") == ["team=a"]
    assert Sandbox.list(state="stopping", client=client)[0].id == other.id
    with pytest.raises(NotFound, match="sb-nope"):
        Sandbox.connect("sb-nope", client=client)


def test_exec_returns_the_result(fake: FakeHutch, sb: Sandbox) -> None:
    fake.exec_handler = lambda s, body: FakeRun(
        [("stdout", "a"), ("stderr", "warn"), ("stdout", "b")], exit_code=3, duration_ms=12
    )
    result = sb.exec(
        ["ls", "-l"], env={"X": "1"}, cwd="/tmp", user="nobody", stdin="in", timeout_s=5
    )
    assert (result.exit_code, result.signal, result.stdout, result.stderr) == (
        3,
        None,
        "ab",
        "warn",
    )
    assert result.duration_ms == 12 and not result.ok
    assert _body(fake.requests[-1]) == {
        "cmd": ["ls", "-l"],
        "stream": False,
        "env": {"X": "1"},
        "cwd": "/tmp",
        "user": "nobody",
        "stdin": "in",
        "timeout_s": 5,
    }
    # The HTTP wait outlasts the command's own bound instead of cutting it short.
    assert fake.requests[-1].extensions["timeout"]["read"] == 65.0


def test_exec_string_goes_to_the_shell_and_has_no_read_limit(fake: FakeHutch, sb: Sandbox) -> None:
    sb.exec("echo $HOME | wc -c")
    assert _body(fake.requests[-1])["cmd"] == "echo $HOME | wc -c"  # type: ignore[index]
    assert fake.requests[-1].extensions["timeout"]["read"] is None


def test_exec_with_callbacks_streams(fake: FakeHutch, sb: Sandbox) -> None:
    fake.exec_handler = lambda s, body: FakeRun(
        [("stdout", "one\n"), ("stderr", "oops\n"), ("stdout", "two\n")],
        exit_code=None,
        signal=9,
    )
    seen: list[tuple[str, str]] = []
    result = sb.exec(
        "x",
        on_stdout=lambda d: seen.append(("out", d)),
        on_stderr=lambda d: seen.append(("err", d)),
    )
    assert seen == [("out", "one\n"), ("err", "oops\n"), ("out", "two\n")]
    assert (result.exit_code, result.signal, result.stdout, result.stderr) == (
        None,
        9,
        "one\ntwo\n",
        "oops\n",
    )
    assert _body(fake.requests[-1])["stream"] is True  # type: ignore[index]


def test_exec_stream_yields_output_then_exit(fake: FakeHutch, sb: Sandbox) -> None:
    fake.exec_handler = lambda s, body: FakeRun(
        [("stdout", "héllo\n"), ("stderr", "e")], exit_code=0
    )
    events = list(sb.exec_stream(["run"]))
    assert events == [
        ExecOutput("stdout", "héllo\n"),
        ExecOutput("stderr", "e"),
        ExecExit(exit_code=0, signal=None, duration_ms=7),
    ]


def test_exec_stream_is_lazy_and_reports_errors_on_iteration(fake: FakeHutch, sb: Sandbox) -> None:
    count = len(fake.requests)
    stream = sb.exec_stream("x")
    assert len(fake.requests) == count  # nothing sent until iterated
    stream.close()
    assert list(stream) == []
    fake.sandboxes[sb.id].state = "stopping"
    with pytest.raises(StateError, match="stopping"):
        next(iter(sb.exec_stream("x")))


def test_exec_timeout_raises_timeout_streamed_or_not(fake: FakeHutch, sb: Sandbox) -> None:
    fake.exec_handler = lambda s, body: FakeRun(
        [("stdout", "partial")], error=("timeout", "ran longer than 1 s")
    )
    with pytest.raises(Timeout, match="ran longer than 1 s"):
        sb.exec("sleep 9", timeout_s=1)
    seen: list[str] = []
    with pytest.raises(Timeout, match="ran longer"):
        sb.exec("sleep 9", timeout_s=1, on_stdout=seen.append)
    assert seen == ["partial"]  # output before the error still arrived


def test_exec_rejects_bad_arguments_before_sending(fake: FakeHutch, sb: Sandbox) -> None:
    count = len(fake.requests)
    with pytest.raises(InvalidArgument, match="cmd"):
        sb.exec([])
    with pytest.raises(InvalidArgument, match="cmd"):
        sb.exec("   ")
    with pytest.raises(InvalidArgument, match="timeout_s"):
        sb.exec("true", timeout_s=0)
    assert len(fake.requests) == count


def test_files_round_trip_every_source_kind(fake: FakeHutch, sb: Sandbox) -> None:
    assert sb.files.write("a.txt", b"bytes").path == "/root/a.txt"
    assert sb.files.read("/root/a.txt") == b"bytes"
    sb.files.write("s.txt", "snowman ☃")
    assert sb.files.read("s.txt") == "snowman ☃".encode()
    big = bytes(range(256)) * 10_000  # 2.5 MB: several upload chunks
    written = sb.files.write("big.bin", io.BytesIO(big), mode=0o600)
    assert written.size == len(big)
    assert fake.sandboxes[sb.id].modes["/root/big.bin"] == 0o600
    assert fake.requests[-1].url.params["mode"] == "0600"
    sb.files.write("gen.bin", (bytes([i]) * 10 for i in range(3)))
    assert sb.files.read("gen.bin") == b"\0" * 10 + b"\1" * 10 + b"\2" * 10
    sb.files.write("text.txt", io.StringIO("from a text file"))
    assert sb.files.read("text.txt") == b"from a text file"


def test_read_stream_yields_chunks(fake: FakeHutch, sb: Sandbox) -> None:
    fake.download_chunk = 4
    sb.files.write("f", b"0123456789")
    with sb.files.read_stream("f") as chunks:
        assert list(chunks) == [b"0123", b"4567", b"89"]
    with pytest.raises(NotFound, match="no such file"):
        list(sb.files.read_stream("missing"))


def test_file_operations(fake: FakeHutch, sb: Sandbox) -> None:
    d = sb.files.mkdir("/work/sub")
    assert (d.path, d.type, d.is_dir) == ("/work/sub", "dir", True)
    sb.files.write("/work/sub/x", b"12345", mode=0o755)
    entry = sb.files.stat("/work/sub/x")
    assert (entry.name, entry.size, entry.mode, entry.type) == ("x", 5, 0o755, "file")
    assert [e.name for e in sb.files.list("/work")] == ["sub"]
    moved = sb.files.rename("/work/sub/x", "/work/y")
    assert moved.path == "/work/y"
    assert [e.path for e in sb.files.list("/work")] == ["/work/sub", "/work/y"]
    sb.files.write("/work/sub/z", b"")
    with pytest.raises(Conflict, match="not empty"):
        sb.files.remove("/work/sub")
    sb.files.remove("/work/sub", recursive=True)
    assert fake.requests[-1].url.params["recursive"] == "true"
    sb.files.remove("/work/y")
    assert sb.files.list("/work") == []
    with pytest.raises(NotFound):
        sb.files.stat("/work/y")


def test_write_rejects_bad_mode_and_source(sb: Sandbox) -> None:
    with pytest.raises(InvalidArgument, match="mode"):
        sb.files.write("x", b"", mode=0o17777)
    with pytest.raises(InvalidArgument, match="cannot upload"):
        sb.files.write("x", 42)  # type: ignore[arg-type]


def test_create_errors_are_typed(fake: FakeHutch) -> None:
    with pytest.raises(UnknownImage, match="unknown image 'nope'"):
        Sandbox.create("nope", api_key=fake.api_key, transport=fake.transport)
    with pytest.raises(InvalidArgument, match="vcpus"):
        Sandbox.create(vcpus=99, api_key=fake.api_key, transport=fake.transport)


def test_wrong_key_is_unauthorized(fake: FakeHutch) -> None:
    with pytest.raises(hutch.Unauthorized, match="API key"):
        Sandbox.list(api_key="wrong", transport=fake.transport)


def test_connection_refused_says_how_to_start_the_daemon() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    with pytest.raises(DaemonUnreachable) as info:
        Sandbox.create(
            api_key="k", base_url="http://127.0.0.1:1", transport=httpx.MockTransport(refuse)
        )
    message = str(info.value)
    assert "http://127.0.0.1:1" in message
    assert "make up" in message and "hutch daemon" in message
    assert isinstance(info.value, hutch.HutchError)


def test_read_timeout_is_a_timeout() -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    with pytest.raises(Timeout, match="http_timeout"):
        Sandbox.list(api_key="k", transport=httpx.MockTransport(slow))


def test_a_non_hutch_answer_is_a_protocol_error() -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(200, text="<html>"))
    with pytest.raises(ProtocolError, match="not JSON"):
        Sandbox.list(api_key="k", transport=transport)
    shape = httpx.MockTransport(lambda r: httpx.Response(200, json={"sandboxes": [{"id": 1}]}))
    with pytest.raises(ProtocolError, match="'id'"):
        Sandbox.list(api_key="k", transport=shape)


def test_truncated_exec_stream_is_a_protocol_error(fake: FakeHutch, sb: Sandbox) -> None:
    line = json.dumps({"type": "stdout", "data": "x"}).encode() + b"\n"
    transport = httpx.MockTransport(lambda r: httpx.Response(200, content=line))
    with (
        Client(api_key="k", transport=transport) as c,
        pytest.raises(ProtocolError, match="before the command's exit"),
    ):
        list(c.exec_stream(sb.id, "x"))


def test_sandbox_info_round_trips_to_the_api_form(fake: FakeHutch) -> None:
    raw = fake.add_sandbox(name="n", metadata={"k": "v"}, timeout_s=5).to_json()
    info = SandboxInfo.from_dict(raw)
    assert info.to_dict() == raw


def test_ids_are_quoted_in_urls(fake: FakeHutch, client: Client) -> None:
    with pytest.raises(NotFound):
        client.get_sandbox("../images")
    assert fake.requests[-1].url.raw_path == b"/v1/sandboxes/..%2Fimages"


def test_health_needs_no_key(
    fake: FakeHutch, monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.delenv("HUTCH_API_KEY", raising=False)
    monkeypatch.setenv("HUTCH_STATE_DIR", str(tmp_path))
    with Client(transport=fake.transport) as c:
        health = c.health()
    assert (health.status, health.version, health.accel) == ("ok", "0.1.0", "tcg")
    assert "authorization" not in fake.requests[-1].headers


def test_a_download_cut_short_raises_instead_of_ending_early() -> None:
    """The daemon aborts a download it cannot finish (tests/component/test_inflight.py);
    the SDK turns the incomplete body into an error, never into fewer bytes."""
    from hutch.sdk import DaemonUnreachable

    class Cut(httpx.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            yield b"x" * 1000
            raise httpx.RemoteProtocolError("incomplete chunked read")

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Cut())

    with Client(api_key="k", transport=httpx.MockTransport(handler)) as c:
        got = bytearray()
        with pytest.raises(DaemonUnreachable, match="broke off before it was complete"):
            for chunk in c.read_file_stream("sb-0123456789ab", "/root/f"):
                got += chunk
    assert len(got) == 1000
