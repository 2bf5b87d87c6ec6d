"""The asyncio shells of the SDK, written by hand. ``scripts/unasync.py`` generates the
blocking shells in ``hutch.sdk._sync`` from these files; edit here, then run it."""
