"""``async with`` for the SDK's handles that hold a connection: leaving the block calls
``aclose()``, whatever happened inside."""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["AsyncClosesOnExit"]


class AsyncClosesOnExit:
    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
