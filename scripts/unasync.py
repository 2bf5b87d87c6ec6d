#!/usr/bin/env python3
"""Generate the SDK's blocking shells from its asyncio ones (as httpcore does with unasync).

``src/hutch/sdk/_async/*.py`` is written by hand; this script writes each file's blocking
twin into ``src/hutch/sdk/_sync/`` by replacing tokens (``async def`` -> ``def``,
``await x`` -> ``x``, ``AsyncClient`` -> ``Client``, ``aclose`` -> ``close``, ...; the
table is :data:`RULES`), dropping lines marked ``# unasync: drop``, then sorting imports
and formatting with ruff, so the output is what ``make lint`` accepts. What cannot be a
token swap (threads vs. the event loop, websockets' two clients, coroutine callbacks)
lives in the hand-written ``hutch.sdk._io_async`` / ``_io_sync`` pair.

    python scripts/unasync.py          # rewrite src/hutch/sdk/_sync/
    python scripts/unasync.py --check  # exit 1 naming every file that is stale

``tests/unit/test_unasync.py`` runs the check, so generated code cannot drift.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "src" / "hutch" / "sdk" / "_async"
TARGET = REPO / "src" / "hutch" / "sdk" / "_sync"

#: (pattern, replacement), applied in order to every line.
RULES: tuple[tuple[str, str], ...] = (
    (r"\bhutch\.sdk\._async\b", "hutch.sdk._sync"),
    (r"\b_io_async\b", "_io_sync"),
    (r"\basync def\b", "def"),
    (r"\basync with\b", "with"),
    (r"\basync for\b", "for"),
    (r"\bawait ", ""),
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
    (r"\b__aiter__\b", "__iter__"),
    (r"\b__anext__\b", "__next__"),
    (r"\bStopAsyncIteration\b", "StopIteration"),
    (r"\banext\(", "next("),
    (r"\baclose\b", "close"),
    (r"\baread\b", "read"),
    (r"\baiter_bytes\b", "iter_bytes"),
    # AsyncClient -> Client, AsyncIterator -> Iterator, httpx.AsyncBaseTransport -> ...
    (r"\bAsync(?=[A-Z])", ""),
    # Lint waivers that only asyncio code needs (a timeout parameter on a coroutine).
    (r"  # noqa: ASYNC\d+$", ""),
)
DROP = "# unasync: drop"
INIT = '''"""The blocking shells of the SDK, generated from ``hutch.sdk._async`` by
``scripts/unasync.py``: do not edit these files, edit their asyncio sources and run it."""
'''


def unasync(text: str) -> str:
    """The blocking twin of one asyncio source file (before formatting)."""
    compiled = [(re.compile(p), r) for p, r in RULES]
    out = []
    for line in text.splitlines(keepends=True):
        if line.rstrip().endswith(DROP):
            continue
        for pattern, replacement in compiled:
            line = pattern.sub(replacement, line)
        out.append(line)
    return "".join(out)


def _ruff(args: list[str], text: str, name: Path) -> str:
    cmd = [sys.executable, "-m", "ruff", *args, "--stdin-filename", str(name), "-"]
    done = subprocess.run(cmd, input=text, capture_output=True, text=True, cwd=REPO, check=False)
    if done.returncode != 0:
        raise SystemExit(f"ruff {' '.join(args)} failed on {name}:\n{done.stderr}{done.stdout}")
    return done.stdout


def generate() -> dict[Path, str]:
    """Every file of ``_sync/`` and its content."""
    files = {TARGET / "__init__.py": INIT}
    for source in sorted(SOURCE.glob("*.py")):
        if source.name == "__init__.py":
            continue
        target = TARGET / source.name
        header = (
            f"# Generated from src/hutch/sdk/_async/{source.name} by scripts/unasync.py: "
            "do not edit.\n"
        )
        text = header + unasync(source.read_text())
        text = _ruff(["check", "--fix", "--select", "I,F401", "--quiet"], text, target)
        files[target] = _ruff(["format", "--quiet"], text, target)
    return files


def stale(files: dict[Path, str]) -> list[Path]:
    """Generated files whose committed content differs, and committed ones not generated."""
    out = [p for p, text in files.items() if not p.exists() or p.read_text() != text]
    out += [p for p in TARGET.glob("*.py") if p not in files]
    return sorted(out)


def main(argv: list[str]) -> int:
    files = generate()
    if "--check" in argv:
        bad = stale(files)
        for path in bad:
            print(f"stale: {path.relative_to(REPO)} (run scripts/unasync.py)", file=sys.stderr)
        return 1 if bad else 0
    TARGET.mkdir(exist_ok=True)
    for path in TARGET.glob("*.py"):
        if path not in files:
            path.unlink()
    for path, text in files.items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
