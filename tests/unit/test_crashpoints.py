"""The crash-point hook: inert unless asked, kills at exactly the named hit, and its
catalogue matches the calls in the code (tests/e2e/test_crash_points.py kills at each)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hutch import crashpoints
from hutch.crashpoints import ENV, POINTS, crash_point

SRC = Path(__file__).resolve().parents[2] / "src" / "hutch"


def test_every_call_names_a_catalogued_point_and_every_point_is_called() -> None:
    called: dict[str, int] = {}
    for path in SRC.rglob("*.py"):
        for name in re.findall(r'crash_point\("([^"]+)"\)', path.read_text()):
            called[name] = called.get(name, 0) + 1
    assert set(called) == set(POINTS), set(called) ^ set(POINTS)
    assert all(count == 1 for count in called.values()), called


def test_unknown_point_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown crash point 'nope'"):
        crash_point("nope")


def test_inert_unless_the_environment_names_the_point(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    crash_point("save.quit")
    monkeypatch.setenv(ENV, "save.pending")
    crash_point("save.quit")
    monkeypatch.setenv(ENV, "save.quit:5")
    monkeypatch.setattr(crashpoints, "_hits", {})
    for _ in range(4):
        crash_point("save.quit")  # hits 1-4 of 5: still alive


@pytest.mark.parametrize(("spec", "survived"), [("save.quit", 0), ("save.quit:3", 2)])
def test_the_named_hit_kills_the_process(spec: str, survived: int) -> None:
    code = (
        "from hutch.crashpoints import crash_point\n"
        "for i in range(5):\n"
        "    crash_point('save.quit')\n"
        "    print(i, flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(SRC.parent), ENV: spec},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done
    assert done.stdout.split() == [str(i) for i in range(survived)]
