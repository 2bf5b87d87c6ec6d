"""Pure parts of the code interpreter, file watch and archive support (no I/O)."""

from __future__ import annotations

import base64
import io
import json
import os
import sys
import tarfile
from pathlib import Path

import pytest

from hutch.errors import InvalidArgument, NotFound
from hutch.sdk._contexts import ExecutionBuilder, RunDecoder
from hutch.sdk._errors import ProtocolError
from hutch.sdk._files import WatchDecoder
from hutch.sdk._tar import extract_tar, tar_chunks

AGENT_DIR = str(Path(__file__).resolve().parents[2] / "guest_agent")
# The agent's modules, imported as the guest imports them (then off the path again).
sys.path.insert(0, AGENT_DIR)
try:
    from hutch_agent.errors import AgentError
    from hutch_agent.inotify import parse
    from hutch_agent.ops_archive import check_member
finally:
    sys.path.remove(AGENT_DIR)


def lines(*objs: object) -> bytes:
    return b"".join(json.dumps(o).encode() + b"\n" for o in objs)


def test_run_decoder_and_builder() -> None:
    png = base64.b64encode(b"\x89PNG").decode()
    body = lines(
        {"type": "stdout", "text": "a"},
        {"type": "display", "data": {"text/plain": "<Figure>", "image/png": png}},
        {"type": "result", "data": {"text/plain": "42", "text/html": "<b>42</b>"}},
        {"type": "end", "status": "ok", "duration_ms": 5},
    )
    decoder = RunDecoder()
    items = [*decoder.feed(body[:7]), *decoder.feed(body[7:])]
    assert decoder.done and items[-1]["type"] == "end"
    seen: list[str] = []
    builder = ExecutionBuilder(on_stdout=seen.append)
    for item in items[:-1]:
        builder.add(item)
    ex = builder.finish("ok", 5)
    assert seen == ["a"] and ex.stdout == "a" and ex.text == "42"
    assert ex.images == [b"\x89PNG"] and ex.result is not None and ex.result.html == "<b>42</b>"
    with pytest.raises(NotFound, match="no context"):
        RunDecoder().feed(lines({"type": "error", "code": "not_found", "message": "no context"}))
    with pytest.raises(ProtocolError):
        RunDecoder().eof()


def test_watch_decoder() -> None:
    decoder = WatchDecoder()
    events = decoder.feed(
        lines(
            {"type": "watching", "path": "/root", "watches": 1},
            {
                "type": "renamed",
                "path": "/b",
                "is_dir": False,
                "time": 1.0,
                "from": "/a",
                "to": "/b",
            },
            {"type": "end", "reason": "deleted"},
        )
    )
    assert [e.type for e in events] == ["watching", "renamed"]
    assert (events[1].from_path, events[1].to_path) == ("/a", "/b")
    assert decoder.done


def test_tar_chunks_and_extract_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f").write_bytes(os.urandom(3 << 20))
    (src / "l").symlink_to("d/f")
    data = b"".join(tar_chunks(src))
    assert extract_tar(io.BytesIO(data), tmp_path / "out") == 3
    assert (tmp_path / "out" / "d" / "f").read_bytes() == (src / "d" / "f").read_bytes()
    assert os.readlink(tmp_path / "out" / "l") == "d/f"
    with pytest.raises(InvalidArgument):
        tar_chunks(tmp_path / "missing")

    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w") as tar:
        tar.addfile(tarfile.TarInfo("../escape"), io.BytesIO(b""))
    evil.seek(0)
    with pytest.raises(InvalidArgument, match="escape"):
        extract_tar(evil, tmp_path / "out2")


def test_agent_member_checks(tmp_path: Path) -> None:
    dest = str(tmp_path)
    ok = tarfile.TarInfo("a/b")
    check_member(ok, dest)
    for name, kind, link in (
        ("/abs", tarfile.REGTYPE, ""),
        ("a/../../x", tarfile.REGTYPE, ""),
        ("s", tarfile.SYMTYPE, "/etc"),
        ("s", tarfile.SYMTYPE, "../.."),
        ("h", tarfile.LNKTYPE, "../x"),
        ("c", tarfile.CHRTYPE, ""),
        ("p", tarfile.FIFOTYPE, ""),
    ):
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, link
        with pytest.raises(AgentError) as exc:
            check_member(info, dest)
        assert repr(name) in exc.value.message


def test_inotify_record_parsing() -> None:
    import struct

    raw = struct.pack("iIII", 1, 0x100, 0, 8) + b"new\0\0\0\0\0" + struct.pack("iIII", 2, 0x2, 0, 0)
    events = parse(raw)
    assert [(e.wd, e.mask, e.name) for e in events] == [(1, 0x100, "new"), (2, 0x2, "")]
