"""One host uploads under a blob store prefix at a time (:class:`UploadClaim`).

Two hosts that both hold what belongs under one prefix (an image's content imported on
both, a template both built) would otherwise both send it, and the bucket could end up
with the blobs of one and the database's record of the other. So before it sends
anything a host claims the prefix in the database (``ImageUploadStore.claim``: one
statement, one winner), renews the claim while it sends (a large file: every
``CLAIM_RENEW_S``), checks it once more just before it writes the record (a claim taken
over as stale is another host's upload now), and releases it once the upload is
complete: the record and the index are then the truth. Another host's claim is a
``Conflict`` naming that host; the caller's background upload retries it until that
upload completes (nothing left to send) or the claim goes stale (``CLAIM_STALE_S``
without renewal: its host died) and is taken over.
"""

from __future__ import annotations

import time

from hutch.errors import Conflict
from hutch.store.image_uploads import CLAIM_STALE_S, ImageUploadStore

__all__ = ["CLAIM_RENEW_S", "UploadClaim"]

#: Seconds between two renewals of a claim while its holder sends.
CLAIM_RENEW_S = 300.0


class UploadClaim:
    """This host's claim on the upload under ``prefix`` (``what`` names it in messages)."""

    def __init__(
        self,
        records: ImageUploadStore,
        prefix: str,
        host: str,
        what: str,
        *,
        renew_s: float = CLAIM_RENEW_S,
    ) -> None:
        self.records = records
        self.prefix = prefix
        self.host = host
        self.what = what
        self.renew_s = renew_s
        self._renewed = 0.0

    def take(self) -> None:
        """Claim (or renew) the prefix; ``Conflict`` naming the host whose claim holds
        it. Blocking (one statement)."""
        if self.records.claim(self.prefix, self.host):
            self._renewed = time.monotonic()
            return
        other = self.records.claimant(self.prefix)
        who = f"host {other.host}" if other is not None else "another host"
        age = f" {time.time() - other.claimed_at:.0f} s ago" if other is not None else ""
        raise Conflict(
            f"{self.what}: {who} claimed its upload{age}; this host waits for that upload "
            f"to complete or for the claim to go stale ({CLAIM_STALE_S:.0f} s without "
            "renewal)"
        )

    def renew_soon(self) -> None:
        """:meth:`take` again if ``renew_s`` has passed since the last time (a progress
        callback between parts calls this)."""
        if time.monotonic() - self._renewed > self.renew_s:
            self.take()

    def release(self) -> None:
        """Drop this host's claim (another host's stays)."""
        self.records.release(self.prefix, self.host)
