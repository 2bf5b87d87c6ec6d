"""The shared-volume protocol's codec: every byte is a guest's, so malformed input is an
errno (or a skipped frame), never an exception, and nothing unbounded is buffered."""

from __future__ import annotations

import errno
import random
import struct

import pytest

from hutch.storage.sharefs_wire import (
    HELLO,
    MAGIC,
    MAX_FRAME,
    MAX_IO,
    REPLIES,
    REQUESTS,
    Attr,
    DirEntry,
    FrameDecoder,
    Malformed,
    Op,
    Oversize,
    Request,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    frame,
)

_SAMPLE = {"p": b"dir/name", "b": b"\x00\xffdata", "I": 0o644, "Q": 2**64 - 1, "q": -(2**63)}


def _body(framed: bytes) -> bytes:
    (got,) = FrameDecoder().feed(framed)
    assert isinstance(got, bytes)
    return got


@pytest.mark.parametrize("op", list(Op))
def test_every_request_round_trips(op: Op) -> None:
    args = tuple(_SAMPLE[k] for k in REQUESTS[op])
    got = decode_request(_body(encode_request(7, op, *args)))
    assert got == Request(7, op, args)


def test_replies_round_trip_attrs_and_dir_entries() -> None:
    attr = Attr(1, 0o100644, 1, 1000, 1000, 5, 8, 1, 2, 3)
    assert decode_reply(Op.STAT, _body(encode_reply(3, Op.STAT, 0, attr))) == (3, 0, (attr,))
    entries = (DirEntry(1, 12, 0o40755, b"a"), DirEntry(2, 13, 0o100600, b"b"))
    assert decode_reply(Op.READDIR, _body(encode_reply(4, Op.READDIR, 0, entries))) == (
        4,
        0,
        (entries,),
    )
    assert decode_reply(Op.OPEN, _body(encode_reply(5, Op.OPEN, errno.ENOENT))) == (5, 2, ())
    assert set(REPLIES) == set(REQUESTS) == set(Op)


@pytest.mark.parametrize(
    ("path", "err"),
    [
        (b"/etc/passwd", errno.EINVAL),
        (b"..", errno.EINVAL),
        (b"a/../../etc", errno.EINVAL),
        (b"a/./b", errno.EINVAL),
        (b"a//b", errno.EINVAL),
        (b"a/", errno.EINVAL),
        (b"a\0b", errno.EINVAL),
        (b"x" * 256, errno.ENAMETOOLONG),
        (b"/".join([b"d"] * 2049), errno.ENAMETOOLONG),
    ],
)
def test_paths_that_could_escape_or_overflow_are_errnos(path: bytes, err: int) -> None:
    body = struct.pack("<IH", 9, Op.STAT) + len(path).to_bytes(2, "little") + path
    assert decode_request(body) == Malformed(9, err, decode_request(body).reason)  # type: ignore[union-attr]
    assert isinstance(decode_request(body), Malformed)


def test_unknown_op_short_body_and_trailing_bytes_are_errnos() -> None:
    unknown = decode_request(struct.pack("<IH", 1, 999))
    assert isinstance(unknown, Malformed) and unknown.errno == errno.ENOSYS
    short = decode_request(struct.pack("<IH", 2, Op.READ) + b"\x01\x02")
    assert isinstance(short, Malformed) and short.errno == errno.EPROTO
    good = _body(encode_request(3, Op.RELEASE, 5))
    trailing = decode_request(good + b"x")
    assert isinstance(trailing, Malformed) and trailing.errno == errno.EPROTO
    tiny = decode_request(b"\x01")
    assert isinstance(tiny, Malformed) and tiny.errno == errno.EPROTO


def test_a_data_field_longer_than_max_io_is_refused() -> None:
    n = MAX_IO + 1
    body = struct.pack("<IHQQI", 4, Op.WRITE, 1, 0, n) + b"\0" * n
    got = decode_request(body)
    assert isinstance(got, Malformed) and got.errno == errno.EINVAL


def test_decoder_reassembles_byte_by_byte_and_skips_garbage() -> None:
    stream = (
        b"garbage\x89HUT" + encode_request(1, Op.STATFS) + b"MAG" + encode_request(2, Op.STATFS)
    )
    dec = FrameDecoder()
    got: list[bytes | Oversize] = []
    for i in range(len(stream)):
        got += dec.feed(stream[i : i + 1])
    assert [decode_request(b) for b in got] == [  # type: ignore[arg-type]
        Request(1, Op.STATFS, ()),
        Request(2, Op.STATFS, ()),
    ]
    assert dec.skipped == len(b"garbage\x89HUT") + 3


def test_decoder_discards_an_oversize_frame_without_buffering_it() -> None:
    dec = FrameDecoder()
    huge = MAX_FRAME * 8
    head = MAGIC + huge.to_bytes(4, "little") + b"crc!" + struct.pack("<IH", 77, Op.WRITE)
    out = dec.feed(head)
    assert out == [Oversize(77, huge)]
    chunk = b"\xaa" * 65536
    sent = len(head) - 12
    while sent + len(chunk) <= huge:
        assert dec.feed(chunk) == []
        assert len(dec._buf) <= 12  # nothing of the oversize frame is kept
        sent += len(chunk)
    rest = huge - sent
    after = encode_request(78, Op.STATFS)
    got = dec.feed(b"\xaa" * rest + after)
    assert got == [_body(after)]


def test_decoder_buffers_a_bounded_amount_of_garbage() -> None:
    dec = FrameDecoder()
    for _ in range(64):
        assert dec.feed(b"\x00" * 65536) == []
    assert len(dec._buf) < len(MAGIC)


def test_frame_refuses_to_build_an_oversize_body() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        frame(b"\0" * (MAX_FRAME + 1))


def test_random_bodies_never_raise() -> None:
    rng = random.Random(1234)
    for _ in range(5000):
        n = rng.randrange(0, 64)
        body = struct.pack("<IH", rng.randrange(2**32), rng.choice([*list(Op), 0, 500]))
        body += bytes(rng.randrange(256) for _ in range(n))
        assert isinstance(decode_request(body), Request | Malformed)


def test_mountinfo_parsing_finds_mount_points_with_escapes() -> None:
    from pathlib import Path

    from hutch.storage.shared_mounts import mount_points

    text = (
        "36 35 98:0 / /mnt/a\\040b rw,noatime master:1 - ext4 /dev/loop0 rw\n"
        "37 35 98:0 / /state/shared/v1 rw,nosuid,nodev,noexec - ext4 /dev/loop1 rw\n"
        "garbage\n"
    )
    assert mount_points(text) == [Path("/mnt/a b"), Path("/state/shared/v1")]


def test_a_frame_whose_crc_fails_is_skipped_and_a_frame_inside_it_is_found() -> None:
    # A reconnect cut a reply short: the next session's HELLO and reply complete it.
    # Without the CRC the reader would take those bytes for the cut frame's end.
    cut = encode_reply(9, Op.READ, 0, b"x" * 4000)[:1000]
    after = HELLO + encode_reply(10, Op.STAT, errno.ENOENT)
    dec = FrameDecoder(discard_oversize=False)
    got = dec.feed(cut + after + b"\0" * 4000)
    assert [struct.unpack_from("<Ii", b) for b in got] == [(0, 0), (10, errno.ENOENT)]  # type: ignore[arg-type]


def test_resync_gives_up_on_a_stalled_partial_frame() -> None:
    # A magic and a length inside data that will never be completed: the reader gives
    # up after a stall and finds the frames behind it.
    fake = MAGIC + (60000).to_bytes(4, "little") + b"\0\0\0\0"
    dec = FrameDecoder(discard_oversize=False)
    assert dec.feed(fake + HELLO) == []
    assert dec.pending
    got = dec.resync()
    assert got == [HELLO[12:]]
    assert not dec.pending


def test_without_discard_an_oversize_header_is_garbage() -> None:
    dec = FrameDecoder(discard_oversize=False)
    head = MAGIC + (MAX_FRAME + 1).to_bytes(4, "little") + b"crc!"
    assert dec.feed(head + HELLO) == [HELLO[12:]]
