"""What a guest's identity puts in a ``hello`` or ``identity`` request, and what the
agent does with it (``aslr`` only when the operator asked: the guest's own setting is
otherwise never touched)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from hutch.guest.connection import GuestIdentity
from hutch.runtime.qemu.boot import identity_of

AGENT_DIR = str(Path(__file__).resolve().parents[2] / "guest_agent")
if AGENT_DIR not in sys.path:
    sys.path.insert(0, AGENT_DIR)

from hutch_agent import core  # noqa: E402


def test_aslr_is_sent_only_when_set() -> None:
    plain = identity_of("sb-0123456789ab", "box")
    assert plain.header() == {"hostname": "box", "machine_id": plain.machine_id, "net": None}
    kept = identity_of("sb-0123456789ab", "box", aslr=True)
    assert kept.header()["aslr"] is True
    assert kept.machine_id == plain.machine_id


@pytest.mark.parametrize(("field", "turned_on"), [(True, 1), (False, 0), ("yes", 0), (None, 0)])
def test_the_agent_turns_randomization_on_only_for_aslr_true(
    monkeypatch: pytest.MonkeyPatch, field: Any, turned_on: int
) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(core, "randomize_addresses", lambda: calls.append(True))
    monkeypatch.setattr("socket.sethostname", lambda _name: None)
    agent = core.Agent.__new__(core.Agent)
    agent.applied_net = None
    header: dict[str, Any] = {"hostname": "box", "net": None}
    if field is not None:
        header["aslr"] = field
    agent.take_identity(header)
    assert len(calls) == turned_on


def test_an_identity_without_aslr_is_as_before() -> None:
    ident = GuestIdentity(hostname="h", machine_id="b" * 32)
    assert "aslr" not in ident.header()
