"""The E2B face's pure parts: Connect framing and JSON (checked with the E2B SDK's own
generated protobuf classes decoding what we encode), keys, tokens and URL signatures
(checked against the SDK's signer), the network and template mappings, metrics parsing,
settings and log redaction."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from e2b.envd.filesystem import filesystem_pb
from e2b.envd.process import process_pb
from e2b.sandbox.signature import get_signature
from protobuf import Oneof

from hutch.api.redact import redact
from hutch.config import load_settings
from hutch.e2b.connect import (
    ConnectError,
    EnvelopeReader,
    Keepalive,
    b64decode,
    encode_envelope,
    end_of_stream,
    paced,
)
from hutch.e2b.envd_filesystem import entry_info, fs_events, permissions
from hutch.e2b.envd_process import end_event
from hutch.e2b.errors import E2bError
from hutch.e2b.interpreter import e2b_output, result_fields
from hutch.e2b.keys import (
    TokenIssuer,
    e2b_form,
    file_signature,
    hutch_form,
    load_or_create_secret,
    signature_matches,
    verify_api_key,
)
from hutch.e2b.metrics import parse_sample
from hutch.e2b.network import egress_rules
from hutch.e2b.templates import resolve_template
from hutch.errors import InvalidArgument, Unauthorized
from hutch.services.files_extra import WatchEvent
from hutch.services.processes import ProcessInfo
from hutch.services.sandboxes import FileEntry


def _process(**kw: object) -> ProcessInfo:
    base: dict[str, object] = dict(
        pid=7,
        argv=("sleep", "1"),
        state="exited",
        exit_code=0,
        signal=None,
        timed_out=False,
        started_at=1.0,
        ended_at=2.0,
        output_bytes=0,
        dropped_bytes=0,
        stdin_open=False,
    )
    return ProcessInfo(**{**base, **kw})  # type: ignore[arg-type]


# -- Connect framing and JSON ------------------------------------------------------------


def test_envelopes_split_across_chunks_and_end_of_stream_is_flagged() -> None:
    wire = encode_envelope({"a": 1}) + encode_envelope({"b": "x" * 1000}) + end_of_stream()
    reader = EnvelopeReader()
    got = []
    for i in range(0, len(wire), 7):  # any chunking
        got += reader.feed(wire[i : i + 7])
    reader.finish()
    assert got == [{"a": 1}, {"b": "x" * 1000}] and reader.ended
    flags, _ = struct.unpack(">BI", end_of_stream(ConnectError("not_found", "gone"))[:5])
    assert flags == 2
    assert json.loads(end_of_stream(ConnectError("not_found", "gone"))[5:]) == {
        "error": {"code": "not_found", "message": "gone"}
    }


def test_bad_envelopes_are_refused_with_connect_codes() -> None:
    with pytest.raises(ConnectError) as big:
        EnvelopeReader(max_bytes=10).feed(struct.pack(">BI", 0, 11) + b"x" * 11)
    assert big.value.code == "resource_exhausted"
    with pytest.raises(ConnectError) as compressed:
        EnvelopeReader().feed(struct.pack(">BI", 1, 2) + b"{}")
    assert compressed.value.code == "unimplemented"
    reader = EnvelopeReader()
    reader.feed(struct.pack(">BI", 0, 5) + b"{}")
    with pytest.raises(ConnectError, match="ends inside"):
        reader.finish()
    with pytest.raises(ConnectError, match="not JSON"):
        EnvelopeReader().feed(struct.pack(">BI", 0, 3) + b"{x}")


def test_base64_accepts_standard_urlsafe_and_unpadded() -> None:
    assert b64decode("aGk/", "f") == b64decode("aGk_", "f") == b"hi?"
    assert b64decode("aGk", "f") == b"hi"
    with pytest.raises(ConnectError):
        b64decode("***", "f")
    with pytest.raises(ConnectError):
        b64decode(12, "f")


def test_the_sdk_decodes_our_process_events() -> None:
    start = process_pb.StartResponse.from_json(json.dumps({"event": {"start": {"pid": 12}}}))
    assert start.event is not None and start.event.event == Oneof(
        "start", process_pb.ProcessEvent.StartEvent(pid=12)
    )
    data = process_pb.StartResponse.from_json(json.dumps({"event": {"data": {"stdout": "aGkK"}}}))
    assert data.event.event.value.output == Oneof("stdout", b"hi\n")  # type: ignore[union-attr]
    killed = end_event(_process(exit_code=None, signal=9))
    assert killed == {"exitCode": -1, "exited": False, "status": "signal: killed"}
    end = process_pb.ConnectResponse.from_json(
        json.dumps({"event": {"end": end_event(_process(exit_code=3))}})
    )
    # The oneof's static type is the union of its members; this one is the end event.
    value: Any = end.event.event.value  # type: ignore[union-attr]
    assert (value.exit_code, value.exited, value.status) == (3, True, "exit status 3")
    assert not value.has_field("error")
    timed = end_event(_process(exit_code=None, signal=9, timed_out=True))
    assert "timeout" in timed["error"]


def test_the_sdk_decodes_our_entries_and_watch_events() -> None:
    entry = entry_info(FileEntry("a.txt", "/root/a.txt", "file", 10, 0o100644, 1700000000.5))
    decoded = filesystem_pb.StatResponse.from_json(json.dumps({"entry": entry})).entry
    assert decoded is not None
    assert (decoded.name, decoded.type, decoded.size, decoded.mode) == (
        "a.txt",
        filesystem_pb.FileType.FILE,
        10,
        0o644,
    )
    assert decoded.permissions == "-rw-r--r--"
    assert decoded.modified_time is not None and decoded.modified_time.seconds == 1700000000
    link = entry_info(FileEntry("l", "/root/l", "symlink", 3, 0o777, 0.0))
    assert link["isSymlink"] is True and permissions("dir", 0o755) == "drwxr-xr-x"
    moved = WatchEvent("renamed", "/w/new", False, 1.0, from_path="/w/old", to_path="/w/new")
    events = fs_events(moved, "/w")
    assert events == [
        {"name": "old", "type": "EVENT_TYPE_RENAME"},
        {"name": "new", "type": "EVENT_TYPE_CREATE"},
    ]
    response = filesystem_pb.WatchDirResponse.from_json(json.dumps({"filesystem": events[0]}))
    assert response.event.value.type == filesystem_pb.EventType.RENAME  # type: ignore[union-attr]


async def test_paced_sends_keepalives_while_quiet_and_ends_at_the_deadline() -> None:
    async def slow() -> AsyncIterator[dict[str, object]]:
        yield {"n": 1}
        await asyncio.sleep(0.35)
        yield {"n": 2}
        await asyncio.sleep(10)
        yield {"n": 3}

    got = []
    with pytest.raises(ConnectError) as late:
        async for message in paced(slow(), Keepalive(0.1, {"keepalive": {}}), 0.8):
            got.append(message)
    assert late.value.code == "deadline_exceeded"
    assert got[0] == {"n": 1} and {"n": 2} in got and {"n": 3} not in got
    assert got.count({"keepalive": {}}) >= 2


# -- keys, tokens, signatures ----------------------------------------------------------


def test_e2b_keys_are_hutch_keys_in_hex() -> None:
    key = "hk_Secret-Key_0123"
    form = e2b_form(key)
    assert form.startswith("e2b_") and set(form[4:]) <= set("0123456789abcdef")
    assert hutch_form(form) == key and hutch_form(key) == key
    verify_api_key(form, key.encode())
    verify_api_key(key, key.encode())
    for wrong in (e2b_form("hk_other"), "e2b_zz", "", None, form + "00"):
        with pytest.raises(Unauthorized):
            verify_api_key(wrong, key.encode())


def test_tokens_are_per_sandbox_per_purpose_and_per_secret(tmp_path: Path) -> None:
    secret = load_or_create_secret(tmp_path / "s")
    assert load_or_create_secret(tmp_path / "s") == secret  # stable across restarts
    assert (tmp_path / "s").stat().st_mode & 0o777 == 0o600
    tokens = TokenIssuer(secret)
    a, b = tokens.envd_token("sb-aaaaaaaaaaaa"), tokens.envd_token("sb-bbbbbbbbbbbb")
    assert a != b and a != tokens.traffic_token("sb-aaaaaaaaaaaa")
    assert tokens.accepts("sb-aaaaaaaaaaaa", a)
    assert tokens.accepts("sb-aaaaaaaaaaaa", tokens.traffic_token("sb-aaaaaaaaaaaa"))
    assert not tokens.accepts("sb-aaaaaaaaaaaa", b)
    assert not tokens.accepts("sb-aaaaaaaaaaaa", None)
    assert not TokenIssuer(b"x" * 32).accepts("sb-aaaaaaaaaaaa", a)


def test_url_signatures_match_the_sdks_signer() -> None:
    token = "e2b_envd_abc"
    for user in (None, "root"):
        for expires_in in (None, 60):
            sdk = get_signature("/root/f.txt", "read", user, token, expires_in)
            ours = file_signature("/root/f.txt", "read", user, token, sdk["expiration"])
            assert ours == sdk["signature"]
            assert signature_matches(
                sdk["signature"], "/root/f.txt", "read", user, token, sdk["expiration"]
            )
    sdk = get_signature("/root/f.txt", "read", None, token)
    assert not signature_matches(sdk["signature"], "/root/f.txt", "write", None, token, None)
    assert not signature_matches(sdk["signature"], "/root/g.txt", "read", None, token, None)


def test_logs_never_show_e2b_keys_or_tokens() -> None:
    line = f"X-API-KEY {e2b_form('hk_abcdefghij')} token e2b_envd_AbCdEfGhIjKl"
    out = redact(line)
    assert "6863" not in out and "AbCdEfGh" not in out and out.count("[redacted]") == 2


# -- mappings ----------------------------------------------------------------------------


def test_network_options_map_onto_hutch_egress_rules() -> None:
    assert egress_rules(None, None) is None
    assert egress_rules({"allowOut": ["a.test"]}, None) is None  # nothing denied: open
    assert egress_rules({"denyOut": ["0.0.0.0/0"]}, None) == ["deny-all"]
    assert egress_rules(None, False) == ["deny-all"]
    assert egress_rules(
        {"denyOut": ["0.0.0.0/0"], "allowOut": ["pypi.org", "*.github.com", "1.2.3.0/24:443"]},
        None,
    ) == ["pypi.org", "*.github.com", "1.2.3.0/24:443"]
    assert egress_rules({"denyOut": ["0.0.0.0/0"], "allowOut": ["0.0.0.0/0"]}, None) is None
    assert egress_rules({"dnsServers": ["1.1.1.1"]}, None) is None
    with pytest.raises(E2bError, match="allow-list"):
        egress_rules({"denyOut": ["10.0.0.0/8"]}, None)
    with pytest.raises(E2bError, match="allowOut"):
        egress_rules({"denyOut": ["0.0.0.0/0"], "allowOut": ["not a rule!"]}, None)
    for field, value in (
        ("rules", {"x.test": [{}]}),
        ("egressProxy", {"address": "p:1080"}),
        ("maskRequestHost", "${PORT}-x"),
        ("allowPublicTraffic", True),
    ):
        with pytest.raises(E2bError) as refused:
            egress_rules({field: value}, None)
        assert refused.value.error_code == "not_supported_by_hutch" and "hutch" in str(
            refused.value
        )


def test_templates_resolve_to_hutch_images_and_snapshots() -> None:
    images = ["base", "devbox", "myapp"]
    assert resolve_template("base", images).image == "base"
    assert resolve_template("code-interpreter-v1", images).image == "devbox"
    assert resolve_template("myapp:latest", images).image == "myapp"
    snap = resolve_template("snap-0123456789ab", images)
    assert (snap.image, snap.snapshot_id) == (None, "snap-0123456789ab")
    with pytest.raises(E2bError) as unknown:
        resolve_template("nope", images)
    assert unknown.value.status == 404 and "code-interpreter-v1" in unknown.value.message


def test_interpreter_outputs_in_e2b_shape() -> None:
    out = result_fields(
        {"text/plain": "1", "image/png": "iVBO", "application/json": '{"a":1}'}, True
    )
    assert out == {
        "type": "result",
        "is_main_result": True,
        "text": "1",
        "png": "iVBO",
        "json": {"a": 1},
    }
    assert result_fields({"application/x-thing": "v"}, False)["extra"] == {
        "application/x-thing": "v"
    }
    err = e2b_output({"type": "error", "ename": "E", "evalue": "v", "traceback": ["a", "b"]})
    assert err == {"type": "error", "name": "E", "value": "v", "traceback": "a\nb"}
    line = e2b_output({"type": "stdout", "text": "hi"})
    assert line is not None and line["text"] == "hi" and line["timestamp"] > 0


def test_metrics_sample_parsing() -> None:
    text = (
        "cpu  100 0 100 800 0 0 0 0 0 0\n"
        "cpu  150 0 150 900 0 0 0 0 0 0\n"
        "MemTotal:  1000 kB\nMemAvailable:  400 kB\nCached:  100 kB\n"
        "/dev/vda 4000 1000 3000 25% /\n"
    )
    m = parse_sample(text, 2, 1700000000.0)
    assert (m["cpuCount"], m["cpuUsedPct"], m["memTotal"], m["memUsed"]) == (
        2,
        50.0,
        1024000,
        614400,
    )
    assert (m["diskTotal"], m["diskUsed"], m["timestampUnix"]) == (4096000, 1024000, 1700000000)
    with pytest.raises(E2bError):
        parse_sample("garbage", 1, 0.0)


def test_e2b_listen_setting() -> None:
    env = {"HUTCH_STATE_DIR": "/tmp/x", "HUTCH_E2B_LISTEN": "127.0.0.1:7071"}
    assert load_settings(env).e2b_listen == ("127.0.0.1", 7071)
    assert load_settings({"HUTCH_STATE_DIR": "/tmp/x"}).e2b_listen is None
    assert load_settings({**env, "HUTCH_E2B_LISTEN": "off"}).e2b_listen is None
    with pytest.raises(InvalidArgument, match="HUTCH_E2B_LISTEN"):
        load_settings({**env, "HUTCH_E2B_LISTEN": "nope"})
    with pytest.raises(InvalidArgument, match="port of its own"):
        load_settings({**env, "HUTCH_E2B_LISTEN": "127.0.0.1:7070"})
