# Generated from src/hutch/sdk/_async/_closing.py by scripts/unasync.py: do not edit.
"""``with`` for the SDK's handles that hold a connection: leaving the block calls
``close()``, whatever happened inside."""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["ClosesOnExit"]


class ClosesOnExit:
    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
