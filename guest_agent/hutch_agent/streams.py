"""One request stream (credit-based flow control, inbound DATA frames) and the table of a
host session's streams.

Nothing here knows the :class:`~hutch_agent.core.Agent`: a stream writes through a
:class:`Sender` (the agent), and reaches the other streams of its session through its
:class:`Session` (``signal`` targets another stream's command).
"""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from typing import Any, Protocol

from hutch_agent.framing import CREDIT, DATA, EOF, WINDOW, Frame, encode


class Cancelled(Exception):
    """The host cancelled the stream or went away."""


class Sender(Protocol):
    """Writes encoded frames to the host (the agent's transport)."""

    def send(self, data: bytes, stream: Stream | None = None) -> None:
        """Write ``data``; dropped when ``stream`` was cancelled (a reset session)."""


class Session:
    """The streams of one host session by id, behind one lock (requests run in their
    own threads; frames arrive on the reader's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[int, Stream] = {}

    def open(self, st: Stream) -> bool:
        """Add ``st``; False if its id is in use."""
        with self._lock:
            if st.sid in self._streams:
                return False
            self._streams[st.sid] = st
            return True

    def get(self, sid: object) -> Stream | None:
        with self._lock:
            return self._streams.get(sid) if isinstance(sid, int) else None

    def pop(self, sid: int) -> Stream | None:
        with self._lock:
            return self._streams.pop(sid, None)

    def close(self, st: Stream) -> None:
        """Forget ``st`` (not a newer stream that took its id)."""
        with self._lock:
            if self._streams.get(st.sid) is st:
                del self._streams[st.sid]

    def reset(self) -> list[Stream]:
        """Forget every stream; return them (to be cancelled)."""
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        return streams


class Stream:
    def __init__(self, sender: Sender, sid: int, session: Session | None = None) -> None:
        self.sender, self.sid = sender, sid
        #: The other streams of this host session.
        self.session = session if session is not None else Session()
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
        self.sender.send(encode(ftype, self.sid, header, payload, channel), self)

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
