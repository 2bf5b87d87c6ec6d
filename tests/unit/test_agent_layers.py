"""The guest agent's modules import one way: the core (which reads frames and runs the
ops) imports the ops and the streams; no op, nor the streams module, imports the core,
not even for a type under ``TYPE_CHECKING`` (a circle no import graph at run time shows,
which used to tie every ``ops_*`` module to ``core.Agent``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

AGENT = Path(__file__).resolve().parents[2] / "guest_agent" / "hutch_agent"

#: The modules that may import ``hutch_agent.core``: the entry point only.
MAY_IMPORT_CORE = {"__main__"}


def agent_imports(path: Path) -> set[str]:
    """``hutch_agent`` submodules ``path`` imports, wherever the import stands."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] == "hutch_agent":
                found.update([parts[1]] if len(parts) > 1 else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "hutch_agent" and len(parts) > 1:
                    found.add(parts[1])
    return found


@pytest.mark.parametrize("path", sorted(AGENT.glob("*.py")), ids=lambda p: p.name)
def test_no_module_but_the_entry_point_imports_the_core(path: Path) -> None:
    if path.stem in MAY_IMPORT_CORE | {"core"}:
        return
    assert "core" not in agent_imports(path), f"{path.name} imports hutch_agent.core"


def test_the_check_sees_type_only_imports(tmp_path: Path) -> None:
    module = tmp_path / "ops_x.py"
    module.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from hutch_agent.core import Agent\n"
    )
    assert agent_imports(module) == {"core"}
