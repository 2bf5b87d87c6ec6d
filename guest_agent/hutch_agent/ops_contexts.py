"""Code interpreter contexts: stateful Python processes returning structured outputs."""

from __future__ import annotations

from hutch_agent.ops import Op

OPS: dict[str, Op] = {}
