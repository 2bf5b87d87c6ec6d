"""The guest is a real VM, and bad input against the real daemon gets a clear error while
the sandbox keeps answering. One sandbox is shared by the module."""

from __future__ import annotations

import os
import platform
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from hutch import errors
from hutch.images.build import ImageArtifacts
from hutch.sdk import Client, Sandbox
from tests.e2e.conftest import Daemon

pytestmark = [pytest.mark.e2e, pytest.mark.vm]


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[Client]:
    with daemon.client() as c:
        yield c


@pytest.fixture(scope="module")
def sb(client: Client) -> Iterator[Sandbox]:
    with Sandbox.create(memory_mib=256, metadata={"suite": "guest"}, client=client) as box:
        yield box


def assert_still_answers(sb: Sandbox) -> None:
    r = sb.exec("echo ok")
    assert (r.exit_code, r.stdout) == (0, "ok\n")


def test_guest_runs_its_own_kernel(sb: Sandbox, client: Client, base_image: ImageArtifacts) -> None:
    guest = sb.exec(["uname", "-r"]).stdout.strip()
    served = {i.name: i for i in client.list_images()}["base"]
    assert guest == served.kernel_release
    assert guest != platform.release(), "uname -r in the guest is the host's kernel"
    # Proof that it is a VM with its own devices, not a namespace on this host.
    r = sb.exec("cat /sys/block/vda/size; nproc; hostname")
    sectors, cpus, hostname = r.stdout.splitlines()
    assert int(sectors) * 512 >= 4 << 30  # the 4 GiB overlay, grown into by hutch-init
    assert cpus == "1"
    assert hostname == sb.id
    r = sb.exec("awk '/MemTotal/ {print $2}' /proc/meminfo")
    assert 128 * 1024 < int(r.stdout) <= 256 * 1024


def test_unknown_image(client: Client) -> None:
    with pytest.raises(errors.UnknownImage) as exc:
        Sandbox.create(image="no-such-image", client=client)
    assert "no-such-image" in str(exc.value)
    assert not [s for s in client.list_sandboxes() if s.image == "no-such-image"]


@pytest.mark.parametrize(
    ("shape", "field"),
    [
        ({"vcpus": 0}, "vcpus"),
        ({"vcpus": 99}, "vcpus"),
        ({"memory_mib": 64}, "memory_mib"),
        ({"memory_mib": 1 << 20}, "memory_mib"),
        ({"disk_gib": 0}, "disk_gib"),
        ({"timeout_s": 0}, "timeout_s"),
    ],
)
def test_shape_out_of_range(
    daemon: Daemon, client: Client, shape: dict[str, int], field: str
) -> None:
    with pytest.raises(errors.InvalidArgument) as exc:
        Sandbox.create(client=client, **shape)  # type: ignore[arg-type]
    assert field in str(exc.value)
    # Straight from the daemon too (not a client-side check): 400 with the stable body.
    r = httpx.post(
        f"{daemon.url}/v1/sandboxes",
        json=shape,
        headers={"Authorization": f"Bearer {daemon.api_key}"},
        timeout=30,
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_argument"
    assert field in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "path",
    ["/proc/self/environ", "/proc/1/mem", "/sys/kernel/notes", "/dev/vda", "../../etc/passwd"],
)
def test_paths_outside_the_allowed_tree(sb: Sandbox, path: str) -> None:
    with pytest.raises(errors.InvalidArgument) as exc:
        sb.files.read(path)
    assert path.lstrip("./") in str(exc.value) or path in str(exc.value)
    with pytest.raises(errors.InvalidArgument):
        sb.files.write(path, b"x")
    assert_still_answers(sb)


def test_nonexistent_command(sb: Sandbox) -> None:
    with pytest.raises(errors.InvalidArgument) as exc:
        sb.exec(["no-such-command-xyz", "arg"])
    assert "no-such-command-xyz" in str(exc.value)
    # Through a shell it is the shell's business: exit 127 and its message.
    r = sb.exec("no-such-command-xyz")
    assert r.exit_code == 127 and "no-such-command-xyz" in r.stderr
    with pytest.raises((errors.InvalidArgument, errors.NotFound)):
        sb.exec(["true"], cwd="/no/such/dir")
    assert_still_answers(sb)


def test_exec_timeout_kills_the_command(sb: Sandbox) -> None:
    started = time.monotonic()
    with pytest.raises(errors.Timeout) as exc:
        sb.exec(["sleep", "300"], timeout_s=1.5)
    assert "timeout_s=1.5" in str(exc.value)
    assert time.monotonic() - started < 15
    # The command is gone from the guest, not left running.
    # (One cat over all cmdlines: a fork per process is slow under TCG. The bracket keeps
    # this shell's own command line from matching.)
    r = sb.exec(
        "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -c 'sleep 3[0]0' || true"
    )
    assert r.stdout.strip() == "0", r.stdout
    # Streaming ends with the same error.
    with pytest.raises(errors.Timeout):
        list(sb.exec_stream(["sh", "-c", "echo x; sleep 300"], timeout_s=1))
    assert_still_answers(sb)


def test_a_guest_that_answers_nothing_ends_an_exec_on_the_host(sb: Sandbox, daemon: Daemon) -> None:
    """The host's own bound on a command (``guest.commands.HOST_GRACE_S``) through the
    daemon and a real VM: with the sandbox's QEMU stopped (a guest that answers nothing,
    its agent included), an exec with ``timeout_s=1`` ends with a 504 ``timeout`` naming
    why about 31 s later instead of waiting for ever; continued, the sandbox answers."""
    pid = daemon.qemu_pid_of(sb.id)
    started = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(errors.Timeout, match="did not report the start of a command"):
            sb.exec(["true"], timeout_s=1)
    finally:
        os.kill(pid, signal.SIGCONT)
    waited = time.monotonic() - started
    assert 30 <= waited < 60, waited
    assert_still_answers(sb)


def test_unknown_sandbox(client: Client) -> None:
    with pytest.raises(errors.NotFound):
        Sandbox.connect("sb-000000000000", client=client)
    with pytest.raises(errors.NotFound):
        client.exec("sb-000000000000", "true")
    with pytest.raises(errors.NotFound):
        client.exec("not-an-id", "true")
