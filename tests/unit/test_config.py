from __future__ import annotations

from pathlib import Path

import pytest

from hutch.config import load_settings, parse_listen
from hutch.errors import InvalidArgument


def test_defaults(tmp_path: Path) -> None:
    s = load_settings({"HUTCH_STATE_DIR": str(tmp_path)})
    assert s.listen == "127.0.0.1:7070"
    assert s.state_dir == tmp_path.resolve()
    assert s.accel == "auto"
    assert s.limits.memory_budget_mib > 0
    assert len(str(s.run_dir / "sb-0123456789ab" / "agent.sock")) < 100


def test_env_beats_file(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('listen = "127.0.0.1:9000"\naccel = "tcg"\n')
    s = load_settings({"HUTCH_STATE_DIR": str(tmp_path), "HUTCH_LISTEN": "0.0.0.0:8000"})
    assert (s.listen_host, s.listen_port, s.accel) == ("0.0.0.0", 8000, "tcg")


def test_two_state_dirs_get_separate_socket_dirs(tmp_path: Path) -> None:
    a = load_settings({"HUTCH_STATE_DIR": str(tmp_path / "a")})
    b = load_settings({"HUTCH_STATE_DIR": str(tmp_path / "b")})
    assert a.run_dir != b.run_dir


@pytest.mark.parametrize("value", ["7070", "host:", ":80", "h:99999", "h:x"])
def test_bad_listen_is_explained(value: str) -> None:
    with pytest.raises(InvalidArgument, match="host:port"):
        parse_listen(value)


def test_bad_accel_and_unknown_keys(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="accepted: auto, kvm, tcg"):
        load_settings({"HUTCH_STATE_DIR": str(tmp_path), "HUTCH_ACCEL": "xen"})
    (tmp_path / "config.toml").write_text("colour = 1\n")
    with pytest.raises(InvalidArgument, match="unknown setting"):
        load_settings({"HUTCH_STATE_DIR": str(tmp_path)})
    (tmp_path / "config.toml").write_text("= broken")
    with pytest.raises(InvalidArgument, match="not valid TOML"):
        load_settings({"HUTCH_STATE_DIR": str(tmp_path)})
