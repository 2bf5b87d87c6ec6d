"""A teardown stack: resources register an undo step as they are acquired; ``close()``
undoes them in reverse order, continuing past failures."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable

__all__ = ["TeardownError", "TeardownStack"]

log = logging.getLogger(__name__)

Undo = Callable[[], object] | Callable[[], Awaitable[object]]


class TeardownError(Exception):
    """Raised by ``close(raise_errors=True)``: some steps failed (``.failures``)."""

    def __init__(self, failures: list[tuple[str, BaseException]]) -> None:
        self.failures = failures
        super().__init__(
            "teardown failed: " + "; ".join(f"{name}: {exc!r}" for name, exc in failures)
        )


class TeardownStack:
    """Register ``(name, callable)`` pairs; ``await close()`` runs them last-first.

    Sync or async callables. A failing step is logged and collected, the rest still run.
    ``close()`` is safe to call twice or concurrently: the steps run once and every
    caller waits for that one run. Registering after close raises ``RuntimeError``.
    """

    def __init__(self) -> None:
        self._steps: list[tuple[str, Undo]] = []
        self._closing: asyncio.Task[list[tuple[str, BaseException]]] | None = None

    def register(self, name: str, undo: Undo) -> None:
        if self._closing is not None:
            raise RuntimeError(f"teardown stack already closed; cannot register {name!r}")
        self._steps.append((name, undo))

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def closed(self) -> bool:
        return self._closing is not None and self._closing.done()

    async def close(self, *, raise_errors: bool = False) -> list[tuple[str, BaseException]]:
        """Run every step in reverse; return the failures (name, exception).

        With ``raise_errors=True`` failures raise ``TeardownError`` instead.
        Cancelling a caller does not cancel the teardown itself.
        """
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self._run())
        failures = await asyncio.shield(self._closing)
        if failures and raise_errors:
            raise TeardownError(failures)
        return failures

    async def _run(self) -> list[tuple[str, BaseException]]:
        failures: list[tuple[str, BaseException]] = []
        while self._steps:
            name, undo = self._steps.pop()
            try:
                result = undo()
                if inspect.isawaitable(result):
                    await result
            except Exception as exc:
                log.warning("teardown step %s failed: %r", name, exc)
                failures.append((name, exc))
        return failures
