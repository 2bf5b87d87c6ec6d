"""Background processes: started detached, listed, output kept in a bounded buffer, stdin,
signals."""

from __future__ import annotations

from hutch_agent.ops import Op

OPS: dict[str, Op] = {}
