"""TLS inspection in the egress proxy: a connection whose rules need its requests is
terminated with a leaf from its project's CA, and each request inside is decided alone.

:class:`hutch.net.proxy.EgressProxy` hands a connection here once its ClientHello's SNI
is read and ``proxy_decide.terminates_tls`` says so (inspection ``full`` and ``learn``,
or ``partial`` for a destination whose first matching rule needs the request). Kept
apart from the proxy's plain path because all of this (the guest-facing handshake,
HTTP/1.1 and HTTP/2 inside, Host against SNI, upstream TLS) is used only here; what it
needs of the proxy is :class:`InspectingProxy`.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from ipaddress import IPv4Address, IPv6Address
from typing import Any, Protocol

from hutch.contract.views import Verdict
from hutch.errors import NetworkError
from hutch.net.dns import SandboxNet
from hutch.net.h2_relay import serve_h2
from hutch.net.http_head import RequestHead
from hutch.net.inspected_http import Checked, Refused, Upstream, serve_inspected
from hutch.net.proxy_decide import (
    Allowed,
    Denied,
    HttpFacts,
    decide_destination,
    decide_request,
    observed,
)
from hutch.net.rules import EgressPolicy, normalize_name
from hutch.net.tls_ca import ProjectCAs
from hutch.net.tls_stream import TlsStream

__all__ = ["InspectingProxy", "inspect_tls"]

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class InspectingProxy(Protocol):
    """What :func:`inspect_tls` needs of the proxy that owns the connection."""

    #: The projects' CAs minting leaves for guests, and how upstream servers are
    #: verified: read per connection (the daemon sets them after the proxy starts).
    ca: ProjectCAs | None
    upstream_tls: ssl.SSLContext | None

    def current(self, src: IPv4Address | IPv6Address) -> SandboxNet | None:
        """The sandbox at ``src`` with the rules in force now (None: gone)."""
        ...

    def reveal(self, sandbox: SandboxNet) -> Callable[[str], str] | None:
        """How a transform's secret names become values for ``sandbox``'s project."""
        ...

    def event(
        self,
        sandbox: SandboxNet,
        destination: str,
        port: int | None,
        protocol: str,
        name: str | None,
        verdict: Verdict,
        rule: str | None,
        reason: str,
        *,
        http: HttpFacts | None = None,
        index: int | None = None,
    ) -> None:
        """Log one decision."""
        ...

    def open_relay(
        self,
        sandbox: SandboxNet,
        src: IPv4Address | IPv6Address,
        name: str,
        port: int,
        protocol: str,
        transports: tuple[asyncio.WriteTransport, ...],
        address: str,
    ) -> Callable[[], None] | None:
        """Register a relayed connection for revalidation; returns what ends that (None,
        logged, when the rules no longer allow it)."""
        ...

    async def connect(
        self,
        policy: EgressPolicy,
        name: str,
        port: int,
        rule_text: str | None,
        tls: ssl.SSLContext | None = None,
    ) -> tuple[Connection, IPv4Address]:
        """Resolve ``name`` on the host and connect (raising Denied)."""
        ...

    def counter(self, sandbox_id: str) -> Callable[[int], None]:
        """Where the bytes a sandbox sends are counted (the meter's egress bytes)."""
        ...


async def inspect_tls(
    proxy: InspectingProxy,
    sandbox: SandboxNet,
    src: IPv4Address | IPv6Address,
    name: str,
    port: int,
    raw: bytes,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    handshake_timeout_s: float,
) -> None:
    """Inspection ``full``: the destination is checked by SNI, then TLS is terminated
    with a leaf for ``name`` from hutch's CA (ALPN ``h2`` or ``http/1.1``), and every
    HTTP request (HTTP/1.1: :mod:`hutch.net.inspected_http`) or HTTP/2 stream
    (:mod:`hutch.net.h2_relay`) inside is decided on its own and sent over an
    upstream TLS connection verified for ``name`` (reused while allowed). What cannot
    be read is refused, never passed. ``raw``: the bytes already read (the ClientHello)."""

    def deny(reason: str, rule: str | None = None, index: int | None = None, **kw: Any) -> None:
        proxy.event(sandbox, name, port, "https", name, "deny", rule, reason, index=index, **kw)

    try:
        observed(lambda p: decide_destination(p, name, port), sandbox.policy)
    except Denied as denied:
        deny(denied.reason, denied.rule, denied.index)
        return
    ca, upstream_tls = proxy.ca, proxy.upstream_tls
    if ca is None or upstream_tls is None:
        deny("TLS inspection needs the egress CAs, which this proxy was not given")
        return
    norm = normalize_name(name) or name
    try:  # the sandbox's own project's CA: its guest trusts no other
        context = ca.for_project(sandbox.project).server_context(norm)
    except NetworkError as exc:
        deny(f"the project's egress CA is not available: {exc}")
        return
    tls = TlsStream(reader, writer, context, raw)
    try:
        async with asyncio.timeout(handshake_timeout_s):
            await tls.handshake()
    except (ssl.SSLError, ConnectionError, OSError, TimeoutError) as exc:
        deny(
            "the TLS handshake with the guest failed (a client must trust hutch's CA; "
            f"pinned certificates cannot be inspected): {exc or 'timed out'}"
        )
        return
    release = proxy.open_relay(sandbox, src, name, port, "https", (writer.transport,), name)
    if release is None:
        return

    async def check(request: RequestHead, idle: Upstream | None) -> Checked:
        http = HttpFacts.of(request)
        try:
            if normalize_name(request.host.host) != norm or request.host.port not in (
                None,
                port,
            ):
                raise Denied(
                    f"the Host header ({request.host.host}) is not the TLS server name "
                    f"({name}:{port}); domain fronting is refused"
                )
            # Live changes apply to the next request: the rules in force now.
            now = proxy.current(src)
            if now is None:
                raise Denied("the sandbox is gone")
            reveal = proxy.reveal(now)

            def decide(policy: EgressPolicy) -> Allowed:
                decide_destination(policy, name, port)
                return decide_request(policy, name, port, request, reveal)

            allowed = observed(decide, now.policy)
            upstream = idle
            if upstream is None:  # same name as before (Host = SNI): reuse if we can
                (up_reader, up_writer), addr = await proxy.connect(
                    now.policy, name, port, allowed.rule, upstream_tls
                )
                upstream = Upstream(up_reader, up_writer, str(addr))
        except Denied as denied:
            deny(denied.reason, denied.rule, denied.index, http=http)
            raise Refused(denied.reason) from None
        rule = allowed.rule
        proxy.event(
            sandbox, upstream.address, port, "https", name, "allow", rule,
            allowed.note or ("allowed by rule" if rule else "open egress"), http=http,
            index=allowed.index,
        )  # fmt: skip

        def done(cut: str | None) -> None:
            if cut is not None:
                proxy.event(sandbox, upstream.address, port, "https", name, "deny", rule, cut)

        head = (allowed.head or request).head
        secrets = [v.encode() for v in allowed.secrets]
        return Checked(head, upstream, secrets, done)

    def refused(_request: RequestHead | None, reason: str) -> None:
        deny(reason)

    try:
        sent = proxy.counter(sandbox.sandbox_id)
        if tls.alpn == "h2":
            await serve_h2(tls, check, refused, sent)
        else:
            await serve_inspected(tls, check, refused, sent)
        await tls.close()
    finally:
        release()
