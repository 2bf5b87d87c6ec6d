"""Shared by watch, archives and contexts: JSON lines carried in DATA frames, and the error
for a frame the operation did not expect."""

from __future__ import annotations

import json
from typing import Any

from hutch.errors import GuestError, HutchError
from hutch.guest._stream import StreamState
from hutch.guest.protocol import Frame


class JsonLines:
    """Reassembles JSON objects split across DATA frames (a big image spans several)."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._buf = bytearray()

    def feed(self, payload: bytes) -> list[dict[str, Any]]:
        self._buf += payload
        items: list[dict[str, Any]] = []
        while (end := self._buf.find(b"\n")) >= 0:
            line = bytes(self._buf[:end])
            del self._buf[: end + 1]
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError as exc:
                raise GuestError(f"the guest agent sent a malformed {self._what}") from exc
            if not isinstance(item, dict):
                raise GuestError(f"the guest agent sent a malformed {self._what}: {item!r}")
            items.append(item)
        return items


def failure(state: StreamState, frame: Frame) -> HutchError:
    """The error for a frame that is not what the operation expected."""
    err = state.unexpected(frame)
    return err if isinstance(err, HutchError) else GuestError(str(err))
