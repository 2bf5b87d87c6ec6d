"""Streamed answers that end properly: the stream they send is closed however they end
(which releases what the service's stream holds: its call is no longer in flight), and
a body the daemon cannot finish is never passed off as complete.

NDJSON answers (exec, code runs) carry their own error event at the end. A raw body (a
file download, a tar archive) has nowhere to put one, so when its source fails half way
the connection is aborted: the chunked body never gets its terminating chunk, and the
client sees an incomplete body (httpx: ``RemoteProtocolError``, which the SDK raises)
instead of a clean end after fewer bytes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from hutch.errors import HutchError

__all__ = ["TrackedStream"]

log = logging.getLogger(__name__)


class TrackedStream(StreamingResponse):
    """A :class:`StreamingResponse` that, exactly once when it is over (sent, failed, or
    the client went away, even before the body started), closes its body iterator and
    then calls ``on_close`` (the ``close`` of the service's stream the body is made of,
    when the body is not that stream itself). ``what`` names the body in the log line of
    an abort."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        on_close: Callable[[], None] = lambda: None,
        what: str,
        media_type: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self._content = content
        self._on_close = on_close
        self._what = what

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except HutchError as exc:
            # Return without finishing the body: the server then closes the connection
            # (ASGI), which is how an HTTP/1.1 chunked body says "incomplete".
            log.warning("%s cut short: %s", self._what, exc.message)
        finally:
            try:
                aclose = getattr(self._content, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()
            finally:
                self._on_close()
