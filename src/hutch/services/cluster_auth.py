"""Host-to-host calls: the forwarding hutchd vouches for the caller it authenticated.

A request that reaches a hutchd for a sandbox on another host is authenticated where it
arrived (the caller's key, checked there against the shared database) and forwarded
without the key: the forwarder signs *who* the caller is (key id, project, role,
address), the method and the path, and the time, with the cluster secret (HMAC-SHA256).
The owner host checks the signature and the age (at most :data:`MAX_SKEW_S`) and acts
as that principal, so quotas, roles, the meter and the audit trail see the caller,
never a cluster identity. A key is never replayed to another host; a sniffed signature
is good for one method and path for a minute (deployments across machines run the
inter-host traffic over a private network or TLS: ARCHITECTURE.md, "Many hosts").
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path

from hutch.contract.auth import Principal, Role
from hutch.errors import Unauthorized

__all__ = [
    "FORWARD_HEADERS",
    "MAX_SKEW_S",
    "ClusterSigner",
    "load_or_create_secret",
]

#: Seconds a signed forward is accepted after (or before) it was signed.
MAX_SKEW_S = 60.0
H_PRINCIPAL = "hutch-cluster-principal"
H_TIME = "hutch-cluster-time"
H_FROM = "hutch-cluster-from"
H_SIGNATURE = "hutch-cluster-signature"
#: The headers a forward carries (a client's own copies are dropped before forwarding).
FORWARD_HEADERS = (H_PRINCIPAL, H_TIME, H_FROM, H_SIGNATURE)


def load_or_create_secret(path: Path) -> bytes:
    """The cluster secret (32 random bytes, hex, 0600), created when missing. Every
    host of one cluster must hold the same file (``make cluster-up`` copies it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        text = path.read_text().strip()
        if text:
            return text.encode()
    except FileNotFoundError:
        pass
    value = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value.encode()


class ClusterSigner:
    def __init__(self, secret: bytes, host_id: str) -> None:
        self._secret = secret
        self.host_id = host_id

    def _mac(self, when: str, sender: str, method: str, path: str, who: str) -> str:
        message = "\n".join((when, sender, method.upper(), path, who)).encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def sign(self, who: Principal, method: str, path: str) -> dict[str, str]:
        """The headers of a forward of ``method path`` made for ``who``."""
        doc = {"key_id": who.key_id, "project": who.project, "role": str(who.role)}
        doc["source"] = who.source
        encoded = base64.urlsafe_b64encode(json.dumps(doc, sort_keys=True).encode()).decode()
        when = f"{time.time():.3f}"
        return {
            H_PRINCIPAL: encoded,
            H_TIME: when,
            H_FROM: self.host_id,
            H_SIGNATURE: self._mac(when, self.host_id, method, path, encoded),
        }

    @staticmethod
    def is_forward(headers: Mapping[str, str]) -> bool:
        return H_SIGNATURE in headers

    def verify(self, headers: Mapping[str, str], method: str, path: str) -> Principal:
        """The principal a forward vouches for; Unauthorized when the signature is not
        the cluster secret's for this method and path, or is too old."""
        try:
            encoded, when = headers[H_PRINCIPAL], headers[H_TIME]
            sender, given = headers[H_FROM], headers[H_SIGNATURE]
        except KeyError as exc:
            raise Unauthorized(f"host-to-host call without {exc.args[0]}") from None
        expected = self._mac(when, sender, method, path, encoded)
        if not hmac.compare_digest(expected.encode(), given.encode()):
            raise Unauthorized("host-to-host call with a wrong signature (another cluster secret?)")
        try:
            age = abs(time.time() - float(when))
        except ValueError:
            raise Unauthorized("host-to-host call with a malformed time") from None
        if age > MAX_SKEW_S:
            raise Unauthorized(
                f"host-to-host call signed {age:.0f} s away from this host's clock "
                f"(accepted: {MAX_SKEW_S:.0f} s; are the hosts' clocks in sync?)"
            )
        try:
            doc = json.loads(base64.urlsafe_b64decode(encoded))
            return Principal(
                key_id=str(doc["key_id"]),
                project=str(doc["project"]),
                role=Role(doc["role"]),
                source=str(doc.get("source", "")),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise Unauthorized(f"host-to-host call with a malformed principal: {exc}") from exc
