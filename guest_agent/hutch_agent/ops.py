"""The shape of an operation: what every ``ops_*`` module registers in its ``OPS``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hutch_agent.streams import Stream

#: ``op(stream, request header)`` -> the END header, or None when it sent its own. An op
#: sees its stream (and through ``stream.session`` the session's other streams), never
#: the agent: the ops depend on the streams module only, not on the core that runs them.
Op = Callable[[Stream, dict[str, Any]], "dict[str, Any] | None"]
