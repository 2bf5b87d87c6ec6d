"""The sandbox state machine (hutch.services.state): the table, its guard, and that it is
the only writer of a sandbox's state."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from hutch.errors import NotFound, StateError, Unavailable
from hutch.models import SandboxRecord, SandboxState, Shape
from hutch.services.state import TRANSITIONS, SandboxStates, allowed_from, require
from hutch.store import Store

S = SandboxState
SRC = Path(__file__).resolve().parents[2] / "src" / "hutch"
SID = "sb-0123456789ab"


def record(state: SandboxState = S.CREATING) -> SandboxRecord:
    return SandboxRecord(id=SID, image="base", state=state, shape=Shape(), created_at=time.time())


@pytest.fixture
def states(db_target: Path | str) -> SandboxStates:
    return SandboxStates(Store(db_target))


def test_the_table_covers_every_state_and_ends_only_in_end_states() -> None:
    assert set(TRANSITIONS) == set(SandboxState)
    for state, targets in TRANSITIONS.items():
        assert (not targets) == (not state.is_live), state
    reached, todo = {S.CREATING}, [S.CREATING]
    while todo:
        for nxt in TRANSITIONS[todo.pop()] - reached:
            reached.add(nxt)
            todo.append(nxt)
    assert reached == set(SandboxState), "every state is reachable from creating"


def test_a_move_the_table_allows_is_written_with_its_fields(states: SandboxStates) -> None:
    states.insert(record())
    states.running(record())
    rec = states.move(SID, S.PAUSING, pause_mode=None, resume_from="/x", resume_clone=True)
    assert rec.state is S.PAUSING and rec.resume_from == "/x"
    assert states.get(SID) == rec
    back = states.running_again(SID)
    assert (back.state, back.resume_from, back.resume_clone) == (S.RUNNING, None, False)
    ended = states.ended(SID, S.FAILED, "it died")
    assert (ended.state, ended.error) == (S.FAILED, "it died") and ended.ended_at


def test_a_move_the_table_refuses_raises_and_writes_nothing(states: SandboxStates) -> None:
    states.insert(record())
    states.running(record())
    states.move(SID, S.STOPPING)
    states.ended(SID, S.DESTROYED)
    with pytest.raises(StateError) as err:
        states.move(SID, S.RUNNING)
    assert err.value.state == "destroyed"
    assert set(err.value.required) == {str(s) for s in allowed_from(S.RUNNING)}
    assert "sandbox sb-0123456789ab is destroyed; this needs it to be" in err.value.message
    assert states.get(SID).state is S.DESTROYED
    with pytest.raises(StateError):
        states.move(SID, S.FAILED)  # an end state is for good


def test_a_new_row_starts_creating(states: SandboxStates) -> None:
    with pytest.raises(StateError):
        states.insert(record(S.RUNNING))
    assert states.current(SID) is None


def test_only_the_fields_of_a_state_go_with_it(states: SandboxStates) -> None:
    states.insert(record())
    with pytest.raises(ValueError, match="name"):
        states.move(SID, S.RUNNING, name="renamed")
    assert states.get(SID).state is S.CREATING


def test_require_says_what_was_found_and_what_is_needed() -> None:
    with pytest.raises(StateError) as err:
        require(record(S.PAUSED), S.RUNNING, hint="resume it")
    assert err.value.message == (
        "sandbox sb-0123456789ab is paused; this needs it to be running (resume it)"
    )
    assert require(record(S.RUNNING), S.RUNNING, S.PAUSED).state is S.RUNNING


def _state_writes(path: Path) -> list[int]:
    """Lines of ``path`` that write a sandbox's state to the store directly."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name = node.func.attr
        if name == "insert_sandbox" or (
            name == "update_sandbox" and any(k.arg in ("state", None) for k in node.keywords)
        ):
            lines.append(node.lineno)
    return lines


def test_the_state_machine_is_the_only_writer_of_a_sandbox_state() -> None:
    writers = {
        str(path.relative_to(SRC)): lines
        for path in sorted(SRC.rglob("*.py"))
        if path.parts[-2] != "store" and (lines := _state_writes(path))
    }
    assert writers == {"services/state.py": writers.get("services/state.py", [])}
    assert len(writers["services/state.py"]) == 2  # insert, and move


def test_the_writer_check_can_fail(tmp_path: Path) -> None:
    module = tmp_path / "x.py"
    module.write_text(
        "store.update_sandbox(sid, state=SandboxState.RUNNING)\n"
        "store.update_sandbox(sid, error='x')\nstore.insert_sandbox(rec)\n"
        "store.update_sandbox(sid, **changes)\n"
    )
    assert _state_writes(module) == [1, 3, 4]


def test_another_projects_sandbox_is_not_found_even_while_it_is_checked(
    states: SandboxStates,
) -> None:
    """After a restart a sandbox being checked answers 503 to its own project; to any
    other project it is 404 like a missing id (a 503 would tell that it exists)."""
    rec = SandboxRecord(
        id="sb-000000000001",
        image="base",
        state=SandboxState.CREATING,
        shape=Shape(),
        created_at=time.time(),
        project="alpha",
    )
    states.insert(rec)
    states.checking.add(rec.id)
    with pytest.raises(Unavailable):
        states.get(rec.id, "alpha")
    with pytest.raises(NotFound) as missing:
        states.get("sb-000000000002", "beta")
    with pytest.raises(NotFound) as other:
        states.get(rec.id, "beta")
    assert str(other.value) == str(missing.value).replace("sb-000000000002", rec.id)
