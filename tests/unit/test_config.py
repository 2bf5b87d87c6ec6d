from __future__ import annotations

import pwd
from pathlib import Path

import pytest

from hutch.config import NetLimits, load_settings, parse_dns_upstream, parse_listen
from hutch.errors import InvalidArgument, VmError
from hutch.vm.runas import qemu_runas, qemu_uid, qemu_user


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


def test_network_settings(tmp_path: Path) -> None:
    s = load_settings(
        {
            "HUTCH_STATE_DIR": str(tmp_path),
            "HUTCH_NET_POOL": "10.9.0.0/20",
            "HUTCH_DNS_UPSTREAM": "198.18.0.53",
            "HUTCH_PORTS_BIND": "127.0.0.2",
        }
    )
    assert str(s.net_pool) == "10.9.0.0/20"
    assert s.dns_upstream == ("198.18.0.53", 53)
    assert s.ports_bind == "127.0.0.2"
    assert len(s.daemon_tag) == 4
    assert parse_dns_upstream("[2001:db8::53]:5353") == ("2001:db8::53", 5353)
    assert parse_dns_upstream("192.0.2.1:5353") == ("192.0.2.1", 5353)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("HUTCH_NET_POOL", "10.9.0.1/16", "not an IPv4 network"),
        ("HUTCH_NET_POOL", "10.0.0.0/30", "prefix length must be 8-28"),
        ("HUTCH_DNS_UPSTREAM", "dns.example", "not an IP address"),
        ("HUTCH_DNS_UPSTREAM", "192.0.2.1:99999", "out of 1-65535"),
        ("HUTCH_PORTS_BIND", "localhost", "not an IP address"),
    ],
)
def test_bad_network_settings_are_explained(
    tmp_path: Path, name: str, value: str, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        load_settings({"HUTCH_STATE_DIR": str(tmp_path), name: value})


def test_qemu_user_is_checked_when_the_daemon_is_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 0)
    assert qemu_user(load_settings({"HUTCH_QEMU_USER": "root"})) is None
    with pytest.raises(VmError, match=r"no-such-qemu-user.*does not exist.*useradd"):
        qemu_user(load_settings({"HUTCH_QEMU_USER": "no-such-qemu-user"}))
    assert qemu_user(load_settings({"HUTCH_QEMU_USER": "nobody"})) == "nobody"
    assert qemu_uid(load_settings({"HUTCH_QEMU_USER": "nobody"})) == 65534
    nogroup = pwd.getpwnam("nobody").pw_gid
    assert qemu_runas(load_settings({"HUTCH_QEMU_USER": "nobody"})) == f"65534:{nogroup}"
    assert qemu_uid(load_settings({"HUTCH_QEMU_USER": "no-such-qemu-user"})) is None
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert qemu_user(load_settings({"HUTCH_QEMU_USER": "nobody"})) is None


def test_console_log_bytes(tmp_path: Path) -> None:
    env = {"HUTCH_STATE_DIR": str(tmp_path)}
    assert load_settings(env).console_log_bytes == 1 << 20
    assert load_settings({**env, "HUTCH_CONSOLE_LOG_BYTES": "262144"}).console_log_bytes == 262144
    for bad in ("1000", str(2 << 30), "lots"):
        with pytest.raises(InvalidArgument, match="console_log_bytes"):
            load_settings({**env, "HUTCH_CONSOLE_LOG_BYTES": bad})


def test_guest_aslr(tmp_path: Path) -> None:
    env = {"HUTCH_STATE_DIR": str(tmp_path)}
    assert load_settings(env).guest_aslr is False
    assert load_settings({**env, "HUTCH_GUEST_ASLR": "1"}).guest_aslr is True
    (tmp_path / "config.toml").write_text("guest_aslr = true\n")
    assert load_settings(env).guest_aslr is True
    with pytest.raises(InvalidArgument, match=r"guest_aslr='sometimes'; accepted: 1/0"):
        load_settings({**env, "HUTCH_GUEST_ASLR": "sometimes"})


def test_lifecycle_wait_s(tmp_path: Path) -> None:
    env = {"HUTCH_STATE_DIR": str(tmp_path)}
    assert load_settings(env).lifecycle_wait_s == 30.0
    assert load_settings({**env, "HUTCH_LIFECYCLE_WAIT_S": "2.5"}).lifecycle_wait_s == 2.5
    assert load_settings({**env, "HUTCH_LIFECYCLE_WAIT_S": "0"}).lifecycle_wait_s == 0.0
    for bad in ("-1", "3601", "nan", "soon"):
        with pytest.raises(InvalidArgument, match="lifecycle_wait_s"):
            load_settings({**env, "HUTCH_LIFECYCLE_WAIT_S": bad})


def test_net_limits_defaults_env_and_file(tmp_path: Path) -> None:
    s = load_settings({"HUTCH_STATE_DIR": str(tmp_path)})
    assert s.net_limits == NetLimits()
    assert (s.net_limits.dns_rate, s.net_limits.dns_burst) == (200, 400)
    assert (s.net_limits.deny_log_rate, s.net_limits.deny_log_burst) == (20, 40)
    (tmp_path / "config.toml").write_text("dns_rate = 50\ndeny_log_burst = 7\n")
    s = load_settings(
        {
            "HUTCH_STATE_DIR": str(tmp_path),
            "HUTCH_DNS_BURST": "80",
            "HUTCH_PROXY_CONN_RATE": "12",
            "HUTCH_PROXY_CONN_BURST": "24",
            "HUTCH_DENY_LOG_RATE": "3",
            "HUTCH_DNS_RATE": "60",
        }
    )
    assert s.net_limits == NetLimits(
        dns_rate=60,
        dns_burst=80,
        proxy_conn_rate=12,
        proxy_conn_burst=24,
        deny_log_rate=3,
        deny_log_burst=7,
    )


@pytest.mark.parametrize(
    ("env", "value", "match"),
    [
        ("HUTCH_DNS_RATE", "0", r"HUTCH_DNS_RATE='0' is not valid; accepted: 1-100000 \(DNS"),
        ("HUTCH_DNS_RATE", "fast", r"HUTCH_DNS_RATE='fast' is not valid; accepted: 1-100000"),
        ("HUTCH_DNS_BURST", "-5", r"HUTCH_DNS_BURST='-5' .* 1-1000000 \(DNS queries at once"),
        ("HUTCH_PROXY_CONN_RATE", "1.5", r"HUTCH_PROXY_CONN_RATE='1.5' .*new proxy connections"),
        ("HUTCH_DENY_LOG_RATE", "100001", r"accepted: 1-100000 \(denied packets logged"),
    ],
)
def test_bad_net_limits_name_the_setting_and_the_range(
    tmp_path: Path, env: str, value: str, match: str
) -> None:
    with pytest.raises(InvalidArgument, match=match):
        load_settings({"HUTCH_STATE_DIR": str(tmp_path), env: value})


def test_bad_net_limit_in_the_file_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text("deny_log_burst = true\n")
    with pytest.raises(InvalidArgument, match=r"config.toml: deny_log_burst=True is not valid"):
        load_settings({"HUTCH_STATE_DIR": str(tmp_path)})
