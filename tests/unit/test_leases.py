"""tests/leases.py: names that two test runs side by side (`make test`'s lanes) must
never both take. Each claim is checked against a second process, as a lane is."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hutch.config import Settings
from tests import leases

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def lock_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(leases, "LOCK_DIR", tmp_path / "locks")
    return tmp_path / "locks"


def other_process(lock_dir: Path, code: str) -> str:
    """Run ``code`` (with ``leases`` imported, on ``lock_dir``) in another process."""
    prelude = (
        "from pathlib import Path\nfrom tests import leases\n"
        f"leases.LOCK_DIR = Path({str(lock_dir)!r})\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", prelude + code],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def test_a_claimed_name_is_no_one_elses_until_released(lock_dir: Path) -> None:
    held = leases.claim("pool", ["x", "y"])
    assert held is not None and held.name == "x"
    # This process again, and another one, get the next name.
    again = leases.claim("pool", ["x", "y"])
    assert again is not None and again.name == "y"
    code = "lease = leases.claim('pool', ['x', 'y', 'z'])\nprint(lease and lease.name)"
    assert other_process(lock_dir, code) == "z"
    assert leases.claim("pool", ["x", "y"]) is None
    held.release()
    assert not (lock_dir / "pool" / "x").exists()
    assert other_process(lock_dir, code) == "x"
    again.release()


def test_a_state_dir_gets_a_tag_no_live_daemon_elsewhere_has(
    tmp_path: Path, lock_dir: Path
) -> None:
    state = tmp_path / "state"
    assert leases.own_tag_state_dir(state) == state.resolve()
    # Asked again in this process (a daemon restarted on it): the same dir.
    assert leases.own_tag_state_dir(state) == state.resolve()
    code = f"print(leases.own_tag_state_dir(Path({str(state)!r})))"
    moved = Path(other_process(lock_dir, code))
    assert moved == state.resolve().with_name("state.1")
    tags = {Settings(state_dir=d).daemon_tag for d in (state.resolve(), moved)}
    assert len(tags) == 2
    leases.release_tag(state)
    assert Path(other_process(lock_dir, code)) == state.resolve()


def test_a_lane_takes_ports_of_its_own_range_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HUTCH_TEST_LANE", "a")
    monkeypatch.setattr(leases, "_next_port", {})
    ports = leases.LANE_PORTS["a"]
    first = leases.free_port()
    with socket.socket() as busy:  # the next one in use: skipped
        busy.bind(("127.0.0.1", first + 1))
        busy.listen()
        second = leases.free_port()
    assert first in ports and second in ports
    # In turn, the busy one skipped (first + 2 unless another run on this machine, in
    # the same lane, holds that one too: then a later one).
    assert second > first + 1
    assert not set(leases.LANE_PORTS["a"]) & set(leases.LANE_PORTS["b"])
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert max(leases.LANE_PORTS["b"]) < low  # never one the kernel hands out itself
