"""Dependencies point one way: interfaces → services → drivers → core → contract
(ARCHITECTURE.md). Each package lists what it may import; everything else is forbidden."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "hutch"

CORE = {"errors", "config", "models", "version", "crashpoints", "__init__", "contract"}
DRIVERS = {"vm", "guest", "storage", "store", "images", "teardown", "net"}
#: What a client of the daemon may import: the contract and the client packages, never
#: the daemon's code (services, api, vm, net, guest, store, storage, images, config).
CLIENT = {"errors", "version", "__init__", "contract"}
ALLOWED: dict[str, set[str]] = {
    # layer: what it may import (besides itself)
    "core": {"errors", "config", "models", "version", "contract", "crashpoints"},
    # The contract of API v1 (limits, rule grammar, codes, views): pure, errors only.
    "contract": {"errors"},
    "drivers": CORE | DRIVERS,
    "services": CORE | DRIVERS | {"services"},
    "api": CORE | {"services", "api"},
    # The SDK is a client only; `testing` is imported by the deprecated alias
    # hutch.sdk.testing alone.
    "sdk": CLIENT | {"sdk", "testing"},
    # The in-memory fake of the REST API for tests: a client-side package too.
    "testing": CLIENT | {"testing"},
    # The CLI is a client (SDK) except for `hutch daemon` and `hutch image build`, which
    # run host-side code by design.
    "cli": CORE | {"sdk", "cli", "daemon", "images", "mcp"},
    # MCP server and framework tools: clients of the SDK, sharing one tool catalogue.
    "mcp": CLIENT | {"sdk", "mcp", "integrations"},
    "integrations": CLIENT | {"sdk", "mcp", "integrations"},
    "__main__": {"cli"},
    "daemon": CORE | {"api", "services", "store", "daemon", "net"},
}
#: Edges forbidden inside a layer: a driver package that must not import another one.
#: ``net`` holds drivers only (taps, nft, the data path and its servers): it takes plain
#: values (the QEMU uid, the store's rows read by hutch.services.network), so it imports
#: neither the store nor the VM driver.
FORBIDDEN: dict[str, set[str]] = {"net": {"store", "vm"}}
#: Outside the standard library, the contract needs only the IDNA codec (host names).
CONTRACT_THIRD_PARTY = {"idna"}


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


def third_party_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            top = name.split(".")[0]
            if top != "hutch" and top not in sys.stdlib_module_names and top != "__future__":
                found.add(top)
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
    barred = hutch_imports(path) & FORBIDDEN.get(top, set())
    assert not barred, f"{rel} imports {sorted(barred)}; {top}/ may not import {FORBIDDEN[top]}"


@pytest.mark.parametrize(
    "path", sorted((SRC / "contract").rglob("*.py")), ids=lambda p: str(p.relative_to(SRC))
)
def test_the_contract_is_pure(path: Path) -> None:
    extra = third_party_imports(path) - CONTRACT_THIRD_PARTY
    assert not extra, f"{path.relative_to(SRC)} imports {sorted(extra)}: keep the contract pure"


def test_the_client_packages_never_reach_into_the_daemon() -> None:
    """The edges the issue names, spelled out (ALLOWED above already implies them)."""
    daemon_side = {"services", "api", "vm", "net", "guest", "store", "storage", "daemon"}
    for package in ("sdk", "testing", "mcp", "integrations"):
        assert not ALLOWED[package] & daemon_side, package
    assert ALLOWED["contract"] == {"errors"}


def test_the_network_drivers_never_reach_into_the_store_or_the_vm_driver() -> None:
    """net/ is drivers only (issue 9): the use case that reads rows and the QEMU uid is
    hutch.services.network, which hands them down as plain values."""
    assert FORBIDDEN["net"] == {"store", "vm"}
    for path in sorted((SRC / "net").rglob("*.py")):
        barred = hutch_imports(path) & FORBIDDEN["net"]
        assert not barred, f"{path.relative_to(SRC)} imports {sorted(barred)}"


def test_a_forbidden_import_is_caught(tmp_path: Path) -> None:
    """The check can fail: an SDK module importing the service layer is reported."""
    module = tmp_path / "bad.py"
    module.write_text("from hutch.services.sandboxes import SandboxService\n")
    assert hutch_imports(module) - ALLOWED["sdk"] == {"services"}
    module.write_text("from hutch.store.db import Store\nfrom hutch.vm import runas\n")
    assert hutch_imports(module) & FORBIDDEN["net"] == {"store", "vm"}
    module.write_text("import pydantic\nimport json\nfrom hutch.errors import HutchError\n")
    assert third_party_imports(module) == {"pydantic"}
