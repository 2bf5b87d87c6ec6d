"""SQLite persistence: the only package that contains SQL."""

from hutch.store.db import Store

__all__ = ["Store"]
