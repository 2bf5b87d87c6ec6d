"""`hutch snapshot create | ls | inspect | rm`, `create --snapshot --auto-pause
--auto-delete` and the new `inspect` rows, through click's CliRunner against the fake."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hutch.testing import FakeHutch
from tests.unit.conftest import inspect_rows, last


def test_snapshot_create_prints_the_snapshot_id(fake: FakeHutch, hutch: Any) -> None:
    sb = fake.add_sandbox()
    result = hutch("snapshot", "create", sb.id, "warm")
    assert (result.exit_code, result.stdout, result.stderr) == (0, "snap-000000000001\n", "")
    assert last(fake) == ("POST", f"/v1/sandboxes/{sb.id}/snapshots", {"name": "warm"})
    assert sb.state == "running"
    data = json.loads(hutch("snapshot", "create", sb.id, "warm", "--json").stdout)
    assert data == fake.snapshots["snap-000000000002"].to_json()
    assert (data["name"], data["sandbox_id"]) == ("warm", sb.id)


def test_snapshot_create_errors(fake: FakeHutch, hutch: Any) -> None:
    sb = fake.add_sandbox()
    bad = hutch("snapshot", "create", sb.id, "Warm_1")
    assert bad.exit_code == 1 and bad.stdout == ""
    assert bad.stderr.startswith("error: name='Warm_1' is not valid; use 1-63 lowercase")
    missing = hutch("snapshot", "create", "sb-000000000999", "x")
    assert (missing.exit_code, missing.stderr) == (
        1,
        "error: no sandbox sb-000000000999\n",
    )
    sb.state = "destroyed"
    gone = hutch("snapshot", "create", sb.id, "x")
    assert gone.exit_code == 1 and "is destroyed; this needs it to be running or paused" in (
        gone.stderr
    )
    usage = hutch("snapshot", "create", sb.id)
    assert usage.exit_code == 2 and "Missing argument 'NAME'" in usage.stderr
    assert fake.snapshots == {}


def test_snapshot_ls_table_and_json(fake: FakeHutch, hutch: Any) -> None:
    assert hutch("snapshot", "ls").stdout.split() == [
        "ID",
        "NAME",
        "SANDBOX",
        "IMAGE",
        "SIZE",
        "CREATED",
    ]
    small = fake.add_sandbox(memory_mib=128)
    big = fake.add_sandbox(image="devbox", memory_mib=2048)
    fake.add_snapshot(small, "small")
    fake.add_snapshot(big, "big")
    lines = hutch("snapshot", "ls").stdout.splitlines()
    rows = [line.split() for line in lines[1:]]
    # One word per column, sizes included, so `awk '{print $5}'` works.
    assert rows == [
        ["snap-000000000001", "small", small.id, "base", "128.0MiB", "2026-11-30", "03:10:00"],
        ["snap-000000000002", "big", big.id, "devbox", "2.0GiB", "2026-11-30", "03:10:00"],
    ]
    data = json.loads(hutch("snapshot", "ls", "--json").stdout)
    assert data == [s.to_json() for s in fake.snapshots.values()]


def test_snapshot_inspect(fake: FakeHutch, hutch: Any) -> None:
    sb = fake.add_sandbox(vcpus=2, memory_mib=1024, disk_gib=8)
    snap = fake.add_snapshot(sb, "ready")
    shown = inspect_rows(hutch("snapshot", "inspect", snap.id).stdout)
    assert shown == {
        "id": snap.id,
        "name": "ready",
        "sandbox": sb.id,
        "image": "base",
        "vcpus": "2",
        "memory": "1024 MiB",
        "disk": "8 GiB",
        "size": "1.0 GiB",
        "created": "2026-11-30 03:10:00",
    }
    assert json.loads(hutch("snapshot", "inspect", snap.id, "--json").stdout) == snap.to_json()
    missing = hutch("snapshot", "inspect", "snap-00000000dead")
    assert missing.exit_code == 1
    assert missing.stderr == (
        "error: no snapshot 'snap-00000000dead'; ids look like snap-0123456789ab\n"
    )


def test_snapshot_rm_removes_each_and_reports_failures(fake: FakeHutch, hutch: Any) -> None:
    sources = [fake.add_sandbox() for _ in range(3)]
    free, used, other = (fake.add_snapshot(sb, n) for sb, n in zip(sources, "abc", strict=True))
    user = fake.add_sandbox(snapshot=used.id)
    # Any order: a snapshot a live sandbox was started from deletes too.
    result = hutch("snapshot", "rm", free.id, used.id, "snap-000000000bad", other.id)
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [free.id, used.id, other.id]
    assert result.stderr.splitlines() == [
        "error: snap-000000000bad: no snapshot 'snap-000000000bad'; ids look like "
        "snap-0123456789ab",
    ]
    assert fake.snapshots == {}
    assert fake.sandboxes[user.id].state == "running"
    assert hutch("snapshot", "rm").exit_code == 2


def test_create_from_a_snapshot(fake: FakeHutch, hutch: Any) -> None:
    src = fake.add_sandbox(image="devbox", vcpus=2)
    src.files["/root/app.py"] = b"print(1)"
    snap_id = hutch("snapshot", "create", src.id, "app").stdout.strip()
    result = hutch("create", "--snapshot", snap_id)
    assert result.exit_code == 0, result.stderr
    new = fake.sandboxes[result.stdout.strip()]
    assert last(fake)[2] == {"snapshot": snap_id}
    assert (new.spec["image"], new.spec["vcpus"], new.files["/root/app.py"]) == (
        "devbox",
        2,
        b"print(1)",
    )
    shown = inspect_rows(hutch("inspect", new.id).stdout)
    assert (shown["snapshot"], shown["image"], shown["vcpus"]) == (snap_id, "devbox", "2")
    assert "snapshot" not in inspect_rows(hutch("inspect", src.id).stdout)
    assert json.loads(hutch("inspect", new.id, "--json").stdout)["snapshot_id"] == snap_id


def test_create_from_a_snapshot_refuses_image_and_shape_options(
    fake: FakeHutch, hutch: Any
) -> None:
    sent = len(fake.requests)
    result = hutch("create", "--snapshot", "snap-000000000001", "--memory", "1024", "--image", "x")
    assert result.exit_code == 2
    assert "--snapshot brings its own image and shape; drop --image, --memory" in result.stderr
    # Naming the default value is still naming it: the snapshot decides.
    again = hutch("create", "--snapshot", "snap-000000000001", "--vcpus", "1")
    assert again.exit_code == 2 and "drop --vcpus" in again.stderr
    assert len(fake.requests) == sent
    missing = hutch("create", "--snapshot", "snap-000000000001")
    assert missing.exit_code == 1 and "no snapshot 'snap-000000000001'" in missing.stderr


def test_create_with_policies(fake: FakeHutch, hutch: Any) -> None:
    result = hutch("create", "--auto-pause", "300", "--auto-delete", "86400")
    assert result.exit_code == 0, result.stderr
    body = last(fake)[2]
    assert (body["auto_pause_s"], body["auto_delete_s"]) == (300, 86400)
    shown = inspect_rows(hutch("inspect", result.stdout.strip()).stdout)
    assert (shown["auto_pause"], shown["auto_delete"]) == ("300 s idle", "86400 s paused")
    plain = hutch("create").stdout.strip()
    assert not {"auto_pause_s", "auto_delete_s", "snapshot"} & set(last(fake)[2])
    assert not {"auto_pause", "auto_delete", "snapshot"} & set(
        inspect_rows(hutch("inspect", plain).stdout)
    )


@pytest.mark.parametrize(
    ("option", "value"),
    [("--auto-pause", "59"), ("--auto-pause", "86401"), ("--auto-delete", "2592001")],
)
def test_policies_out_of_range_are_usage_errors(
    fake: FakeHutch, hutch: Any, option: str, value: str
) -> None:
    result = hutch("create", option, value)
    assert result.exit_code == 2 and option in result.stderr and value in result.stderr
    assert fake.requests == []


def test_snapshot_create_on_a_terminal_keeps_stdout_clean(
    fake: FakeHutch, hutch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    sb = fake.add_sandbox()
    result = hutch("snapshot", "create", sb.id, "tty")
    assert result.stdout == "snap-000000000001\n"
    assert f"snapshotting {sb.id} as tty..." in result.stderr
    created = hutch("create", "--snapshot", "snap-000000000001")
    assert created.stdout == "sb-000000000002\n"
    assert "booting a sandbox from snap-000000000001..." in created.stderr


def test_snapshot_create_off_a_terminal_prints_no_spinner(
    fake: FakeHutch, hutch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TTY_COMPATIBLE", "0")
    sb = fake.add_sandbox()
    assert hutch("snapshot", "create", sb.id, "quiet").stderr == ""


def test_help_describes_the_snapshot_commands(hutch: Any) -> None:
    assert "  snapshot " in hutch("--help").stdout
    text = hutch("snapshot", "--help").stdout
    for command in ("create", "ls", "inspect", "rm"):
        assert f"  {command} " in text, command
    create_help = hutch("create", "--help").stdout
    assert "--snapshot SNAP" in create_help
    assert "--auto-pause S" in create_help and "60<=x<=86400" in create_help
    assert "--auto-delete S" in create_help and "60<=x<=2592000" in create_help
