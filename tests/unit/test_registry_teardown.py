"""The end of a sandbox is one call (hutch.services.registry.SandboxRegistry.teardown):
every resource is registered on the sandbox's TeardownStack as it is made, the stack
undoes them last-first, and no other service module tears a sandbox down by hand."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from hutch.config import Settings
from hutch.runtime.backend import Runtime, VmBackend
from hutch.services.images import ImageSource
from hutch.services.network import NetworkService
from hutch.services.registry import SandboxRegistry
from hutch.store import Store

SERVICES = Path(__file__).resolve().parents[2] / "src" / "hutch" / "services"
SID = "sb-0123456789ab"


class Host:
    """What the registry calls on the backend and the network, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail: set[str] = set()
        self.forwarder = SimpleNamespace(activity=None)

    def _call(self, what: str) -> None:
        self.calls.append(what)
        if what in self.fail:
            raise RuntimeError(f"{what} failed")

    async def cleanup(self, sandbox_id: str) -> None:
        self._call("files")

    async def kill_vm(self, sandbox_id: str) -> None:
        self._call("kill")

    async def detach(self, sandbox_id: str) -> None:
        self._call("network")

    def share_socket(self, sandbox_id: str, slot: int) -> Path:
        return Path("/nonexistent") / sandbox_id / f"share{slot}.sock"


class FakeRuntime:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.agent = SimpleNamespace(close_reason=None)

    async def destroy(self) -> None:
        self.host._call("destroy")


@pytest.fixture
def host() -> Host:
    return Host()


@pytest.fixture
def core(tmp_path: Path, host: Host) -> SandboxRegistry:
    settings = Settings(state_dir=tmp_path / "state")
    return SandboxRegistry(
        settings,
        Store(tmp_path / "hutch.db"),
        cast(VmBackend, host),
        cast(ImageSource, None),
        cast(NetworkService, host),
    )


def runtime(host: Host) -> Runtime:
    return cast(Runtime, FakeRuntime(host))


async def test_teardown_undoes_what_was_registered_last_first(
    core: SandboxRegistry, host: Host
) -> None:
    core.own_files(SID)
    core.own_network(SID)
    core.own_vm(SID)
    core.own_vm(SID)  # registered once however often it is asked
    rt = runtime(host)
    core.booted(SID, rt)
    await core.teardown(SID)
    # The VM (the runtime held, not a pidfile kill) before its network, files last.
    assert host.calls == ["destroy", "network", "files"]
    assert "deleted" in str(cast(Any, rt).agent.close_reason)


async def test_only_what_exists_is_undone(core: SandboxRegistry, host: Host) -> None:
    core.own_files(SID)  # a create that failed before it attached or booted anything
    await core.teardown(SID)
    assert host.calls == ["files"]


async def test_a_vm_with_no_runtime_held_is_killed_by_its_pidfile(
    core: SandboxRegistry, host: Host
) -> None:
    core.own_files(SID)
    core.own_vm(SID)  # the boot was cut before it returned a runtime
    await core.teardown(SID)
    assert host.calls == ["kill", "files"]


async def test_a_sandbox_not_made_by_this_daemon_owns_everything(
    core: SandboxRegistry, host: Host
) -> None:
    await core.teardown(SID)  # a row found at the start, never registered
    assert host.calls == ["kill", "network", "files"]
    host.calls.clear()
    core.own_vm(SID)  # e.g. resumed after a restart: its files and network come too
    await core.teardown(SID)
    assert host.calls == ["kill", "network", "files"]


async def test_a_failing_step_does_not_stop_the_others(core: SandboxRegistry, host: Host) -> None:
    core.own_all(SID)
    core.booted(SID, runtime(host))
    host.fail.add("destroy")
    with pytest.raises(RuntimeError, match="destroy failed"):
        await core.teardown(SID)
    assert host.calls == ["destroy", "network", "files"]


async def test_a_vm_that_stopped_on_its_own_keeps_its_streams_reason(
    core: SandboxRegistry, host: Host
) -> None:
    core.own_all(SID)
    rt = runtime(host)
    core.booted(SID, rt)
    await core.teardown(SID, deleted=False)
    assert cast(Any, rt).agent.close_reason is None


#: Calls that end a sandbox's resources; only the registry makes them. Reconcile also
#: removes the leftovers of sandboxes with no row (no stack) and makes sure a VM that did
#: not answer is gone before its row says paused; a terminal detaches from its pty.
ENDING = {"cleanup", "detach", "kill_vm", "destroy", "release_network"}
ALLOWED = {("reconcile.py", "cleanup"), ("reconcile.py", "kill_vm"), ("processes.py", "detach")}


def _ending_calls(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ENDING
        ):
            found.add(node.func.attr)
    return found


@pytest.mark.parametrize(
    "path",
    sorted(p for p in SERVICES.glob("*.py") if p.name not in ("registry.py", "network.py")),
    ids=lambda p: p.name,
)
def test_no_service_tears_a_sandbox_down_by_hand(path: Path) -> None:
    found = {c for c in _ending_calls(path) if (path.name, c) not in ALLOWED}
    assert not found, f"{path.name} ends a sandbox's resources itself: {sorted(found)}"


def test_the_teardown_check_can_fail(tmp_path: Path) -> None:
    module = tmp_path / "svc.py"
    module.write_text(
        "await self.backend.cleanup(sid)\nawait self._release_network(sid)\n"
        "await runtime.destroy()\n"
    )
    assert _ending_calls(module) == {"cleanup", "destroy"}


async def test_a_pooled_vm_that_died_while_waiting_is_torn_down(
    core: SandboxRegistry, host: Host
) -> None:
    import asyncio

    from hutch.images.build import ImageArtifacts
    from hutch.services.pool import WarmPool

    image = cast(ImageArtifacts, SimpleNamespace(name="base", digest="0" * 16))
    pool = WarmPool(core, size=1)
    dead = FakeRuntime(host)
    dead.agent.closed = True
    core.own_all(SID)  # as the pool's fill registers it
    core.booted(SID, cast(Runtime, dead))
    pool.give_back(image, (SID, cast(Runtime, dead)))
    assert pool.take(image, WarmPool.SHAPE) is None
    await asyncio.gather(*pool._discards)
    assert host.calls == ["destroy", "network", "files"]
    await pool.close()
