"""Making a guest trust its project's egress CA (TLS inspection).

When a sandbox's policy may terminate its TLS (``inspection: full`` or ``learn``, or
``partial`` with a request rule that can apply to port 443), its clients must accept
the leaves its project's CA mints. The CA *certificate* (public; its key never leaves
the host) is written into the guest at create, and when such a policy is set on a
running sandbox:

- ``/usr/local/share/ca-certificates/hutch-egress-ca.crt`` (Debian's place for local CAs;
  ``update-ca-certificates`` keeps it), and
- appended to Debian's bundle ``/etc/ssl/certs/ca-certificates.crt`` (OpenSSL, curl,
  Python's ``ssl``), unless it is there already;

and every command then gets ``SSL_CERT_FILE`` and ``REQUESTS_CA_BUNDLE`` (the bundle:
Python ``requests`` uses certifi's own otherwise) and ``NODE_EXTRA_CA_CERTS`` (the CA
alone: Node keeps its built-in roots and adds it). A command's own env overrides them.
A client that pins certificates fails its handshake, which the proxy logs.
"""

from __future__ import annotations

from hutch.errors import HutchError
from hutch.guest.client import AgentClient

__all__ = ["BUNDLE", "CA_FILE", "install_ca", "trust_env"]

CA_FILE = "/usr/local/share/ca-certificates/hutch-egress-ca.crt"
BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def trust_env() -> dict[str, str]:
    """The variables every command gets while the sandbox's TLS is inspected."""
    return {"SSL_CERT_FILE": BUNDLE, "REQUESTS_CA_BUNDLE": BUNDLE, "NODE_EXTRA_CA_CERTS": CA_FILE}


async def install_ca(agent: AgentClient, ca_pem: bytes) -> None:
    """Write the CA into the guest's trust store (see the module docstring); writing it
    twice changes nothing. Raises the agent's GuestError when a write fails."""
    await agent.write_file(CA_FILE, ca_pem, mode=0o644)
    bundle = b""
    try:
        async for piece in agent.read_file(BUNDLE):
            bundle += piece
    except HutchError:
        bundle = b""  # no ca-certificates in this image: the bundle is hutch's CA alone
    if ca_pem.strip() in bundle:
        return
    if bundle and not bundle.endswith(b"\n"):
        bundle += b"\n"
    await agent.write_file(BUNDLE, bundle + ca_pem, mode=0o644)
