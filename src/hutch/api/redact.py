"""Nothing secret reaches the daemon's logs: a formatter that redacts every line.

Installed on every handler of ``hutchd`` (``logs/hutchd.log`` and stderr), so it covers
our own loggers and uvicorn's (its error log writes each WebSocket's path and query; its
access log, when on, every request's), messages and tracebacks alike. A line loses:

- the values of every URL query string (``/pty?[redacted]``): a query may carry a key
  (``?token=`` from an old client), and others (a terminal's ``cmd=``) may carry secrets;
- the daemon's own API key wherever it appears, and anything shaped like a hutch key
  (``hk_...``: a wrong key, another daemon's) or like an E2B key or access token of
  the E2B face (``e2b_...``);
- ``Bearer <credentials>`` and ``token=``/``key=``/``secret=``/``password=`` values.
"""

from __future__ import annotations

import logging
import re

__all__ = ["REDACTED", "RedactingFormatter", "redact"]

REDACTED = "[redacted]"

# A query string after a URL path: "?" followed by name=..., up to whitespace or a quote.
_QUERY = re.compile(r"(?<=[^\s?])\?(?=[\w.~%+-]*=)[^\s\"'<>]*")
_HUTCH_KEY = re.compile(r"hk_[A-Za-z0-9_-]{8,}")
_E2B_KEY = re.compile(r"e2b_[A-Za-z0-9_-]{8,}")
_BEARER = re.compile(r"(?i)\b(bearer)\s+[^\s\"',;]+")
_ASSIGNED = re.compile(
    r"(?i)\b(token|api[_-]?key|access[_-]?key|secret|password|authorization)"
    r"(\"?\s*[=:]\s*\"?)(?!bearer\s|\[redacted\])[^\s\"'&,;]+"
)


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    """``text`` with query strings, keys and credentials replaced by ``[redacted]``."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    text = _QUERY.sub("?" + REDACTED, text)
    text = _HUTCH_KEY.sub("hk_" + REDACTED, text)
    text = _E2B_KEY.sub("e2b_" + REDACTED, text)
    text = _BEARER.sub(r"\1 " + REDACTED, text)
    return _ASSIGNED.sub(r"\1\2" + REDACTED, text)


class RedactingFormatter(logging.Formatter):
    """A :class:`logging.Formatter` whose output (message, traceback, stack) is redacted.
    ``secrets``: exact strings to remove as well (the daemon's API key)."""

    def __init__(self, fmt: str | None = None, *, secrets: tuple[str, ...] = ()) -> None:
        super().__init__(fmt)
        self.secrets = secrets

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record), self.secrets)
