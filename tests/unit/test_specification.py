"""Every test SPECIFICATION.md names exists: a promise never outlives its proof."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "SPECIFICATION.md"
_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def _test_names(path: Path) -> set[str]:
    """Module-level and class-level test function names defined in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.update(
                f"{node.name}::{item.name}"
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            )
    return names


def test_every_promise_names_a_test() -> None:
    promises = [line for line in SPEC.read_text().splitlines() if line.startswith("- ")]
    assert promises, "SPECIFICATION.md lists no promises"
    unproven = [line for line in promises if not _REF.search(line)]
    assert not unproven, f"promises without a test: {unproven}"


def test_every_named_test_exists() -> None:
    refs = _REF.findall(SPEC.read_text())
    missing = []
    cache: dict[str, set[str]] = {}
    for rel, name in refs:
        path = REPO / rel
        if not path.is_file():
            missing.append(f"{rel} (no such file)")
            continue
        names = cache.setdefault(rel, _test_names(path))
        if name not in names:
            missing.append(f"{rel}::{name}")
    assert not missing, f"SPECIFICATION.md names tests that do not exist: {missing}"
