"""The shape of an operation: what every ``ops_*`` module registers in its ``OPS``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hutch_agent.core import Agent
    from hutch_agent.streams import Stream

#: ``op(agent, stream, request header)`` -> the END header, or None when it sent its own.
Op = Callable[["Agent", "Stream", dict[str, Any]], "dict[str, Any] | None"]
