"""The blocking shells of the SDK, generated from ``hutch.sdk._async`` by
``scripts/unasync.py``: do not edit these files, edit their asyncio sources and run it."""
