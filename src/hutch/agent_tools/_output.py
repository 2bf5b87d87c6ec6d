"""Bounded capture of a command's output, keeping its beginning and its end.

A model reading ``make`` output needs the first error and the last lines; the middle of
a megabyte of log is what it can lose. Memory stays bounded however much is printed.
"""

from __future__ import annotations

__all__ = ["OutputCapture", "truncation_marker"]


def truncation_marker(shown_bytes: int, total_bytes: int) -> str:
    """The one line that tells a reader output is missing (the tools promise its form)."""
    return f"[output truncated: {shown_bytes} of {total_bytes} bytes shown]"


class OutputCapture:
    """Collects text; keeps the first ``limit // 2`` and the last ``limit - limit // 2``
    characters once more than ``limit`` arrived."""

    def __init__(self, limit: int) -> None:
        if limit < 2:
            raise ValueError("limit must be at least 2 characters")
        self.limit = limit
        self._head_room = limit // 2
        self._head: list[str] = []
        self._head_len = 0
        self._tail = ""
        self._chars = 0
        self._bytes = 0

    @property
    def truncated(self) -> bool:
        return self._chars > self.limit

    @property
    def total_bytes(self) -> int:
        return self._bytes

    def add(self, data: str) -> None:
        self._chars += len(data)
        self._bytes += len(data.encode())
        if self._head_len < self._head_room:
            take = data[: self._head_room - self._head_len]
            self._head.append(take)
            self._head_len += len(take)
            data = data[len(take) :]
        if data:
            # Output that fits is head + tail whole: the tail never exceeds its share then.
            self._tail = (self._tail + data)[-(self.limit - self._head_room) :]

    def text(self) -> str:
        head = "".join(self._head)
        if not self.truncated:
            return head + self._tail
        shown = len(head.encode()) + len(self._tail.encode())
        return f"{head}\n{truncation_marker(shown, self._bytes)}\n{self._tail}"
