"""Protocol v1 framing, flow control and path policy (pure; milliseconds)."""

from __future__ import annotations

import asyncio
import os
import random
import struct
import sys
import zlib
from pathlib import Path
from types import ModuleType

import pytest

from hutch.errors import Conflict, GuestError, InvalidArgument, NotFound
from hutch.guest._stream import StreamState
from hutch.guest.commands import command_header, program_fields
from hutch.guest.paths import normalize_guest_path
from hutch.guest.protocol import (
    CHANNEL_STDERR,
    CHUNK,
    HEADER,
    MAGIC,
    MAX_FRAME,
    WINDOW,
    Decoder,
    Frame,
    FrameType,
    ReceiveWindow,
    SendWindow,
    encode_frame,
)
from hutch.guest.results import error_from_wire

AGENT_DIR = Path(__file__).resolve().parents[2] / "guest_agent"


@pytest.fixture(scope="module")
def agent_module() -> ModuleType:
    """The agent's modules under one namespace, imported as the guest imports them."""
    sys.path.insert(0, str(AGENT_DIR))
    try:
        import hutch_agent
        from hutch_agent import errors, framing, paths
    finally:
        sys.path.remove(str(AGENT_DIR))
    merged = ModuleType("hutch_agent_under_test")
    for module in (hutch_agent, framing, errors, paths):
        merged.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    return merged


SAMPLE = [
    Frame(FrameType.REQUEST, 0, {"op": "hello", "nonce": "abc", "protocol": [1, 0]}),
    Frame(FrameType.DATA, 7, {}, b"\x00\x89HUT binary \xff" * 100, CHANNEL_STDERR),
    Frame(FrameType.CREDIT, 7, {"n": 8}),
    Frame(FrameType.EOF, 0xFFFFFFFF),
    Frame(FrameType.END, 3, {"exit_code": 0, "unicode": "é✓"}),
]


def test_round_trip_each_type() -> None:
    for frame in SAMPLE:
        decoder = Decoder()
        assert decoder.feed(encode_frame(frame)) == [frame]
        assert decoder.buffered == 0
        assert decoder.pop_errors() == []


def test_split_feeds_at_every_byte_boundary() -> None:
    wire = b"".join(encode_frame(f) for f in SAMPLE)
    for cut in range(len(wire) + 1):
        decoder = Decoder()
        got = decoder.feed(wire[:cut]) + decoder.feed(wire[cut:])
        assert got == SAMPLE, f"cut at {cut}"
    decoder = Decoder()
    got = [f for i in range(len(wire)) for f in decoder.feed(wire[i : i + 1])]
    assert got == SAMPLE


def test_garbage_before_between_and_stray_magic_is_skipped() -> None:
    rng = random.Random(1)
    garbage = bytes(rng.randrange(256) for _ in range(3000)) + MAGIC + b"\x01\x02" + MAGIC
    # A cut-off frame tail, as an earlier connection can leave in QEMU's buffers.
    tail = encode_frame(SAMPLE[1])[10:]
    wire = garbage + encode_frame(SAMPLE[0]) + tail + encode_frame(SAMPLE[4])
    decoder = Decoder()
    assert decoder.feed(wire) == [SAMPLE[0], SAMPLE[4]]
    assert decoder.skipped >= len(garbage)
    assert decoder.pop_errors() == []


def test_oversize_frames_are_refused_and_the_decoder_resyncs() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        encode_frame(Frame(FrameType.DATA, 1, payload=b"x" * MAX_FRAME))
    prefix = struct.pack(">4sBBHIII", MAGIC, FrameType.DATA, 0, 0, 9, 0, MAX_FRAME)
    bogus = prefix + struct.pack(">I", zlib.crc32(prefix)) + b"y" * 100
    decoder = Decoder()
    assert decoder.feed(bogus + encode_frame(SAMPLE[2])) == [SAMPLE[2]]
    errors = decoder.pop_errors()
    assert len(errors) == 1 and errors[0].stream == 9 and "exceeds" in errors[0].message


def _raw(ftype: int, stream: int, head: bytes, payload: bytes = b"") -> bytes:
    prefix = struct.pack(">4sBBHIII", MAGIC, ftype, 0, 0, stream, len(head), len(payload))
    return prefix + struct.pack(">I", zlib.crc32(prefix)) + head + payload


def test_bad_header_and_unknown_type_report_errors_and_continue() -> None:
    wire = (
        _raw(FrameType.REQUEST, 4, b"{not json")
        + _raw(FrameType.REQUEST, 5, b"[1, 2]")
        + _raw(99, 6, b"")
        + encode_frame(SAMPLE[0])
    )
    decoder = Decoder()
    assert decoder.feed(wire) == [SAMPLE[0]]
    errors = decoder.pop_errors()
    assert [e.stream for e in errors] == [4, 5, 6]
    assert "not JSON" in errors[0].message and "unknown frame type" in errors[2].message


def test_corrupt_header_crc_is_skipped() -> None:
    good = bytearray(encode_frame(SAMPLE[2]))
    good[9] ^= 0xFF  # stream id byte: CRC no longer matches
    decoder = Decoder()
    assert decoder.feed(bytes(good) + encode_frame(SAMPLE[0])) == [SAMPLE[0]]


def test_send_window() -> None:
    window = SendWindow(2)
    window.consume()
    window.consume()
    assert window.available == 0
    with pytest.raises(RuntimeError):
        window.consume()
    window.grant(3)
    assert window.available == 3


def test_receive_window_grants_in_half_window_batches() -> None:
    window = ReceiveWindow(16)
    grants = [window.consumed() for _ in range(32)]
    assert grants.count(8) == 4 and sum(grants) == 32
    assert grants[:7] == [0] * 7


async def test_upload_stops_at_zero_credit_and_resumes_on_credit() -> None:
    sent: list[Frame] = []

    async def drain() -> None:
        return None

    state = StreamState(5, sent.append, drain)
    data = os.urandom(CHUNK * (WINDOW + 4) + 10)
    task = asyncio.create_task(state.upload(data))
    await asyncio.sleep(0.01)
    assert len(sent) == WINDOW and not task.done()
    state.deliver(Frame(FrameType.CREDIT, 5, {"n": 3}))
    await asyncio.sleep(0.01)
    assert len(sent) == WINDOW + 3 and not task.done()
    state.deliver(Frame(FrameType.CREDIT, 5, {"n": 8}))
    await asyncio.wait_for(task, 1)
    assert sent[-1].type is FrameType.EOF
    assert b"".join(f.payload for f in sent) == data
    assert all(len(f.payload) <= CHUNK for f in sent)


async def test_upload_stops_quietly_when_the_agent_ends_the_stream() -> None:
    sent: list[Frame] = []

    async def drain() -> None:
        return None

    state = StreamState(5, sent.append, drain)
    task = asyncio.create_task(state.upload(b"x" * CHUNK * (WINDOW + 1)))
    await asyncio.sleep(0.01)
    state.deliver(Frame(FrameType.ERROR, 5, {"code": "io_error", "message": "disk full"}))
    await asyncio.wait_for(task, 1)
    assert len(sent) == WINDOW  # no EOF after the agent gave up
    with pytest.raises(GuestError, match="disk full"):
        await state.expect_end()


async def test_consuming_data_returns_credit() -> None:
    sent: list[Frame] = []

    async def drain() -> None:
        return None

    state = StreamState(2, sent.append, drain)
    for _ in range(WINDOW):
        state.deliver(Frame(FrameType.DATA, 2, payload=b"a"))
    assert sent == []  # nothing consumed yet: the agent must stop after WINDOW frames
    for _ in range(WINDOW):
        await state.next()
    assert [f.header["n"] for f in sent] == [WINDOW // 2, WINDOW // 2]


async def test_connection_lost_fails_waiters() -> None:
    async def drain() -> None:
        return None

    state = StreamState(2, lambda f: None, drain)
    waiter = asyncio.create_task(state.next())
    await asyncio.sleep(0)
    state.connection_lost()
    with pytest.raises(GuestError, match="connection closed"):
        await waiter
    with pytest.raises(GuestError, match="connection closed"):
        await state.next()


def test_error_codes_map_to_hutch_errors() -> None:
    assert isinstance(error_from_wire({"code": "not_found", "message": "m"}), NotFound)
    assert isinstance(error_from_wire({"code": "exists", "message": "m"}), Conflict)
    assert isinstance(error_from_wire({"code": "not_empty", "message": "m"}), Conflict)
    for code in (
        "invalid_argument",
        "is_a_directory",
        "command_not_found",
        "permission_denied",
        "not_a_directory",
    ):
        assert isinstance(error_from_wire({"code": code, "message": "m"}), InvalidArgument)
    err = error_from_wire({"code": "io_error", "message": "disk full"})
    assert type(err) is GuestError and "disk full" in err.message


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/etc/hosts", "/etc/hosts"),
        ("/a//b/./c/../d", "/a/b/d"),
        ("//x", "/x"),
        ("notes.txt", "/root/notes.txt"),
        ("a/../b", "/root/b"),
        (".", "/root"),
        ("/procfs/x", "/procfs/x"),
        ("/", "/"),
    ],
)
def test_paths_accepted(path: str, expected: str) -> None:
    assert normalize_guest_path(path) == expected


@pytest.mark.parametrize(
    "path",
    [
        "",
        "a\0b",
        "/proc",
        "/proc/sysrq-trigger",
        "/sys/kernel",
        "/dev/zero",
        "/x/../dev/sda",
        "..",
        "../etc/passwd",
        "a/../../x",
        "/" + "a" * 4096,
    ],
)
def test_paths_refused(path: str) -> None:
    with pytest.raises(InvalidArgument):
        normalize_guest_path(path)


def test_relative_paths_use_the_home_parameter() -> None:
    assert normalize_guest_path("x/y", home="/home/u") == "/home/u/x/y"
    with pytest.raises(InvalidArgument, match="climbs above /home/u"):
        normalize_guest_path("../v", home="/home/u")


def test_agent_mirror_agrees_with_the_host(agent_module: ModuleType) -> None:
    for frame in SAMPLE:
        wire = agent_module.encode(
            int(frame.type), frame.stream, frame.header, frame.payload, frame.channel
        )
        assert wire == encode_frame(frame)
        decoded = agent_module.Decoder().feed(wire)
        assert [(f.type, f.sid, f.header, f.payload, f.channel) for f in decoded] == [
            (int(frame.type), frame.stream, frame.header, frame.payload, frame.channel)
        ]
    assert agent_module.PROTOCOL_VERSION == (1, 0)
    assert (agent_module.MAX_FRAME, agent_module.CHUNK, agent_module.WINDOW) == (
        MAX_FRAME,
        CHUNK,
        WINDOW,
    )
    for path in ["/etc/hosts", "/a//b/./c/../d", "//x", "notes.txt", "a/../b", "."]:
        assert agent_module.normalize(path) == normalize_guest_path(path)
    for path in ["", "/proc/1", "/dev/zero", "../x", "a\0b"]:
        with pytest.raises(agent_module.AgentError):
            agent_module.normalize(path)


def _as_tuples(frames: list[object]) -> list[tuple[object, ...]]:
    return [(f.type, f.sid, f.header, f.payload, f.channel) for f in frames]  # type: ignore[attr-defined]


def test_agent_drops_a_stale_frame_head_only_for_a_new_hello(agent_module: ModuleType) -> None:
    """A frame head left by a host that reconnected unseen would swallow the new host's
    hello: the agent skips to a hello found inside it, and only then (a slow host's
    frame is kept whole however long it takes)."""
    stale_head = encode_frame(SAMPLE[1])[: HEADER.size + 5]
    decoder = agent_module.Decoder()
    assert decoder.feed(stale_head + encode_frame(SAMPLE[2])) == []
    assert decoder.skip_to_hello() is None, "no hello: the frame is only slow"
    hello = SAMPLE[0]
    assert decoder.feed(encode_frame(hello)) == []
    resumed = decoder.skip_to_hello()
    assert resumed is not None
    assert _as_tuples(resumed) == [
        (int(hello.type), hello.stream, hello.header, hello.payload, hello.channel)
    ]
    assert decoder.pending == 0

    slow = agent_module.Decoder()
    whole = encode_frame(SAMPLE[1])
    assert slow.feed(whole[:100]) == []
    assert slow.skip_to_hello() is None
    data = SAMPLE[1]
    assert _as_tuples(slow.feed(whole[100:])) == [
        (int(data.type), data.stream, data.header, data.payload, data.channel)
    ]


def test_commands_and_terminals_share_what_to_run_and_how() -> None:
    """``exec``/``proc_start`` headers and a terminal's take argv, shell, env, cwd and
    user through one check (program_fields); only the argv-or-shell rule differs."""
    header = command_header(
        "exec", ["ls", "-l"], None, {"A": "1"}, "work/../src", "nobody", 5, stdin=True
    )
    assert header == {
        "op": "exec", "stdin": True, "argv": ["ls", "-l"], "env": {"A": "1"},
        "cwd": "/root/src", "user": "nobody", "timeout_s": 5,
    }  # fmt: skip
    assert command_header("exec", None, "echo hi", None, None, None, None, stdin=False) == {
        "op": "exec", "stdin": False, "shell": "echo hi",
    }  # fmt: skip
    assert program_fields(None, None, None, None, None) == {}  # a terminal's login shell
    for argv in ([], ["ok", 1]):
        with pytest.raises(InvalidArgument, match="non-empty list of strings"):
            program_fields(argv, None, None, None, None)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="non-empty list of strings"):
            command_header("exec", argv, None, None, None, None, None, stdin=False)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="exactly one of argv"):
        command_header("exec", None, None, None, None, None, None, stdin=False)
    with pytest.raises(InvalidArgument, match="climbs above"):
        program_fields(["ls"], None, None, "../..", None)
    with pytest.raises(InvalidArgument, match="positive"):
        command_header("exec", ["ls"], None, None, None, None, 0, stdin=False)
