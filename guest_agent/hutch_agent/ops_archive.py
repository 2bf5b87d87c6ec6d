"""Whole directories as tar streams, both ways."""

from __future__ import annotations

from hutch_agent.ops import Op

OPS: dict[str, Op] = {}
