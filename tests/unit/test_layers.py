"""Dependencies point one way: interfaces → services → drivers → core → contract
(ARCHITECTURE.md). Each package lists what it may import; everything else is forbidden."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "hutch"

#: The core every daemon-side package may use.
CORE = {"errors", "config", "models", "version", "crashpoints", "contract"}
#: What a client of the daemon may import: the contract and the client packages, never
#: the daemon's code (services, api, vm, net, guest, store, storage, images, config).
CLIENT = {"errors", "version", "contract"}
#: Every package (or top-level module) and what it may import besides itself. Anything
#: not listed is forbidden, so a new edge is a decision written here.
ALLOWED: dict[str, set[str]] = {
    # The contract of API v1 (limits, rule grammar, codes, views): pure, errors only.
    "contract": {"errors"},
    "errors": set(),
    "version": set(),
    "crashpoints": set(),
    "models": {"contract", "errors"},
    "config": {"contract", "errors"},
    "__init__": CLIENT | {"sdk"},
    "__main__": {"cli"},
    # Drivers: each talks to one outside thing and knows nothing of the use cases.
    "vm": CORE,
    "guest": CORE,
    "storage": CORE,
    "store": CORE,
    "teardown": CORE,
    "images": CORE | {"vm"},
    # net/ holds drivers only (taps, nft, the data path and its servers): it takes plain
    # values (the QEMU uid, rows read by hutch.services.network), so it imports neither
    # the store nor the VM driver.
    "net": CORE,
    # The machine of one sandbox (backend protocol, QEMU backend): a driver that never
    # imports the services using it.
    "runtime": CORE | {"vm", "guest", "storage", "images", "net"},
    # The use cases compose the drivers.
    "services": CORE | {"vm", "guest", "storage", "store", "teardown", "images", "net", "runtime"},
    # The REST face renders what the services return: never a driver (guest, net, ...).
    # It serves the web console's static files (ui/) at /ui.
    "api": CORE | {"services", "ui"},
    # The web console: static files (package data) and their index; imports nothing.
    "ui": set(),
    # The E2B-compatible face: an interface like the REST API, on the same services (it
    # reuses the REST layer's key check and streamed answers); never a driver.
    "e2b": CORE | {"services", "api"},
    # The composition root: builds the store, the drivers and the services, serves the API
    # (the blob store too: opened once, shared by the services that keep files off-host).
    "daemon": CORE | {"api", "e2b", "services", "store", "storage", "net", "runtime"},
    # The SDK is a client only; `testing` is imported by the deprecated alias
    # hutch.sdk.testing alone.
    "sdk": CLIENT | {"testing"},
    # The in-memory fake of the REST API for tests: a client-side package too.
    "testing": CLIENT,
    # The CLI is a client (SDK) except for `hutch daemon` and `hutch image build`, which
    # run host-side code by design.
    "cli": CLIENT | {"config", "models", "sdk", "daemon", "images", "mcp"},
    # The agent tool catalogue (specs + runner over the SDK).
    "agent_tools": CLIENT | {"sdk"},
    # The MCP server and the framework wrappers: two faces of the one catalogue, which
    # never import each other.
    "mcp": CLIENT | {"sdk", "agent_tools"},
    "integrations": CLIENT | {"sdk", "agent_tools"},
}
#: Ordered pairs of distinct packages the table forbids (issue 9's note reports it).
FORBIDDEN_EDGES = 565
#: The edges the issue names, each checked on its own below.
NAMED_FORBIDDEN: list[tuple[str, str]] = [
    ("contract", "services"),
    ("runtime", "services"),
    ("api", "guest"),
    ("api", "net"),
    ("e2b", "guest"),
    ("e2b", "net"),
    ("net", "store"),
    ("net", "vm"),
    ("mcp", "integrations"),
    ("integrations", "mcp"),
    ("sdk", "services"),
    ("testing", "services"),
]
#: Outside the standard library, the contract needs only the IDNA codec (host names).
CONTRACT_THIRD_PARTY = {"idna"}


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


def package_of(path: Path) -> str:
    return path.relative_to(SRC).parts[0].removesuffix(".py")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_module_respects_layers(path: Path) -> None:
    package = package_of(path)
    allowed = ALLOWED.get(package)
    assert allowed is not None, f"{path.relative_to(SRC)}: unknown package {package!r}; add it"
    bad = {m for m in hutch_imports(path) if m not in allowed and m != package}
    assert not bad, f"{path.relative_to(SRC)} imports {sorted(bad)}; allowed: {sorted(allowed)}"


def test_every_package_is_listed() -> None:
    found = {package_of(p) for p in SRC.rglob("*.py")}
    assert found <= set(ALLOWED), f"unlisted packages: {sorted(found - set(ALLOWED))}"


@pytest.mark.parametrize("edge", NAMED_FORBIDDEN, ids=lambda e: f"{e[0]}-x->{e[1]}")
def test_a_named_edge_is_forbidden_and_absent(edge: tuple[str, str]) -> None:
    importer, imported = edge
    assert imported not in ALLOWED[importer]
    for path in sorted((SRC / importer).rglob("*.py")):
        assert imported not in hutch_imports(path), f"{path.relative_to(SRC)} imports {imported}"


def test_forbidden_edge_count() -> None:
    """How much the table forbids (reported in the issue-9 note): every ordered pair of
    distinct packages that is not allowed."""
    packages = set(ALLOWED)
    forbidden = sum(1 for a in packages for b in packages if a != b and b not in ALLOWED[a])
    assert forbidden == FORBIDDEN_EDGES, forbidden


@pytest.mark.parametrize(
    "path", sorted((SRC / "contract").rglob("*.py")), ids=lambda p: str(p.relative_to(SRC))
)
def test_the_contract_is_pure(path: Path) -> None:
    extra = third_party_imports(path) - CONTRACT_THIRD_PARTY
    assert not extra, f"{path.relative_to(SRC)} imports {sorted(extra)}: keep the contract pure"


def test_a_forbidden_import_is_caught(tmp_path: Path) -> None:
    """The check can fail: an SDK module importing the service layer is reported."""
    module = tmp_path / "bad.py"
    module.write_text("from hutch.services.sandboxes import SandboxService\n")
    assert hutch_imports(module) - ALLOWED["sdk"] == {"services"}
    module.write_text("from hutch.store.db import Store\nfrom hutch.vm import runas\n")
    assert hutch_imports(module) - ALLOWED["net"] == {"store", "vm"}
    module.write_text("import pydantic\nimport json\nfrom hutch.errors import HutchError\n")
    assert third_party_imports(module) == {"pydantic"}
