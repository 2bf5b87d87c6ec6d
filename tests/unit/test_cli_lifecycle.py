"""`hutch pause | resume | fork`, `create --auto-resume` and paused sandboxes in `ls` /
`inspect`, through click's CliRunner against the fake REST contract."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hutch.testing import FakeHutch
from tests.unit.conftest import inspect_rows, last


def test_pause_prints_the_id_and_defaults_to_memory(fake: FakeHutch, hutch: Any) -> None:
    sb = fake.add_sandbox()
    result = hutch("pause", sb.id)
    assert (result.exit_code, result.stdout, result.stderr) == (0, f"{sb.id}\n", "")
    assert last(fake) == ("POST", f"/v1/sandboxes/{sb.id}/pause", {"mode": "memory"})
    assert (sb.state, sb.pause_mode) == ("paused", "memory")


def test_pause_disk_json(fake: FakeHutch, hutch: Any) -> None:
    sb = fake.add_sandbox()
    data = json.loads(hutch("pause", sb.id, "--mode", "disk", "--json").stdout)
    assert last(fake)[2] == {"mode": "disk"}
    assert data == sb.to_json()
    assert (data["state"], data["pause_mode"]) == ("paused", "disk")
    assert data["paused_at"] is not None


def test_pause_errors(fake: FakeHutch, hutch: Any) -> None:
    sb = fake.add_sandbox()
    bad = hutch("pause", sb.id, "--mode", "hibernate")
    assert bad.exit_code == 2 and "'hibernate' is not one of 'memory', 'disk'" in bad.stderr
    hutch("pause", sb.id)
    again = hutch("pause", sb.id)
    assert again.exit_code == 1
    assert again.stderr == f"error: sandbox {sb.id} is paused; this needs it to be running\n"
    missing = hutch("pause", "sb-000000000999")
    assert (missing.exit_code, missing.stderr) == (
        1,
        "error: no sandbox sb-000000000999\n",
    )


def test_resume(fake: FakeHutch, hutch: Any) -> None:
    sb = fake.add_sandbox()
    sb.pause("memory")
    result = hutch("resume", sb.id)
    assert (result.exit_code, result.stdout, result.stderr) == (0, f"{sb.id}\n", "")
    assert last(fake)[:2] == ("POST", f"/v1/sandboxes/{sb.id}/resume")
    assert sb.state == "running"
    data = json.loads(hutch("resume", sb.id, "--json").stdout)  # running: a no-op
    assert (data["state"], data["pause_mode"], sb.resumes) == ("running", None, 1)
    sb.state = "destroyed"
    gone = hutch("resume", sb.id)
    assert gone.exit_code == 1 and "is destroyed" in gone.stderr


def test_fork_prints_one_child_id_per_line(fake: FakeHutch, hutch: Any) -> None:
    sb = fake.add_sandbox()
    result = hutch("fork", sb.id, "--count", "3")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == ["sb-000000000002", "sb-000000000003", "sb-000000000004"]
    assert result.stderr == ""
    assert last(fake) == ("POST", f"/v1/sandboxes/{sb.id}/fork", {"count": 3})
    assert all(fake.sandboxes[i].parent_id == sb.id for i in result.stdout.split())
    assert sb.state == "running"
    one = hutch("fork", sb.id)
    assert one.stdout == "sb-000000000005\n" and last(fake)[2] == {"count": 1}


def test_fork_json_lists_the_children(fake: FakeHutch, hutch: Any) -> None:
    sb = fake.add_sandbox(metadata={"team": "a"})
    data = json.loads(hutch("fork", sb.id, "-n", "2", "--json").stdout)
    assert [c["id"] for c in data] == ["sb-000000000002", "sb-000000000003"]
    assert [c["parent_id"] for c in data] == [sb.id, sb.id]
    assert data[0] == fake.sandboxes["sb-000000000002"].to_json()


@pytest.mark.parametrize("count", ["0", "101", "two"])
def test_fork_bad_count_is_a_usage_error(fake: FakeHutch, hutch: Any, count: str) -> None:
    sb = fake.add_sandbox()
    sent = len(fake.requests)
    result = hutch("fork", sb.id, "--count", count)
    assert result.exit_code == 2 and "--count" in result.stderr
    assert len(fake.requests) == sent


def test_fork_of_a_stopping_sandbox_is_an_error(fake: FakeHutch, hutch: Any) -> None:
    sb = fake.add_sandbox()
    sb.state = "stopping"
    result = hutch("fork", sb.id)
    assert result.exit_code == 1 and result.stdout == ""
    assert "is stopping; this needs it to be running or paused" in result.stderr


def test_create_auto_resume(fake: FakeHutch, hutch: Any) -> None:
    assert hutch("create", "--auto-resume").stdout == "sb-000000000001\n"
    assert last(fake)[2]["auto_resume"] is True
    hutch("create")
    assert "auto_resume" not in last(fake)[2]  # an older daemon never sees the field
    auto = fake.sandboxes["sb-000000000001"]
    assert inspect_rows(hutch("inspect", auto.id).stdout)["auto_resume"] == "yes"
    assert "auto_resume" not in inspect_rows(hutch("inspect", "sb-000000000002").stdout)
    auto.pause("disk")
    result = hutch("exec", auto.id, "echo", "hi")
    assert (result.exit_code, result.stdout, auto.state) == (0, "hi\n", "running")


def test_exec_on_a_paused_sandbox_says_so(fake: FakeHutch, hutch: Any) -> None:
    sb = fake.add_sandbox()
    sb.pause("memory")
    result = hutch("exec", sb.id, "true")
    assert result.exit_code == 1
    assert result.stderr == f"error: sandbox {sb.id} is paused; this needs it to be running\n"


def test_ls_and_inspect_show_paused_and_forked_sandboxes(fake: FakeHutch, hutch: Any) -> None:
    running = fake.add_sandbox()
    paused = fake.add_sandbox()
    paused.pause("memory")
    disk = fake.add_sandbox()
    disk.pause("disk")
    rows = [line.split() for line in hutch("ls").stdout.splitlines()[1:]]
    assert [(r[0], r[3]) for r in rows] == [
        (running.id, "running"),
        (paused.id, "paused:memory"),
        (disk.id, "paused:disk"),
    ]
    only = json.loads(hutch("ls", "--state", "paused", "--json").stdout)
    assert [s["id"] for s in only] == [paused.id, disk.id]
    assert only[0]["pause_mode"] == "memory"
    shown = inspect_rows(hutch("inspect", paused.id).stdout)
    assert shown["state"] == "paused:memory"
    assert shown["paused"] == "2026-11-30 03:05:00"
    assert "parent" not in shown
    (child_id,) = hutch("fork", paused.id).stdout.split()
    child = inspect_rows(hutch("inspect", child_id).stdout)
    assert (child["parent"], child["state"]) == (paused.id, "running")
    assert "paused" not in child


def test_lifecycle_commands_on_a_terminal_keep_stdout_clean(
    fake: FakeHutch, hutch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rich treats stderr as a terminal and shows spinners there; stdout stays the ids.
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    sb = fake.add_sandbox()
    paused = hutch("pause", sb.id, "--mode", "disk")
    assert paused.stdout == f"{sb.id}\n"
    assert f"pausing {sb.id} (disk)..." in paused.stderr
    resumed = hutch("resume", sb.id)
    assert resumed.stdout == f"{sb.id}\n" and f"resuming {sb.id}..." in resumed.stderr
    forked = hutch("fork", sb.id, "-n", "2")
    assert forked.stdout.split() == ["sb-000000000002", "sb-000000000003"]
    assert f"forking {sb.id} into 2 sandboxes..." in forked.stderr


def test_help_describes_the_lifecycle_commands(hutch: Any) -> None:
    text = hutch("--help").stdout
    for command in ("pause", "resume", "fork"):
        assert f"  {command} " in text, command
    fork_help = hutch("fork", "--help").stdout
    assert "--count" in fork_help and "1<=x<=100" in fork_help
    assert "memory|disk" in hutch("pause", "--help").stdout
