"""Interactive terminals: a shell on a PTY, resized and signalled, reattachable after a
dropped connection."""

from __future__ import annotations

from hutch_agent.ops import Op

OPS: dict[str, Op] = {}
