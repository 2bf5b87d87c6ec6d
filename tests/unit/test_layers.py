"""Dependencies point one way: interfaces → services → drivers → core (ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "hutch"

CORE = {"errors", "config", "models", "version", "crashpoints", "__init__"}
DRIVERS = {"vm", "guest", "storage", "store", "images", "teardown", "net"}
ALLOWED: dict[str, set[str]] = {
    # layer: what it may import (besides itself)
    "core": {"errors", "config", "models", "version", "crashpoints"},
    "drivers": CORE | DRIVERS,
    "services": CORE | DRIVERS | {"services"},
    "api": CORE | {"services", "api"},
    "sdk": {"errors", "models", "version", "__init__", "sdk"},
    # The CLI is a client (SDK) except for `hutch daemon` and `hutch image build`, which
    # run host-side code by design.
    "cli": CORE | {"sdk", "cli", "daemon", "images", "mcp"},
    # MCP server and framework tools: clients of the SDK, sharing one tool catalogue.
    "mcp": {"errors", "models", "version", "__init__", "sdk", "mcp", "integrations"},
    "integrations": {"errors", "models", "version", "__init__", "sdk", "mcp", "integrations"},
    "__main__": {"cli"},
    "daemon": CORE | {"api", "services", "store", "daemon", "net"},
}


def layer_of(top: str) -> str:
    if top in {"errors", "config", "models", "version", "crashpoints"}:
        return "core"
    if top in DRIVERS:
        return "drivers"
    return top


def hutch_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] == "hutch":
                if len(parts) > 1:
                    found.add(parts[1])
                else:
                    found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "hutch" and len(parts) > 1:
                    found.add(parts[1])
    return found


MODULES = sorted(p for p in SRC.rglob("*.py") if p.parent != SRC or p.stem not in {"__init__"})


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_module_respects_layers(path: Path) -> None:
    rel = path.relative_to(SRC)
    top = rel.parts[0].removesuffix(".py")
    layer = layer_of(top)
    allowed = ALLOWED.get(layer)
    assert allowed is not None, f"{rel}: unknown layer {top!r}; add it to this test"
    bad = {m for m in hutch_imports(path) if m not in allowed and m != top}
    assert not bad, f"{rel} ({layer}) imports {sorted(bad)}; allowed: {sorted(allowed)}"
