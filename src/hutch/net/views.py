"""What the networking use cases return to the API, MCP and CLI layers: the contract's
result views (:mod:`hutch.contract.views`), re-exported where the drivers import them."""

from __future__ import annotations

from hutch.contract.views import (
    EgressEvent,
    EgressMode,
    EgressView,
    NetworkMode,
    NetworkView,
    PortView,
    SandboxNetView,
    Verdict,
)

__all__ = [
    "EgressEvent",
    "EgressMode",
    "EgressView",
    "NetworkMode",
    "NetworkView",
    "PortView",
    "SandboxNetView",
    "Verdict",
]
