"""Test doubles for code that uses hutch: an in-memory fake of the REST API v1.

``FakeHutch().transport`` is an ``httpx.MockTransport`` that the SDK's clients and
sandboxes take as ``transport=``; no daemon, no VMs::

    from hutch import Sandbox
    from hutch.testing import FakeHutch, FakeRun

    fake = FakeHutch()
    fake.exec_handler = lambda sb, body: FakeRun([("stdout", "hi\\n")], exit_code=0)
    with Sandbox.create(transport=fake.transport, api_key=fake.api_key) as sb:
        assert sb.exec("echo hi").stdout == "hi\\n"

The fake is a second implementation of the contract (:mod:`hutch.contract`): it raises
the real error classes, answers them with the daemon's statuses and codes, and uses the
daemon's limits and egress rule grammar. One contract suite
(``tests/component/test_contract.py``) runs against it and the real REST app.
"""

from __future__ import annotations

from hutch.testing._fake import FakeHutch
from hutch.testing._net import FakeNetwork
from hutch.testing._state import FakeError, FakeRun, FakeSandbox, FakeSnapshot

__all__ = ["FakeError", "FakeHutch", "FakeNetwork", "FakeRun", "FakeSandbox", "FakeSnapshot"]
