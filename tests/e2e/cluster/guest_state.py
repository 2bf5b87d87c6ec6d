"""Guest state that must survive a move, for the cluster tests: a counter process and
a Python variable."""

from __future__ import annotations

from hutch.sdk import Client, Sandbox
from tests.e2e.cluster_lab import MEMORY_MIB
from tests.e2e.conftest import wait_for

__all__ = ["COUNTER", "counter", "kept_state", "with_state"]

# Written to a new file and renamed: a reader never sees the file truncated and empty.
COUNTER = (
    "setsid -f sh -c 'i=0; while :; do i=$((i+1)); "
    "echo $i > /tmp/c.new; mv /tmp/c.new /tmp/c; sleep 0.2; done'"
)


def counter(c: Client, sandbox_id: str) -> int:
    return int(c.exec(sandbox_id, ["cat", "/tmp/c"]).stdout.strip())


def with_state(c: Client, **options: object) -> tuple[Sandbox, int]:
    """A sandbox (created through ``c``) running a counter process and holding a Python
    variable (x = 41) in its interpreter; the handle (its context) and the counter."""
    info = c.create_sandbox(memory_mib=MEMORY_MIB, **options)  # type: ignore[arg-type]
    c.exec(info.id, ["sh", "-c", COUNTER])
    assert wait_for(lambda: c.exec(info.id, ["test", "-s", "/tmp/c"]).exit_code == 0, 30)
    sb = Sandbox(c, info)
    assert sb.run_code("x = 41\nx").text == "41"
    return sb, counter(c, info.id)


def kept_state(c: Client, sb: Sandbox, before: int, context: str | None = None) -> None:
    """The counter process ran on (past ``before``) and the variable is there (in the
    handle's context, or ``context``: a fork child's is its parent's)."""
    first = counter(c, sb.id)
    assert first >= before
    assert wait_for(lambda: counter(c, sb.id) > first, 20), "the counter process runs on"
    assert sb.run_code("x + 1", context).text == "42"
