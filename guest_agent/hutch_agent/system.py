"""The guest system the host fixes up: the clock, the kernel RNG, fast copies and a fixed
address layout under TCG."""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import struct
import time
from typing import Any

from hutch_agent import runtime

log = logging.getLogger("hutch-agent")


def set_clock(time_ns: Any) -> None:
    """The VM has no RTC: without this its clock starts at 1970 (or at the snapshot's)."""
    if isinstance(time_ns, int) and time_ns > 0:
        try:
            time.clock_settime_ns(time.CLOCK_REALTIME, time_ns)
        except OSError as exc:
            log.warning("could not set the clock: %s", exc)


RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)


def reseed_now() -> None:
    """Make the kernel's CRNG use the pool now (RNDRESEEDCRNG).

    Crediting entropy alone is not enough: Linux 6.1 reseeds on its own schedule (every
    60 s after the first two minutes), so clones of one snapshot would return the same
    /dev/urandom bytes until then.
    """
    try:
        fd = os.open("/dev/urandom", os.O_WRONLY)
    except OSError:
        return
    try:
        fcntl.ioctl(fd, RNDRESEEDCRNG)
    except OSError as exc:
        log.warning("could not reseed the kernel RNG: %s", exc)
    finally:
        os.close(fd)


def add_entropy(seed: bytes) -> None:
    """Credit ``seed`` to the kernel pool (RNDADDENTROPY); else just mix it in."""
    rndaddentropy = 0x40085203  # _IOW('R', 0x03, int[2])
    try:
        fd = os.open("/dev/random", os.O_WRONLY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, rndaddentropy, struct.pack("ii", len(seed) * 8, len(seed)) + seed)
        finally:
            os.close(fd)
        return
    except OSError as exc:
        log.warning("RNDADDENTROPY failed (%s); mixing into /dev/urandom", exc)
    try:
        with open("/dev/urandom", "wb") as f:
            f.write(seed)
    except OSError as exc:
        log.warning("could not seed the RNG: %s", exc)


# glibc copies and clears with `rep movsb`/`rep stosb` from a few KiB up when the CPU
# says ERMS, as QEMU's `-cpu max` does. TCG runs those one byte per loop trip: measured in
# the guest, a 64 KiB memcpy ran at 50 MiB/s this way and at 860 MiB/s with the vector
# loops these thresholds select instead. Every frame the agent moves is copied a few times.
TCG_TUNABLES = (
    "glibc.cpu.x86_rep_movsb_threshold=1073741824:glibc.cpu.x86_rep_stosb_threshold=1073741824"
)


def under_tcg(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this guest runs under QEMU's TCG (translated, not virtualized)."""
    try:
        with open(cpuinfo) as f:
            return "QEMU TCG CPU" in f.read()
    except OSError:
        return False


def exec_with_fast_copies() -> None:
    """Under TCG, re-exec this agent once with ``TCG_TUNABLES`` (glibc reads them only at
    start). Commands the agent runs get their own environment, without them. Returns
    when not under TCG, when already done, or when the exec fails."""
    if "GLIBC_TUNABLES" in os.environ or not under_tcg():
        return
    program, argv = runtime.self_argv()
    try:
        os.execve(program, argv, {**os.environ, "GLIBC_TUNABLES": TCG_TUNABLES})
    except OSError as exc:
        log.warning("could not re-exec with faster memory copies: %s", exc)


RANDOMIZE_VA_SPACE = "/proc/sys/kernel/randomize_va_space"


def keep_translations_reusable(
    cpuinfo: str = "/proc/cpuinfo", sysctl: str = RANDOMIZE_VA_SPACE
) -> None:
    """Under TCG, map every new program at the same addresses (``randomize_va_space``
    0): each command then reuses the code QEMU translated for the last one.

    Why: QEMU 7.2 keys a translated x86 block by its virtual address, so with address
    space randomization each new process has ld.so and libc at fresh addresses and QEMU
    translates them again. Measured in a guest: spawning ``/bin/true`` 26-38 ms with
    randomization, 4.7 ms without; ``echo`` 39-44 ms vs 6.5 ms; ``python3 -c pass``
    175 ms vs 85-97 ms. Randomization inside the guest guards its processes against
    each other, and the code a sandbox runs is root in it already; the sandbox's
    boundary is the VM, which this does not touch. A sandbox may turn it back on
    (``sysctl kernel.randomize_va_space=2``); under KVM it is left alone."""
    if not under_tcg(cpuinfo):
        return
    try:
        with open(sysctl, "w") as f:
            f.write("0\n")
    except OSError as exc:
        log.warning("could not fix the address layout for TCG: %s", exc)


def randomize_addresses(sysctl: str = RANDOMIZE_VA_SPACE) -> None:
    """Address-space randomization on (``randomize_va_space`` 2): the operator chose it
    over faster spawns under TCG (``HUTCH_GUEST_ASLR``; the hello says ``aslr``)."""
    try:
        with open(sysctl, "w") as f:
            f.write("2\n")
    except OSError as exc:
        log.warning("could not turn address-space randomization on: %s", exc)


#: Signals a terminal, a shell or an operator sends to a command, which the command must
#: meet with its default action. An agent started with them ignored (under ``nohup``, or
#: a background job of a non-interactive shell) would pass ``SIG_IGN`` on to every command
#: it runs: ``execve`` keeps an ignored signal ignored, while it resets a handled one.
COMMAND_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM)


def _ignore(signum: int, frame: object) -> None:
    """A handler that does nothing: the agent still ignores the signal, its commands do not."""


def keep_signal_defaults_for_commands() -> None:
    """Replace an inherited ``SIG_IGN`` of :data:`COMMAND_SIGNALS` by a handler that does
    nothing (so the agent goes on ignoring it, and ``execve`` gives every command the
    default back), without the ``preexec_fn`` per spawn that would cost exec its vfork."""
    for signum in COMMAND_SIGNALS:
        if signal.getsignal(signum) == signal.SIG_IGN:
            signal.signal(signum, _ignore)
