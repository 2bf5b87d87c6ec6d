"""One request stream: credit-based flow control and inbound DATA frames."""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Any

from hutch_agent.framing import CREDIT, DATA, EOF, WINDOW, Frame, encode

if TYPE_CHECKING:
    from hutch_agent.core import Agent


class Cancelled(Exception):
    """The host cancelled the stream or went away."""


class Stream:
    def __init__(self, agent: Agent, sid: int) -> None:
        self.agent, self.sid = agent, sid
        self.cond = threading.Condition()
        self.credit = WINDOW
        self.cancelled = False
        self.inbound: queue.Queue[Frame | None] = queue.Queue()
        self.proc: subprocess.Popen[bytes] | None = None
        self.reaped = False

    def send(
        self,
        ftype: int,
        header: dict[str, Any] | None = None,
        payload: bytes = b"",
        channel: int = 0,
    ) -> None:
        self.agent.send(encode(ftype, self.sid, header, payload, channel), self)

    def take_credit(self, deadline: float | None = None) -> bool:
        """Wait for one credit. False if cancelled or the deadline passed first."""
        with self.cond:
            while self.credit <= 0 and not self.cancelled:
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    return False
                self.cond.wait(wait)
            if self.cancelled:
                return False
            self.credit -= 1
            return True

    def grant(self, n: int) -> None:
        with self.cond:
            self.credit += n
            self.cond.notify_all()

    def cancel(self) -> None:
        with self.cond:
            self.cancelled = True
            self.cond.notify_all()
        self.inbound.put(None)

    def inbound_frames(self) -> Any:
        """Yield host DATA payloads until EOF, granting credit back as they are used.

        Raises Cancelled if the host goes away or cancels first.
        """
        consumed = 0
        while True:
            f = self.inbound.get()
            if f is None:
                raise Cancelled()
            if f.type == EOF:
                return
            if f.type == DATA:
                yield f.payload
                consumed += 1
                if consumed >= WINDOW // 2:
                    self.send(CREDIT, {"n": consumed})
                    consumed = 0
