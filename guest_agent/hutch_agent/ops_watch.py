"""File watch: inotify events (create, modify, delete, rename) streamed to the host."""

from __future__ import annotations

from hutch_agent.ops import Op

OPS: dict[str, Op] = {}
