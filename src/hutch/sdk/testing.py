"""Deprecated: the in-memory fake moved to :mod:`hutch.testing`.

``from hutch.testing import FakeHutch`` keeps working (the same objects) but warns;
import from ``hutch.testing`` instead.
"""

from __future__ import annotations

import warnings

from hutch.testing import FakeError, FakeHutch, FakeNetwork, FakeRun, FakeSandbox, FakeSnapshot

__all__ = ["FakeError", "FakeHutch", "FakeNetwork", "FakeRun", "FakeSandbox", "FakeSnapshot"]

warnings.warn(
    "hutch.sdk.testing moved to hutch.testing; import FakeHutch from there",
    DeprecationWarning,
    stacklevel=2,
)
