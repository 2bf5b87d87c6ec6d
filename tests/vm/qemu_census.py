"""Count the QEMU processes a test run starts: cold boots and restores, per test module.

Every boot must earn its place in the VM tier (2 cores, one CI budget), so the tier
reports what it launched. A thread polls ``/proc`` every 10 ms for new
``qemu-system-*`` processes, wherever they come from (this process, a ``hutchd``
subprocess, a template build), and files each under the test pytest says is running
(``PYTEST_CURRENT_TEST``). A launch with ``-incoming`` is a restore (resume, fork,
template clone); any other is a boot (a cold launch: some tests kill it before the
guest is up). A QEMU that lives less than the poll interval (a launch refused at
once) may be missed; those boot nothing.

Only QEMU processes of this run are counted: started after the census was, and with
this run's mark in their environment (``HUTCH_TEST_RUN``, set by ``tests/conftest.py``
and inherited through every hutchd and QEMU the run starts), so a run beside it
(`make test`'s other lane) is not counted.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# A scan costs ~80 us (about 1% of a core at this rate); QEMUs a test launches only to
# kill at once live some 50 ms.
POLL_S = 0.01
RECHECKS = 20
#: The environment variable that marks every process of one test run (tests/conftest.py).
RUN_MARK = "HUTCH_TEST_RUN"


@dataclass
class Census:
    boots: Counter[str] = field(default_factory=Counter)
    restores: Counter[str] = field(default_factory=Counter)
    # Pids alive at the last scan: a pid that vanished and came back is a new process.
    _alive: set[str] = field(default_factory=set)
    # New pids not (yet) QEMU -> scans left to look at them again.
    _young: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _mark: bytes = b""

    def start(self) -> None:
        self._mark = f"{RUN_MARK}={os.environ.get(RUN_MARK, '')}".encode()
        self._scan(count=False)  # what already runs is not ours
        self._thread = threading.Thread(target=self._run, name="qemu-census", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._scan(count=True)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self._scan(count=True)

    def _scan(self, *, count: bool) -> None:
        now = {pid for pid in os.listdir("/proc") if pid.isdigit()}
        new, self._alive = now - self._alive, now
        if not count:
            return
        # A process caught between fork and exec still shows its parent's command line:
        # look at each new one again for a few scans.
        self._young = {p: n for p, n in self._young.items() if n > 0 and p in now}
        for pid in new | set(self._young):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"qemu-system" not in argv[0]:
                self._young[pid] = self._young.get(pid, RECHECKS) - 1
                continue
            self._young.pop(pid, None)
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if self._mark not in environ:
                continue  # another run's
            current = os.environ.get("PYTEST_CURRENT_TEST", "(outside a test)")
            module = current.split("::", 1)[0]
            (self.restores if b"-incoming" in argv else self.boots)[module] += 1

    def report(self) -> list[str]:
        modules = sorted(set(self.boots) | set(self.restores))
        lines = [f"{m}: {self.boots[m]} boots, {self.restores[m]} restores" for m in modules]
        lines.append(
            f"total: {sum(self.boots.values())} QEMU boots, {sum(self.restores.values())} restores"
        )
        return lines
