"""hutch's E2B-compatible API: the E2B SDKs and code interpreter, unmodified, against
hutchd (``E2B_API_URL``, ``E2B_SANDBOX_URL``, ``E2B_API_KEY``). See ``app.py``."""

from hutch.e2b.app import E2bApp, create_e2b_app

__all__ = ["E2bApp", "create_e2b_app"]
