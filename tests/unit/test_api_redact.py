"""What the daemon's log formatter takes out of every line (hutch.api.redact); the real
daemon's logs are grepped for keys in tests/e2e/test_inflight_auth.py."""

from __future__ import annotations

import logging

import pytest

from hutch.api.redact import REDACTED, RedactingFormatter, redact

KEY = "hk_" + "A1b2-C3d4_" * 4


@pytest.mark.parametrize(
    ("line", "kept", "gone"),
    [
        (
            f'127.0.0.1:5 - "WebSocket /v1/sandboxes/sb-0123456789ab/pty?rows=24&token={KEY}" '
            "[accepted]",
            ["/v1/sandboxes/sb-0123456789ab/pty?[redacted]", "[accepted]"],
            [KEY, "rows=24", "token="],
        ),
        (
            '"GET /v1/sandboxes/sb-x/files?path=/root/secret.txt HTTP/1.1" 200',
            ["/v1/sandboxes/sb-x/files?[redacted] HTTP/1.1", "200"],
            ["secret.txt"],
        ),
        ("a wrong key hk_wrongwrongwrong in a message", ["hk_[redacted] in"], ["wrongwrong"]),
        ("Authorization: Bearer s3cr3t-not-hutch", ["Bearer [redacted]"], ["s3cr3t"]),
        ("retry with token=abc&x=1 or api_key: xyz", ["token=[redacted]"], ["abc", "xyz"]),
        ("is this ok? yes, ?? fine", ["is this ok? yes, ?? fine"], []),
    ],
)
def test_lines_lose_queries_keys_and_credentials(
    line: str, kept: list[str], gone: list[str]
) -> None:
    out = redact(line)
    for piece in kept:
        assert piece in out, out
    for piece in gone:
        assert piece not in out, out


def test_the_daemon_key_goes_even_without_a_hutch_shape() -> None:
    assert redact("x plainsecret y", ("plainsecret",)) == f"x {REDACTED} y"


def test_formatter_redacts_messages_and_tracebacks() -> None:
    fmt = RedactingFormatter("%(levelname)s %(message)s", secrets=("topsecret",))
    try:
        raise ValueError(f"bad key {KEY} and topsecret")
    except ValueError:
        record = logging.LogRecord(
            "uvicorn.error", logging.ERROR, __file__, 1, "%s - %s", ("c", "/p?token=t0ken"), None
        )
        import sys

        record.exc_info = sys.exc_info()
    out = fmt.format(record)
    assert "t0ken" not in out and KEY not in out and "topsecret" not in out
    assert "ValueError: bad key hk_[redacted] and [redacted]" in out
