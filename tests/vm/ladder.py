"""The VM test ladder: one sandbox walked up its lifecycle, with tests on every rung.

After Firecracker's fixtures by lifecycle stage (``vm`` → ``vm_booted`` → ``vm_paused``
→ ``vm_restored``), built for a machine where every boot costs seconds of TCG::

    sandbox_booted ──pause(memory)──► sandbox_paused ──resume──► sandbox_restored
    (a user's create: cold boot)      (no QEMU left)   (the same sandbox, a new QEMU
                                                        restored from the pause)
                                                               │ fork(2)
                                                               ▼
                                                        sandbox_forked (a child; its
                                                        sibling and the parent kept)

Every rung is built once, from the rung below, for the module that uses the ladder
(``tests/vm/test_ladder.py``), and ends with it: a ladder that lived to the end of the
session kept its VMs, the background ticker's among them (about 12% of a core under
TCG), running through the rest of the VM tier. A guest-facing test takes
``guest`` and runs on each of booted, restored and forked (ids ``[booted]`` ...), so a
restore or a fork that loses something a fresh boot has fails there. The rungs check
what each stage must keep or change (identity, clock, address, entropy, processes).

The sandboxes live in a real ``hutchd`` (``tests/e2e/conftest.py``'s ``Daemon``, its own
state dir, templates off so nothing boots in the background) and are driven through the
SDK, as a user would: the tests know nothing of the service's insides. Without root the
daemon gives sandboxes network "none", and the address checks check that instead.

Booted and restored are one sandbox at two times, so the order matters:
:func:`order_items` (called from ``tests/vm/conftest.py``) runs every ladder test
rung by rung, and a rung used after the ladder moved past it fails rather
than test the wrong stage. When a test that used the ladder fails, every ladder
sandbox's id, console tail and QEMU log and the daemon's log tail are attached to the
report (:meth:`Ladder.diagnostics`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from hutch.sdk import Client, Process, Sandbox
from tests.conftest import ensure_image
from tests.e2e.conftest import Daemon, finalize_daemon, tail
from tests.vm import guest_programs as gp

#: The rungs, bottom up; ``guest`` runs on GUEST_STAGES.
STAGES = ("booted", "paused", "restored", "forked")
GUEST_STAGES = ("booted", "restored", "forked")

SHAPE = {"vcpus": 2, "memory_mib": 384, "disk_gib": 3}
NAME = "ladder"
ENV = {"SANDBOX_VAR": "from-create"}
TICKER = "i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.2; done"
# The pause lasts at least this long, so a clock not corrected after resume is off by
# more than the clock check allows.
MIN_PAUSE_S = 3.0

_LADDER_KEY = pytest.StashKey["Ladder"]()


def sh(sb: Sandbox, cmd: str | list[str], **kw: object) -> str:
    """stdout of ``cmd``, which must succeed."""
    r = sb.exec(cmd, **kw)  # type: ignore[arg-type]
    assert r.exit_code == 0, f"{sb.id}: {cmd!r} -> {r}"
    return r.stdout


@dataclass(frozen=True)
class Identity:
    """What makes a guest itself, read inside the guest in one exec."""

    hostname: str
    machine_id: str
    boot_id: str
    mac: str
    address: str  # "10.x.y.z/30"; "" when it has none (network "none")
    gateway: str  # the default route's; "" without one

    @classmethod
    def read(cls, sb: Sandbox) -> Identity:
        out = sh(
            sb,
            "hostname; cat /etc/machine-id /proc/sys/kernel/random/boot_id "
            "/sys/class/net/eth0/address; "
            "echo $(ip -4 -o addr show dev eth0 scope global | awk '{print $4}'); "
            "echo $(ip -4 route show default | awk '{print $3}')",
        )
        hostname, machine_id, boot_id, mac, address, gateway = out.splitlines()
        return cls(hostname, machine_id, boot_id, mac, address, gateway)


@dataclass
class Rung:
    """One sandbox at one stage. ``identity`` and ``random`` were read right when the
    rung was built (for forks: as the first commands after the fork)."""

    stage: str
    sb: Sandbox
    ladder: Ladder
    identity: Identity
    random: str

    @property
    def expected_hostname(self) -> str:
        return self.sb.info.name or self.sb.id

    def require_current(self) -> None:
        """Fail unless the ladder still stands on this rung (booted and restored are one
        sandbox: a booted test run after the pause would test a restored guest)."""
        if self.stage != "forked" and self.ladder.position != self.stage:
            pytest.fail(
                f"the ladder is at {self.ladder.position!r}, past {self.stage!r}: "
                "ladder tests must run rung by rung (tests/vm/ladder.py order_items)"
            )


@dataclass
class Paused:
    """The paused rung, with what was started before the pause to check after it."""

    sb: Sandbox
    ticker: Process
    ticks_before: int
    pty_id: str
    secret: str
    paused_at: float


@dataclass
class Forked(Rung):
    """The fork child under test, its sibling and the parent (itself restored from the
    fork's frozen snapshot), with what each returned as the first commands it ran."""

    sibling: Rung | None = None
    parent: Rung | None = None


@dataclass
class Ladder:
    daemon: Daemon
    client: Client
    position: str = "none"
    sandboxes: dict[str, str] = field(default_factory=dict)  # id -> stage it joined at

    def diagnostics(self) -> list[tuple[str, str]]:
        """Report sections: each ladder sandbox's console and QEMU log, the daemon log."""
        sections = []
        for sid, stage in self.sandboxes.items():
            d = self.daemon.sandboxes_dir / sid
            sections.append(
                (f"ladder sandbox {sid} ({stage}) console tail", tail(d / "console.log"))
            )
            sections.append((f"ladder sandbox {sid} ({stage}) qemu.log", tail(d / "qemu.log")))
        sections.append(
            (f"ladder hutchd.log tail ({self.daemon.log_path})", tail(self.daemon.log_path, 6000))
        )
        return sections


def fixture_names(item: pytest.Item) -> list[str]:
    """The fixtures a test item uses (only ``pytest.Function`` items have any)."""
    return list(getattr(item, "fixturenames", ()))


def ladder_of(item: pytest.Item) -> Ladder | None:
    """The session's ladder if ``item`` used it, for the failure report."""
    names = fixture_names(item)
    if "ladder" not in names and "guest" not in names:
        return None
    return item.session.stash.get(_LADDER_KEY, None)


def rung_of(item: pytest.Item) -> int | None:
    """The rung ``item`` runs on (index in STAGES), None if it is not a ladder test."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "guest" in callspec.params:
        return STAGES.index(callspec.params["guest"])
    used = [i for i, stage in enumerate(STAGES) if f"sandbox_{stage}" in fixture_names(item)]
    return max(used) if used else None


def order_items(items: list[pytest.Item]) -> None:
    """Run the ladder tests rung by rung: they keep the slots they were collected in,
    sorted (stably) by rung; every other test stays where it was."""
    slots = [i for i, item in enumerate(items) if rung_of(item) is not None]
    ranked = sorted((items[i] for i in slots), key=lambda item: rung_of(item) or 0)
    for i, item in zip(slots, ranked, strict=True):
        items[i] = item


# -- fixtures (imported by tests/vm/conftest.py) ---------------------------------------------


@pytest.fixture(scope="module")
def ladder(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Ladder]:
    """A hutchd of the ladder's own (templates off: a user's first create of a shape is
    a cold boot, and the background template build would be one more boot)."""
    ensure_image("base")
    daemon = Daemon(tmp_path_factory.mktemp("ladder") / "state")
    daemon.daemon_env["HUTCH_TEMPLATES"] = "0"
    daemon.start()
    try:
        with daemon.client(timeout=300.0) as client:
            ladder = Ladder(daemon, client)
            request.session.stash[_LADDER_KEY] = ladder
            yield ladder
    finally:
        problems = finalize_daemon(daemon)
        assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def sandbox_booted(ladder: Ladder) -> Rung:
    """A sandbox as a user gets it from ``Sandbox.create``: a cold boot."""
    sb = Sandbox.create("base", name=NAME, env=ENV, client=ladder.client, **SHAPE)  # type: ignore[arg-type]
    ladder.sandboxes[sb.id] = "booted"
    ladder.position = "booted"
    return Rung("booted", sb, ladder, Identity.read(sb), sh(sb, gp.RANDOM_16))


def _ticks(proc: Process) -> int:
    """The last tick the ticker has printed."""
    lines = proc.output().stdout.split()
    return int(lines[-1]) if lines and lines[-1].isdigit() else 0


def _until(what: str, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def sandbox_paused(ladder: Ladder, sandbox_booted: Rung) -> Paused:
    """The booted sandbox paused with memory, after starting what a resume must keep: a
    background process (the process API), a terminal with a shell variable set, a
    Python value held only in memory, a listening socket with an open file."""
    sb = sandbox_booted.sb
    ladder.position = "paused"  # from here the booted rung is gone
    ticker = sb.processes.start(TICKER)
    _until("the ticker's third tick", lambda: _ticks(ticker) >= 3)
    with sb.pty.open(rows=20, cols=70) as term:
        term.read_until("#")  # root's prompt
        term.send("export V=set-before-pause; echo marker-$((6*7))\n")
        term.read_until("marker-42")
        pty_id = term.pty_id
    sh(sb, gp.HOLDER)
    _until("the holder", lambda: sh(sb, gp.HOLDER_UP) == "y\n")
    sh(sb, "echo keep > /root/file")
    sh(sb, gp.LISTENER)
    _until("the listener", lambda: "pong" in sh(sb, gp.PING + " 2>/dev/null || true"))
    secret = sh(sb, gp.ASK_HOLDER, timeout_s=30)
    ticks = _ticks(ticker)
    sb.pause("memory")
    return Paused(sb, ticker, ticks, pty_id, secret, time.time())


@pytest.fixture(scope="module")
def sandbox_restored(ladder: Ladder, sandbox_paused: Paused) -> Rung:
    """The paused sandbox resumed: a new QEMU restored from the pause's memory."""
    time.sleep(max(0.0, sandbox_paused.paused_at + MIN_PAUSE_S - time.time()))
    sb = sandbox_paused.sb
    sb.resume()
    ladder.position = "restored"
    return Rung("restored", sb, ladder, Identity.read(sb), sh(sb, gp.RANDOM_16))


@pytest.fixture(scope="module")
def sandbox_forked(ladder: Ladder, sandbox_restored: Rung) -> Forked:
    """A fork child of the restored sandbox (a fork of two: the sibling is kept to
    compare with; the parent is restored from the fork's snapshot too)."""
    parent = sandbox_restored.sb
    ladder.position = "forked"
    child, sibling = parent.fork(2)
    for sb in (child, sibling):
        ladder.sandboxes[sb.id] = "forked"
    # The first command each runs after the fork.
    randoms = {sb.id: sh(sb, gp.RANDOM_16) for sb in (child, sibling, parent)}

    def rung(sb: Sandbox, stage: str) -> Rung:
        return Rung(stage, sb, ladder, Identity.read(sb), randoms[sb.id])

    return Forked(
        "forked",
        child,
        ladder,
        Identity.read(child),
        randoms[child.id],
        sibling=rung(sibling, "forked"),
        parent=rung(parent, "fork parent"),
    )


@pytest.fixture(params=GUEST_STAGES)
def guest(request: pytest.FixtureRequest) -> Rung:
    """A guest-facing test runs on each of: booted, restored, forked."""
    rung: Rung = request.getfixturevalue(f"sandbox_{request.param}")
    rung.require_current()
    return rung
