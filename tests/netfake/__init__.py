"""A fake internet for network tests: a network namespace with "public" hosts in the
RFC 2544 benchmark range (198.18.0.0/15), HTTP/HTTPS servers answering with the name they
saw, an authoritative DNS server for ``*.test`` that records every query, a rogue
resolver, DoH, UDP echo, SMTP-ish and SSH-ish listeners. Nothing real is ever contacted.

``FakeInternet`` (``tests.netfake.internet``) is the entry point; it needs root.
"""

from tests.netfake.internet import FakeEvent, FakeInternet, FakeInternetError, free_net_pool

__all__ = ["FakeEvent", "FakeInternet", "FakeInternetError", "free_net_pool"]
